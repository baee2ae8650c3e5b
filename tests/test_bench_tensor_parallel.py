"""The two-GPU benchmark script on the CPU: it parses its arguments, says what it needs, and
tabulates results (medians over launches, ratios to capturepass side by side)."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import run_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "tensor_parallel.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("tensor_parallel.py", *args)


def test_tensor_parallel_help_and_bad_arguments():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--procs", "--nproc", "--iters", "--workloads", "--out", "--budget-s"):
        assert flag in proc.stdout
    proc = _run("--workloads", "ep2:16", "moe:16")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "tensor_parallel: workload 'moe:16': NAME:T with NAME one of ep2, ep, tp"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="two GPUs here")
def test_tensor_parallel_without_two_gpus_says_so():
    proc = _run("--procs", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("tensor_parallel: needs 2 CUDA devices, this machine has ")


def _bench(monkeypatch):
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    spec = importlib.util.spec_from_file_location("bench_tensor_parallel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tensor_parallel_table(monkeypatch):
    bench = _bench(monkeypatch)

    def launch(scale: float) -> dict:
        ms = {"serial": 0.19, "hand": 0.155, "reduce-overhead": 0.48, "capturepass": 0.15, "capturepass-replay": 0.14}
        return {"device": "GPU", "world": 2, "torch": "2.x", "rows": [
            {"workload": "ep2", "shape": "T=16", "ms": {k: v * scale for k, v in ms.items()},
             "err": {"hand": 0.0, "reduce-overhead": 1e-3, "capturepass": 2e-3}, "notes": [],
             "lanes": ["main", "comm", "aux0"], "waits": 5},
            {"workload": "tp", "shape": "T=256", "ms": {"serial": 0.3 * scale, "hand": 0.25 * scale},
             "err": {"hand": 0.0}, "notes": ["capturepass: RuntimeError: boom"]},
        ]}

    assert_expected_inline(bench.table([launch(1.0), launch(1.2), launch(0.9)]), """\
device: GPU x2, torch 2.x, processes: 3

| workload | shape | serial ms | hand ms | reduce-overhead ms | capturepass ms | capturepass-replay ms | hand / capturepass | serial / capturepass | reduce-overhead / capturepass | rel err (hand, ro, cp) |
|---|---|---|---|---|---|---|---|---|---|---|
| ep2 | T=16 | 0.1900 | 0.1550 | 0.4800 | 0.1500 | 0.1400 | 1.033x | 1.267x | 3.200x | 0.0e+00, 1.0e-03, 2.0e-03 |
| tp | T=256 | 0.3000 | 0.2500 | n/a | n/a | n/a | n/a | n/a | n/a | 0.0e+00, n/a, n/a |

ratios: the variant's median time over capturepass's (above 1: capturepass is faster); errors: relative to the serial graph's output, first launch

capturepass: ep2 T=16: lanes main comm aux0 (5 waits)

failures:
- tp T=256: capturepass: RuntimeError: boom""")
