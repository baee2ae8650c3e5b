"""The overlap benchmark script on the CPU: a workload without its token count is refused
(it would have run the MoE block at zero tokens and reported it as a measurement)."""

from __future__ import annotations

from tests.helpers import run_bench


def _run(*args: str):
    return run_bench("overlap.py", *args)


def test_a_workload_needs_its_tokens():
    for bad in ("moe", "moe:", "mlp:16", "moe:x"):
        proc = _run("--workloads", bad)
        assert proc.returncode == 2, (bad, proc.stderr[-500:])
        assert f"--workloads {bad!r}: expected moe:TOKENS or attn:0" in proc.stderr
