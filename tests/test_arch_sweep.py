"""scripts/arch_sweep.py on the CPU: one architecture outside the zoo equal to eager, and a bad name refused."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "arch_sweep.py")


def test_an_architecture_outside_the_zoo_compiles_equal_to_eager():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "OK   opt: largest difference" in run.stdout
    assert "1 of 1 equal to eager" in run.stdout


def test_an_unknown_architecture_is_named():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt,nope"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown architecture: nope" in run.stderr
