"""``scripts/breakable_replay.py``: the heap abort's pattern, small, checked where it can run here.

On a GPU the script replays captured segments with an op run eagerly between them (under
capturepass, or by hand in plain torch as the control). Here: its segment plan (what the
hand-written control captures) has a segment between every two calls of the op and computes
what the model computes, and the capturepass mode runs equal to eager.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import breakable_replay  # noqa: E402


def test_the_plan_has_a_break_at_every_call_of_the_op_and_a_segment_between():
    model = breakable_replay.Experts(hidden=32, inter=64, experts=4, layers=3)
    kinds = [brk for brk, _ in breakable_replay._groups(model)]
    # route | up | activate | down | combine+route | up | ... | combine
    assert kinds == [False, True, False, True, False, True, False, True, False, True, False, True, False]


def test_the_segments_run_eagerly_compute_what_the_model_computes():
    model = breakable_replay.Experts(hidden=32, inter=64, experts=4, layers=2)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    segments = breakable_replay.Segments(model, capture=False)
    with torch.no_grad():
        assert torch.equal(segments(x), model(x))


def test_the_capturepass_mode_runs_equal_to_eager():
    done = subprocess.run([sys.executable, "scripts/breakable_replay.py", "--device", "cpu", "--calls", "4",
                           "--layers", "2", "--hidden", "64"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("OK   capturepass {}: 4 calls, largest difference from eager")


def test_the_torch_mode_refuses_a_device_without_cuda_graphs():
    done = subprocess.run([sys.executable, "scripts/breakable_replay.py", "--device", "cpu", "--mode", "torch"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--mode torch captures CUDA graphs: it needs --device cuda" in done.stderr
