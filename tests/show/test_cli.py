"""``capturepass show DIR``: read back what a compile did, from its dump directory.

The counts are derived by hand for a two-branch model whose left branch is
hinted onto lane "aux", compiled with ``policy="hints"`` and
``cudagraphs="monolithic"`` (on the host, capture is bookkeeping only):

- lanes 2: ``main`` and ``aux``;
- records 2, waits 2: the fork (main records at the segment start, aux waits
  before its first node) and the join (aux records after ``relu``, main waits
  before ``add``);
- leases 2: a fork event and a join event never share a lease;
- retained 4: the one captured segment retains the static inputs it reads,
  the weights and biases of both linear layers;
- segments 1, breaks 0.

The decisions, also by hand: every kernel costs the nominal device's 2 us launch
floor, so one lane would take 10 us (five kernels); on two lanes main runs
``addmm_1``, ``tanh`` and, after the join wait, ``add``, while aux runs its two
hinted kernels: 6.04 us (the record and wait markers take 0.01 us each in the
simulation: main's fork record, aux's fork wait and join record, main's join
wait). Both aux kernels are there by their hint; nothing has a capability other
than the default. The four retained objects are the linear layers' weights and
biases (``arg0_1``, ``arg1_1``, ``arg3_1``, ``arg4_1``), kept by segment ``k0`` of
the graph's owner: ``gN``, the number the compile driver gave the graph in this
process (``OWNER`` below), the name its runtime owners start with.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir import meta
from capturepass.show import cli
from capturepass.show import summary as show_summary

EXPECTED = {"lanes": 2, "records": 2, "waits": 2, "leases": 2, "retained": 4, "segments": 1, "breaks": []}
OWNER: dict[str, str] = {}  # the dump_dir fixture's graph owner, as the compile driver numbered it


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.relu(self.a(x))
        return h + torch.tanh(self.b(x))


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    torch._dynamo.reset()
    root = tmp_path_factory.mktemp("dump")
    torch.manual_seed(0)
    model = TwoBranch()
    options = {"inner": "eager", "policy": "hints", "cudagraphs": "monolithic", "dump_dir": str(root)}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="capturepass", options=options)(x), model(x))
    OWNER["graph"] = str(meta.graph_info(last_compiled()[-1].graph).owner)
    torch._dynamo.reset()
    return str(root)


def test_show_prints_what_the_compile_did(dump_dir, capsys):
    assert cli.main(["show", dump_dir]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    (graph_dir,) = os.listdir(dump_dir)
    owner = OWNER["graph"]
    assert lines[0] == f"graph {graph_dir} (inference, owner {owner}, cudagraphs=monolithic)"
    assert lines[1] == "  lanes 2: s0=main s1=aux"
    assert lines[2] == "  records 2, waits 2, leases 2, releases 0, retained 4, segments 1, breaks 0"
    # The one model that ran, by the runtime's name for it (owners.json): graph owner, model 0.
    assert lines[3:5] == ["  owners at run time: 1 model(s), 1 owner(s)",
                          f"    model {owner}.m0: {owner}.m0.eager (uncaptured runs, the first of f32[4,8])"]
    waits = [line for line in lines if line.startswith("  wait ")]
    assert len(waits) == 2
    assert waits[0].startswith("  wait %") and " on s1 for e0 (fork, lease l0): fork k0" in waits[0]
    assert " on s0 for e1 (join, lease l1): %relu->%add" in waits[1]
    assert lines[-1] == "total: lanes 2, records 2, waits 2, leases 2, retained 4, segments 1, breaks 0"
    assert lines[5:9] == [
        "  schedule (estimated, nominal device): one lane 10.00 us, on 2 lane(s) 6.04 us; overlap gains 3.96 us (40%)",
        "  lane s0 main: 3 kernel(s): %addmm_1, %tanh, %add",
        "  lane s1 aux: 2 kernel(s), 2 hinted to it (capturepass.lane or a stream region): %addmm, %relu",
        f"  retained by segment k0 (owner {owner}): %arg0_1 f32[8,8], %arg1_1 f32[8], %arg3_1 f32[8,8], %arg4_1 f32[8]",
    ]


def test_show_json_holds_the_decisions_and_retained_objects(dump_dir, capsys):
    assert cli.main(["show", dump_dir]) == 0
    text = capsys.readouterr().out.splitlines()
    assert cli.main(["show", dump_dir, "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    assert [d["kind"] for d in graph["decisions"]] == ["schedule", "lane", "lane"]
    for d in graph["decisions"]:  # the same lines as the plain output
        assert f"  {d['text']}" in text
    schedule, main, aux = graph["decisions"]
    assert schedule["timing"] == {
        "source": "estimated", "kernels": 5, "at_floor": 5, "one_lane_us": 10.0, "scheduled_us": 6.04,
        "gained_us": 3.96, "gained_pct": 39.6, "lanes_busy_us": {"s0": 6.0, "s1": 4.0}}
    assert (main["kernels"], main["hinted"], main["scheduled"]) == (["addmm_1", "tanh", "add"], [], [])
    assert (aux["kernels"], aux["hinted"]) == (["addmm", "relu"], ["addmm", "relu"])
    assert graph["retained_objects"] == [
        {"object": a, "kind": "input", "type": t, "owner": OWNER["graph"], "segment": "k0",
         "by": graph["retained_objects"][0]["by"]}
        for a, t in (("arg0_1", "f32[8,8]"), ("arg1_1", "f32[8]"), ("arg3_1", "f32[8,8]"), ("arg4_1", "f32[8]"))]
    assert len(graph["retained_objects"]) == graph["retained"] == 4


def test_show_lists_capability_decisions_and_pass_decisions(tmp_path, capsys):
    """A custom op declared serialized: its capability line, and the decision assign_streams recorded."""
    try:
        @torch.library.custom_op("capturepass_cli_test::step", mutates_args=())
        def step(x: torch.Tensor) -> torch.Tensor:
            return x + 1.0

        @step.register_fake
        def _(x):
            return torch.empty_like(x)

        capturepass.register_capability(step, overlap="serialize")

        class WithStep(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

            def forward(self, x):
                return torch.ops.capturepass_cli_test.step(self.a(x)) + torch.tanh(self.b(x))

        torch._dynamo.reset()
        x = torch.randn(4, 8)
        model = WithStep()
        with torch.no_grad():
            out = torch.compile(model, backend="capturepass", options={"inner": "eager", "dump_dir": str(tmp_path)})(x)
            torch.testing.assert_close(out, model(x))
        torch._dynamo.reset()
    finally:
        capturepass.ir.capabilities.REGISTRY.unregister(step)
    assert cli.main(["show", str(tmp_path)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert ("  capability step: serialized: no other lane runs beside it; because: declared overlap=serialize "
            "(registry): %step") in text
    assert "  decision: %step: declared overlap=serialize: serialized, no other lane runs beside it" in text
    assert cli.main(["show", str(tmp_path), "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    (cap,) = [d for d in graph["decisions"] if d["kind"] == "capability"]
    assert cap["op"] == "step" and cap["nodes"] == ["step"]
    assert [d["text"] for d in graph["decisions"] if d["kind"] == "pass"] == [
        "decision: %step: declared overlap=serialize: serialized, no other lane runs beside it"]


def test_show_json_has_the_exact_counts(dump_dir, capsys):
    assert cli.main(["show", dump_dir, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(show_summary.SUMMARY_KEYS) <= set(summary)
    assert {k: summary[k] for k in show_summary.SUMMARY_KEYS} == EXPECTED
    (graph,) = summary["graphs"]
    assert {k: graph[k] for k in show_summary.SUMMARY_KEYS} == EXPECTED
    assert graph["lane_names"] == ["main", "aux"]
    assert graph["graph"] == "inference" and graph["cudagraphs"] == "monolithic"
    assert [(w["lane"], w["role"], w["why"]) for w in graph["wait_reasons"]] == [
        (1, "fork", "fork k0"),
        (0, "join", "%relu->%add"),
    ]


def test_show_one_graph_folder(dump_dir, capsys):
    (graph_dir,) = os.listdir(dump_dir)
    assert cli.main(["show", os.path.join(dump_dir, graph_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {k: summary[k] for k in show_summary.SUMMARY_KEYS} == EXPECTED


def _run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "capturepass", *args], capture_output=True, text=True, timeout=300
    )


def test_python_dash_m_capturepass_show(dump_dir, capsys):
    proc = _run_module("show", dump_dir)
    assert proc.returncode == 0, proc.stderr
    assert cli.main(["show", dump_dir]) == 0
    assert proc.stdout == capsys.readouterr().out
    assert proc.stdout.rstrip().endswith(
        "total: lanes 2, records 2, waits 2, leases 2, retained 4, segments 1, breaks 0"
    )


def test_missing_directory_exits_2_with_a_message(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert cli.main(["show", missing]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("capturepass show: ")
    assert repr(missing) in captured.err

    proc = _run_module("show", missing, "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "capturepass show: " in proc.stderr and repr(missing) in proc.stderr


def test_directory_without_a_dump_exits_2(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path)]) == 2
    assert "no capturepass dump" in capsys.readouterr().err


def test_corrupt_graph_json_exits_2(tmp_path, capsys):
    (tmp_path / "graph.json").write_text("{not json")
    assert cli.main(["show", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("capturepass show: ")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["show"])
    assert info.value.code == 2


def test_show_lists_external_streams_and_their_joins(tmp_path, capsys):
    torch._dynamo.reset()
    model = TwoBranch()
    options = {"inner": "eager", "policy": "hints", "cudagraphs": "monolithic", "dump_dir": str(tmp_path),
               "external_streams": {"offload": "before", "comm": "both"}}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="capturepass", options=options)(x), model(x))
    torch._dynamo.reset()
    assert cli.main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  external stream comm (both): 2 join(s)\n" in out
    assert "  external stream offload (before): 1 join(s)\n" in out
    assert cli.main(["show", str(tmp_path), "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    assert graph["external"] == [{"name": "comm", "relation": "both", "joins": 2},
                                 {"name": "offload", "relation": "before", "joins": 1}]


# -- malformed dumps: one line naming the file and the field, exit status 2 ----------------------


def _graph_doc(dump_dir: str) -> dict:
    (graph_dir,) = os.listdir(dump_dir)
    with open(os.path.join(dump_dir, graph_dir, "graph.json"), encoding="utf-8") as f:
        return json.load(f)


def _compute_index(doc: dict) -> int:
    return next(i for i, n in enumerate(doc["nodes"]) if n["effect"] == "compute" and "cost" in n)


def _with(doc: dict, edit) -> dict:
    doc = json.loads(json.dumps(doc))
    edit(doc)
    return doc


def _malformed(name: str, doc: dict) -> tuple[bytes, str]:
    """The bytes of a malformed graph.json and the field the error must name (``""``: the file)."""
    i = _compute_index(doc)
    cases = {
        "top-level-list": (json.dumps([doc]).encode(), "top level"),
        "lanes-not-a-list": (json.dumps(_with(doc, lambda d: d.update(lanes=5))).encode(), "lanes"),
        "node-is-a-string": (json.dumps(_with(doc, lambda d: d["nodes"].__setitem__(1, "node"))).encode(),
                             "nodes[1]"),
        "args-not-strings": (json.dumps(_with(doc, lambda d: d["nodes"][i].update(args=[1]))).encode(),
                             f"nodes[{i}].args[0]"),
        "non-utf8": (b'{"graph": "\xff\xfe"}', ""),
        "pickle": (pickle.dumps({"graph": "inference", "nodes": []}), ""),
        "huge-lane": (json.dumps(_with(doc, lambda d: d["nodes"][i].update(lane=10**12))).encode(),
                      f"nodes[{i}].lane"),
        "lane-past-the-lanes": (json.dumps(_with(doc, lambda d: d["nodes"][i].update(lane=len(d["lanes"])))).encode(),
                                f"nodes[{i}].lane"),
        "infinite-cost": (json.dumps(_with(doc, lambda d: d["nodes"][i]["cost"].update(flops="INF"))).encode()
                          .replace(b'"INF"', b"1e999"), f"nodes[{i}].cost.flops"),
        "infinity-literal": (json.dumps(_with(doc, lambda d: d["nodes"][i]["cost"].update(bytes=float("inf")))).encode(),
                             f"nodes[{i}].cost.bytes"),
        "huge-int-cost": (json.dumps(_with(doc, lambda d: d["nodes"][i]["cost"].update(bytes=10**400))).encode(),
                          f"nodes[{i}].cost.bytes"),
        "missing-nodes": (json.dumps(_with(doc, lambda d: d.pop("nodes"))).encode(), "nodes"),
        "missing-effect": (json.dumps(_with(doc, lambda d: d["nodes"][i].pop("effect"))).encode(),
                           f"nodes[{i}].effect"),
        "unknown-effect": (json.dumps(_with(doc, lambda d: d["nodes"][i].update(effect="teleport"))).encode(),
                           f"nodes[{i}].effect"),
        "break-not-an-object": (json.dumps(_with(doc, lambda d: d.update(breaks=["x"]))).encode(), "breaks[0]"),
        "capability-flag-not-a-bool": (
            json.dumps(_with(doc, lambda d: d["nodes"][i]["capability"].update(resident_grid="yes"))).encode(),
            f"nodes[{i}].capability.resident_grid"),
        "deeply-nested": (b"[" * 100_000 + b"]" * 100_000, ""),
        "empty": (b"", ""),
    }
    return cases[name]


MALFORMED = ["top-level-list", "lanes-not-a-list", "node-is-a-string", "args-not-strings", "non-utf8", "pickle",
             "huge-lane", "lane-past-the-lanes", "infinite-cost", "infinity-literal", "huge-int-cost",
             "missing-nodes", "missing-effect", "unknown-effect", "break-not-an-object",
             "capability-flag-not-a-bool", "deeply-nested", "empty"]
FLAGS = [[], ["--json"], ["--html", "out.html"], ["--trace", "out.json"]]


def _assert_one_line_exit_2(argv: list[str], capsys, path: str, field: str) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    prefix = f"capturepass show: {path!r}: " + (f"{field}: " if field else "")
    assert lines[0].startswith(prefix), (lines[0], prefix)


@pytest.mark.parametrize("flags", FLAGS, ids=["text", "json", "html", "trace"])
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_graph_json_names_file_and_field(dump_dir, tmp_path, capsys, case, flags):
    """Regression: these ended in TypeError, UnicodeDecodeError, MemoryError or OverflowError."""
    data, field = _malformed(case, _graph_doc(dump_dir))
    bad = tmp_path / "000_inference"
    bad.mkdir()
    (bad / "graph.json").write_bytes(data)
    flags = [str(tmp_path / f) if f.startswith("out.") else f for f in flags]
    _assert_one_line_exit_2(["show", str(tmp_path), *flags], capsys, str(bad / "graph.json"), field)


@pytest.mark.parametrize("flags", FLAGS, ids=["text", "json", "html", "trace"])
def test_dump_dir_that_is_a_file_exits_2(tmp_path, capsys, flags):
    path = tmp_path / "dump"
    path.write_text("{}")
    flags = [str(tmp_path / f) if f.startswith("out.") else f for f in flags]
    assert cli.main(["show", str(path), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"capturepass show: {str(path)!r}: is a file, not a dump directory (give the folder that holds graph.json)\n"


@pytest.mark.parametrize("flags", FLAGS, ids=["text", "json", "html", "trace"])
def test_dump_dir_without_graph_json_exits_2(tmp_path, capsys, flags):
    (tmp_path / "000_inference").mkdir()
    (tmp_path / "000_inference" / "001_read_hints.txt").write_text("# after read_hints\n")
    flags = [str(tmp_path / f) if f.startswith("out.") else f for f in flags]
    _assert_one_line_exit_2(["show", str(tmp_path), *flags], capsys, str(tmp_path), "")


def test_nan_costs_are_accepted(dump_dir, tmp_path, capsys):
    """The printer writes NaN for a cost without a size hint: that is a valid dump."""
    doc = _graph_doc(dump_dir)
    doc["nodes"][_compute_index(doc)]["cost"]["flops"] = float("nan")
    (tmp_path / "graph.json").write_text(json.dumps(doc))
    assert cli.main(["show", str(tmp_path), "--trace", str(tmp_path / "t.json")]) == 0
    assert capsys.readouterr().out.startswith("graph ")


def test_unwritable_output_exits_2(dump_dir, tmp_path, capsys):
    out = tmp_path / "a-directory"
    out.mkdir()
    assert cli.main(["show", dump_dir, "--html", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"capturepass show: {out}: cannot be written")


def test_malformed_dump_prints_no_traceback_from_the_command_line(tmp_path):
    (tmp_path / "graph.json").write_bytes(pickle.dumps({"graph": "inference"}))
    proc = _run_module("show", str(tmp_path), "--html", str(tmp_path / "out.html"))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"capturepass show: {str(tmp_path / 'graph.json')!r}: is not UTF-8 text")
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("doc, problem", [
    ({}, "lanes: must be a list of strings"),
    ({"lanes": 5, "kernels": 3}, "lanes: must be a list of strings"),
    ({"lanes": ["main"], "mode": "eager", "lanes_from": "streams", "runs": 1, "kernels": [{"lane": 10**12}]},
     "kernels[0].name: must be a string"),
    ({"lanes": ["main"], "mode": "eager", "lanes_from": "streams", "runs": 1,
      "kernels": [{"lane": 0, "name": "k", "stream": 7, "run": 0, "start": 0.0, "dur": float("inf")}]},
     "kernels[0].dur: must be a finite number"),
])
def test_malformed_measured_json_is_not_used_and_the_note_says_why(dump_dir, tmp_path, capsys, doc, problem):
    """A measured.json the trace cannot read falls back to the estimates, naming the field."""
    import shutil

    from capturepass.measure.records import FORMAT

    shutil.copytree(dump_dir, tmp_path / "dump")
    (graph_dir,) = os.listdir(tmp_path / "dump")
    (tmp_path / "dump" / graph_dir / "measured.json").write_text(json.dumps({"format": FORMAT, **doc}))
    out = tmp_path / "trace.json"
    assert cli.main(["show", str(tmp_path / "dump"), "--trace", str(out)]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert f"cost-model estimates (nominal device) for {graph_dir} (measured.json is malformed: {problem})" in note
    assert json.loads(out.read_text())["otherData"]["times"] == "estimated (nominal device)"
