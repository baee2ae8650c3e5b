"""scripts/arch_sweep.py on the CPU: a decoder, an encoder under a padding mask and a vision model outside the
zoo equal to eager, and a bad name refused."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "arch_sweep.py")


def test_architectures_outside_the_zoo_compile_equal_to_eager():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt,distilbert,resnet"], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("opt", "distilbert", "resnet"):
        assert f"OK   {name}: largest difference" in run.stdout
    assert "3 of 3 equal to eager" in run.stdout


def test_an_unknown_architecture_is_named():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt,nope"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown architecture: nope" in run.stderr


def test_a_model_whose_compiles_failed_is_told_apart():
    """A model equal to eager whose regions Inductor failed to compile (run as lane regions or
    eagerly instead) is reported slow: only capturepass's warnings tell it from a clean one. A
    logged break (an op that cannot be captured) is no failed compile."""
    import importlib.util
    import logging

    spec = importlib.util.spec_from_file_location("arch_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    log = logging.getLogger("capturepass")
    with sweep.Fallbacks() as seen:
        log.warning("capturepass: %s: the inductor compiler failed on region %d (lane s0: %%add...): RuntimeError: "
                    "boom; the region runs its graph eagerly instead", "inference graph g15", 3)
        log.warning("capturepass: transformers::grouped_mm_fallback cannot be captured (RuntimeError: ...); "
                    "%%grouped_mm_fallback runs eagerly as a break")
        log.warning("capturepass: inference graph g1: one compile of 6 lane regions failed (...); compiled as lane "
                    "regions instead")
    assert [m.split(": ")[1] for m in seen.messages] == ["inference graph g15", "inference graph g1"]
    assert seen not in log.handlers
