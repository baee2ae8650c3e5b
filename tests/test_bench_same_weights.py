"""bench/same_weights.py on the CPU: variants over one set of weights, each compiled anew and timed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "same_weights.py")


def test_variants_over_the_same_weights_are_each_timed():
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--sizes", "zoo", "--model", "llama",
                          "--variants", "default,off", "--rounds", "1", "--iters", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "llama [8, 1], each variant over the same weights; ms per call, median of 1 rounds"
    assert [re.sub(r"[0-9.]+", "N", x) for x in lines[1:]] == [
        "  default      N (min N, max N)", "  off          N (min N, max N)"]


def test_an_unknown_or_repeated_variant_is_named():
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--variants", "default,fast"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown variant: fast" in run.stderr
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--variants", "off,default,off"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "a variant named twice in off,default,off" in run.stderr
