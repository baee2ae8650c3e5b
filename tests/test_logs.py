"""``TORCH_LOGS=capturepass``: one INFO line per decision; ``+capturepass``: per-pass timings too.

Each enabled setting runs in a fresh interpreter (torch reads ``TORCH_LOGS`` when imported).
The script compiles two graphs: a two-lane model with a serialized custom op
and a non-capturable one (``cudagraphs="breakable"``, so a break), and the
resident-grid example op at a barrier-free size (so work is enqueued first).
Every decision that lands in a dump's ``graph.json`` must appear in the log
exactly once, with the lane assignment and the break.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    import capturepass
    from capturepass.testing import kernels

    @torch.library.custom_op("capturepass_log_test::serial", mutates_args=())
    def serial(x: torch.Tensor) -> torch.Tensor:
        return x + 1.0

    @serial.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op("capturepass_log_test::host", mutates_args=())
    def host(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @host.register_fake
    def _(x):
        return torch.empty_like(x)

    capturepass.register_capability(serial, overlap="serialize")
    capturepass.register_capability(host, capturable=False)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            with capturepass.lane("side"):
                h = torch.relu(self.a(x))
            y = torch.ops.capturepass_log_test.serial(self.b(x)) + h
            return self.c(torch.ops.capturepass_log_test.host(y))

    opts = {"inner": "eager", "cudagraphs": "breakable", "dump_dir": sys.argv[1] + "/m"}
    with torch.no_grad():
        x = torch.randn(4, 16)
        m = M()
        torch.testing.assert_close(torch.compile(m, backend="capturepass", options=opts)(x), m(x))
        n = kernels.NormalizedMoE(d=64, shared=128)
        x = torch.randn(4, 64)
        opts = {"inner": "eager", "dump_dir": sys.argv[1] + "/n"}
        torch.testing.assert_close(torch.compile(n, backend="capturepass", options=opts)(x), n(x))
    """
)


def _start(tmp_path, torch_logs: str | None) -> subprocess.Popen:
    script = tmp_path / "compile_two.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "CAPTUREPASS_DUMP_DIR")}
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str | None, tuple[str, list[dict]]]:
    """The log and the graph.json documents of each setting (run concurrently)."""
    settings = ("capturepass", "+capturepass")
    dirs = {s: tmp_path_factory.mktemp("logs") for s in settings}
    procs = {s: _start(dirs[s], s) for s in settings}
    out = {}
    for s, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        graphs = []
        for sub in ("m", "n"):
            for dirpath, _, files in sorted(os.walk(dirs[s] / sub)):
                if "graph.json" in files:
                    with open(os.path.join(dirpath, "graph.json")) as f:
                        graphs.append(json.load(f))
        out[s] = (err, graphs)
    return out


def _capturepass_lines(log: str, marker: str) -> list[str]:
    return [line for line in log.splitlines() if "capturepass: " in line and marker in line]


def test_info_shows_one_line_per_decision(runs):
    log, graphs = runs["capturepass"]
    assert len(graphs) == 2
    decisions = [d for g in graphs for d in g["decisions"]]
    assert any("serialized, no other lane runs beside it" in d for d in decisions)
    assert any("enqueued" in d and "before it" in d for d in decisions)
    for d in decisions:
        assert len(_capturepass_lines(log, f"assign_streams: {d}")) == 1, (d, log[-3000:])
    lanes = _capturepass_lines(log, "assign_streams: lanes s0=main")
    assert len(lanes) == 2
    assert "s1=side" in lanes[0]
    (brk,) = _capturepass_lines(log, "partition: partition break at %host")
    assert brk.endswith("declared overlap=safe, not capturable")
    assert all(line.startswith("I") for line in _capturepass_lines(log, "inference "))
    assert not _capturepass_lines(log, " took ")


def test_debug_adds_pass_timings(runs):
    log, graphs = runs["+capturepass"]
    timings = _capturepass_lines(log, "pass assign_streams took")
    assert len(timings) == 2 and all(line.startswith("V") or line.startswith("D") for line in timings)
    assert len(_capturepass_lines(log, "pass emit took")) == 2
    assert len(_capturepass_lines(log, "assign_streams: lanes s0=main")) == 2


def test_silent_without_torch_logs(capfd, monkeypatch):
    """Without TORCH_LOGS (this process's setting), compiles print no capturepass line."""
    import torch

    if "capturepass" in os.environ.get("TORCH_LOGS", ""):
        pytest.skip("TORCH_LOGS names capturepass in this process")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with torch.no_grad():
        torch.compile(model, backend="capturepass", options={"inner": "eager"})(torch.randn(2, 8))
    captured = capfd.readouterr()
    assert "capturepass: " not in captured.err + captured.out


def test_registered_with_torch_logging():
    import torch._logging._internal as internal

    import capturepass.logs

    if not callable(getattr(internal, "register_log", None)):
        pytest.skip("this torch has no torch._logging._internal.register_log")
    assert capturepass.logs.register() == "torch"
    assert internal.log_registry.is_log("capturepass")
