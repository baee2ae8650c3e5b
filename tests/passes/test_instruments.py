"""capturepass's dumps in PyTorch's structured trace (``TORCH_TRACE``, read by ``tlparse``).

``TORCH_TRACE`` is read when torch is imported, so the compile runs in a subprocess. With
Inductor as the inner compiler, the trace must hold, tagged with the same compile (frame and
compile id) as Inductor's own entries: one ``artifact`` per pass dump, named
``capturepass_inference_<NNN>_<pass>``, whose payload is the text of that pass's dump file,
and ``capturepass_inference_graph``, the dump's ``graph.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from capturepass.passes.instruments import Dump, structured_trace_on
from capturepass.passes.pipeline import PIPELINE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, torch
    import capturepass

    class TwoBranch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.a(x)) + torch.tanh(self.b(x))

    torch.manual_seed(0)
    model = TwoBranch()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="capturepass", options={"dump_dir": sys.argv[1]})(x)
        torch.testing.assert_close(out, model(x))
""")


def _entries(text: str) -> list[tuple[dict, str]]:
    """The structured trace's records: (the JSON after the log prefix, the payload)."""
    out: list[tuple[dict, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("\t"):
            out[-1][1].append(line[1:])
        elif line.strip():
            out.append((json.loads(line[line.index("] ") + 2:]), []))
    return [(m, "\n".join(p)) for m, p in out]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    trace_dir, dump_dir = tmp / "trace", tmp / "dump"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "CAPTUREPASS_DUMP_DIR")}
    env.update(TORCH_TRACE=str(trace_dir), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-cache"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(dump_dir)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (log,) = os.listdir(trace_dir)
    with open(trace_dir / log, encoding="utf-8") as f:
        entries = _entries(f.read())
    (graph_dir,) = os.listdir(dump_dir)
    return entries, dump_dir / graph_dir


def test_every_pass_dump_and_graph_json_is_an_artifact(traced):
    entries, folder = traced
    ours = {m["artifact"]["name"]: (m, payload) for m, payload in entries
            if "artifact" in m and m["artifact"]["name"].startswith("capturepass_")}
    passes = [f"{i:03d}_{cls.name}" for i, cls in enumerate(PIPELINE)]
    assert sorted(ours) == sorted([f"capturepass_inference_{p}" for p in passes] + ["capturepass_inference_graph"])
    for p in passes:
        meta, payload = ours[f"capturepass_inference_{p}"]
        assert meta["artifact"]["encoding"] == "string"
        assert payload.rstrip("\n") == (folder / f"{p}.txt").read_text().rstrip("\n")
    meta, payload = ours["capturepass_inference_graph"]
    assert meta["artifact"]["encoding"] == "json"
    assert json.loads(payload) == json.loads((folder / "graph.json").read_text())


def test_artifacts_sit_with_inductors_own_under_the_same_compile(traced):
    entries, _ = traced
    ours = [m for m, _ in entries if m.get("artifact", {}).get("name", "").startswith("capturepass_")]
    inductor = [m for m, _ in entries if "inductor_output_code" in m]
    assert inductor, "no Inductor output code in the trace"
    compile_of = {(m.get("frame_id"), m.get("frame_compile_id")) for m in ours}
    assert compile_of == {(inductor[0].get("frame_id"), inductor[0].get("frame_compile_id"))} == {(0, 0)}


def test_no_structured_trace_no_dumps():
    """Without TORCH_TRACE (as in this process) and without a dump directory, no dump is printed."""
    assert not structured_trace_on()
    assert Dump(None, lambda p: 0).trace is False
