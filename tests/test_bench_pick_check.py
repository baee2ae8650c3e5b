"""bench/pick_check.py on the CPU: arguments, the refusal without CUDA, the report's rows."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

from capturepass.runtime.choices import PickRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "pick_check.py")


def _load():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_pick_check", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    return mod


def test_help_unknown_model_and_no_cuda():
    ok = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--prefill" in ok.stdout
    bad = subprocess.run([sys.executable, SCRIPT, "--models", "llama,nope"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown model: nope" in bad.stderr
    if not torch.cuda.is_available():
        cpu = subprocess.run([sys.executable, SCRIPT, "--models", "llama"], capture_output=True, text=True,
                             timeout=120)
        assert cpu.returncode == 1 and "needs a CUDA device" in cpu.stderr


def test_rows_set_the_pickers_figures_beside_the_replays_alone():
    bench = _load()
    cands = [{"name": "model", "lanes": 3, "estimate_us": 839.7, "measured_us": 615.0},
             {"name": "one_lane", "lanes": 1, "estimate_us": 1008.7, "measured_us": 613.1},
             {"name": "aux1", "lanes": 2, "estimate_us": 863.5, "measured_us": 627.8}]
    record = PickRecord("inference", "(int64[8, 1])", "H200 sm90", "one_lane", False, 200.0, 19, 315, cands)
    got = bench.rows("qwen2_moe", "[8, 1]", record, {"default": 613.2, "model": 617.9, "off": 616.8},
                     {"default": 624.6, "model": 629.5, "off": 627.1})
    assert got == [
        "| qwen2_moe | [8, 1] | model | 615.0 | 617.9 | 0.995 |",
        "| qwen2_moe | [8, 1] | one_lane (chosen) | 613.1 | 616.8 | 0.994 |",
        "| qwen2_moe | [8, 1] | aux1 | 627.8 |  |  |",
        "| qwen2_moe | [8, 1] | whole call: default (replays one_lane) | 624.6 | 613.2 | 1.019 |",
        '| qwen2_moe | [8, 1] | whole call: pick="model" | 629.5 | 617.9 | 1.019 |',
        '| qwen2_moe | [8, 1] | whole call: policy="off" | 627.1 | 616.8 | 1.017 |',
    ]


def test_rows_of_a_graph_that_measured_nothing():
    bench = _load()
    got = bench.rows("llama", "[2, 128]", None, {"default": 1.0, "model": 2.0, "off": 3.0},
                     {"default": 4.0, "model": 5.0, "off": 6.0})
    assert got[0] == "| llama | [2, 128] | model |  | 2.0 |  |"
    assert got[-3:] == ["| llama | [2, 128] | whole call: default (replays (none measured)) | 4.0 | 1.0 | 4.000 |",
                        '| llama | [2, 128] | whole call: pick="model" | 5.0 | 2.0 | 2.500 |',
                        '| llama | [2, 128] | whole call: policy="off" | 6.0 | 3.0 | 2.000 |']
