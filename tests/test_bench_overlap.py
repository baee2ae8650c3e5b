"""The overlap benchmark script on the CPU: a workload without its token count is refused
(it would have run the MoE block at zero tokens and reported it as a measurement)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "overlap.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_a_workload_needs_its_tokens():
    for bad in ("moe", "moe:", "mlp:16", "moe:x"):
        proc = _run("--workloads", bad)
        assert proc.returncode == 2, (bad, proc.stderr[-500:])
        assert f"--workloads {bad!r}: expected moe:TOKENS or attn:0" in proc.stderr
