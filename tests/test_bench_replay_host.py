"""The replay host-time benchmark on the CPU: what it refuses, and that it says it needs a GPU
(it times CUDA graph launches) instead of measuring something else."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_bench


def test_an_unknown_variant_or_model_is_refused():
    proc = run_bench("replay_host.py", "--variants", "capturepass,eager")
    assert proc.returncode == 2 and "unknown variant(s) eager" in proc.stderr, proc.stderr[-500:]
    proc = run_bench("replay_host.py", "--model", "bert")
    assert proc.returncode == 2 and "unknown model 'bert'" in proc.stderr, proc.stderr[-500:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it runs the measurement")
def test_without_a_gpu_it_says_so():
    proc = run_bench("replay_host.py", "--model", "llama")
    assert proc.returncode == 1 and "it needs a GPU" in proc.stderr, proc.stderr[-500:]
