"""scripts/vllm_sweep.py's verdicts, on made-up generations (the engines themselves run in the
vLLM stage: tests/vllm/test_vllm_engine.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("vllm_sweep", os.path.join(ROOT, "scripts", "vllm_sweep.py"))
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

REFERENCE = {"tokens": [5, 9, 9, 3], "logprobs": [-4.0, -4.2, -4.1, -3.9]}


def gen(shift: float, tokens=None) -> dict:
    return {"tokens": list(tokens or REFERENCE["tokens"]), "logprobs": [x + shift for x in REFERENCE["logprobs"]]}


@pytest.mark.parametrize("got, own, want", [
    (gen(5e-5), gen(0.0), "OK"),          # within rounding of mode 0
    (gen(2e-4), gen(0.0), "FAIL"),        # beyond it, while vLLM's own compile is not
    (gen(1e-3), gen(1e-3), "VLLM"),       # equal to vLLM's own compile, which is beyond it too
    (gen(1e-3), gen(2e-3), "FAIL"),       # beyond both
    (gen(1e-3), None, "FAIL"),            # no control to blame
    (gen(0.0, [5, 9, 9, 4]), gen(0.0, [5, 9, 9, 4]), "VLLM"),  # vLLM's own compile's tokens
    (gen(0.0, [5, 9, 9, 4]), gen(0.0, [5, 9, 2, 3]), "FAIL"),  # tokens of neither
    (gen(0.0), gen(0.0, [5, 9, 9, 4]), "OK"),
])
def test_verdict(got, own, want):
    assert sweep.verdict(got, REFERENCE, own) == want


def test_every_sweep_model_is_a_known_architecture():
    """Each sweep config names one vLLM architecture and differs from the engine tests' models."""
    from run_engine import CONFIG, MOE_CONFIG
    archs = [c["architectures"] for c in sweep.SWEEP_CONFIGS.values()]
    assert all(len(a) == 1 for a in archs)
    assert len({a[0] for a in archs}) == len(archs)
    assert not {a[0] for a in archs} & {CONFIG["architectures"][0], MOE_CONFIG["architectures"][0]}
