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
