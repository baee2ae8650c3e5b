"""One owner numbering, from the dump to the runtime (``capturepass.runtime.naming``).

A compiled graph's dump names its owner by the graph's own id (``gN``); at run time the
graph's callable names each of its owners after it: ``gN.mI.eager`` for model instance
``I``'s uncaptured runs, ``gN.mI.cJ`` for its ``J``-th capture shape. Errors, logs,
``owners.json`` and ``capturepass show`` use these names, and two models of one class
(one compiled graph) are two owners in each of them. On the host nothing is captured,
so the CPU tests see eager owners; the ``gpu`` test checks the capture owners.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.errors import CapturePassError, ResourceError
from capturepass.ir import meta
from capturepass.runtime import naming
from capturepass.runtime.owner import GraphOwner
from capturepass.show import cli


class _Lin(torch.nn.Module):
    def __init__(self, scale: float, device: str = "cpu") -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 8, device=device)
        self.scale = torch.nn.Parameter(torch.tensor(scale, device=device), requires_grad=False)

    def forward(self, x):
        return self.l(x).relu() * self.scale


def _compile(model, dump_dir=None, **options):
    options.setdefault("inner", "eager")
    if dump_dir is not None:
        options["dump_dir"] = str(dump_dir)
    return torch.compile(model, backend="capturepass", options=options)


def _graph_json(folder) -> dict:
    (graph_dir,) = [d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))]
    with open(os.path.join(folder, graph_dir, "graph.json"), encoding="utf-8") as f:
        return json.load(f)


def _show(capsys, folder, *flags) -> str:
    assert cli.main(["show", str(folder), *flags]) == 0
    return capsys.readouterr().out


_WRONG_DEVICE = [False]


def _staged_impl(x: torch.Tensor) -> torch.Tensor:
    # Scratch bound to the running owner; on another device than the owner's on request, which
    # the runtime refuses, naming the owner.
    device = "meta" if _WRONG_DEVICE[0] else x.device
    capturepass.workspace("staged", tuple(x.shape), x.dtype, device=device)
    return x.sin()


class _Decoder(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.ops.cptest_names.staged(layer(x))
        return x


@torch.no_grad()
def test_a_target_and_a_draft_are_two_owners_with_one_id_in_dump_show_logs_and_errors(tmp_path, capsys, caplog):
    op = torch.library.custom_op("cptest_names::staged", mutates_args=())(_staged_impl)
    op.register_fake(lambda x: torch.empty_like(x))
    torch._dynamo.reset()
    target, draft = _Decoder(3), _Decoder(1)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        c_target, c_draft = _compile(target, tmp_path / "target"), _compile(draft, tmp_path / "draft")
        for _ in range(2):
            torch.testing.assert_close(c_draft(x), draft(x))
            torch.testing.assert_close(c_target(x), target(x))
        executors = {name: next(g.executor for g in last_compiled() if g.dump_dir and
                                g.dump_dir.startswith(str(tmp_path / name))) for name in ("target", "draft")}
        errors = {}
        _WRONG_DEVICE[0] = True
        try:
            for name, compiled in (("target", c_target), ("draft", c_draft)):
                with pytest.raises(ResourceError) as err:
                    compiled(x)
                errors[name] = str(err.value)
        finally:
            _WRONG_DEVICE[0] = False
        assert capturepass.release(draft) == 1 and capturepass.release(target) == 1
    logs = [r.getMessage() for r in caplog.records if r.name == "capturepass"]
    owners = {}
    for name, ex in executors.items():
        folder = tmp_path / name
        # The dump: graph.json, every node, the text dumps.
        doc = _graph_json(folder)
        g = owners[name] = doc["owner"]
        assert re.fullmatch(r"g\d+", g) and g == ex.graph_owner
        assert {n["owner"] for n in doc["nodes"] if "owner" in n} == {g}
        (graph_dir,) = [d for d in os.listdir(folder) if os.path.isdir(folder / d)]
        assert f"\nowner {g}:\n" in (folder / graph_dir / "010_emit.txt").read_text()
        # The runtime: its owners, owners.json, capturepass show (text, --json, --html).
        assert [o.name for o in ex.owners] == [] and ex.closed is False  # released above
        record, why_not = naming.load_owners(str(folder / graph_dir), g)
        assert why_not is None and [o["name"] for o in record["owners"]] == [f"{g}.m0.eager"]
        out = _show(capsys, folder)
        assert f"(inference, owner {g}, cudagraphs=none)" in out
        assert f"    model {g}.m0: {g}.m0.eager (uncaptured runs, the first of f32[4,8])" in out
        (summary,) = json.loads(_show(capsys, folder, "--json"))["graphs"]
        assert summary["owner"] == g and [o["name"] for o in summary["runtime_owners"]] == [f"{g}.m0.eager"]
        _show(capsys, folder, "--html", str(tmp_path / f"{name}.html"))
        assert f"<code>{g}.m0.eager</code> — model {g}.m0" in (tmp_path / f"{name}.html").read_text()
        # The logs: the compile, the pass decisions, the release; the error of a run.
        assert any(m.startswith(f"capturepass: compiled inference graph {g}: ") for m in logs), logs
        assert any(m.startswith(f"capturepass: inference graph {g}: assign_streams: lanes ") for m in logs), logs
        assert (f"capturepass: inference graph {g}: released 1 owner(s) of model {g}.m0 ({g}.m0.eager): "
                "capturepass.release") in logs
        assert f"owner {g}.m0.eager keeps its workspaces on cpu" in errors[name]
    assert owners["target"] != owners["draft"]
    # No message about one model names the other's owner.
    for name, other in (("target", "draft"), ("draft", "target")):
        mine = [m for m in logs if f" graph {owners[name]}:" in m] + [errors[name]]
        assert mine and not any(re.search(rf"\b{owners[other]}\b", m) for m in mine)
    torch._dynamo.reset()


@torch.no_grad()
def test_two_instances_of_one_class_are_two_owners_named_after_the_graph(tmp_path, capsys):
    torch._dynamo.reset()
    a, b = _Lin(1.0), _Lin(3.0)
    ca, cb = _compile(a, tmp_path), _compile(b, tmp_path)
    x = torch.randn(4, 8)
    for _ in range(2):
        torch.testing.assert_close(ca(x), a(x))
        torch.testing.assert_close(cb(x), b(x))
    compiled = [g for g in last_compiled() if g.dump_dir and g.dump_dir.startswith(str(tmp_path))]
    (graph,) = compiled  # one graph serves the class: one dump, one graph owner
    ex = graph.executor
    owner = _graph_json(tmp_path)["owner"]
    assert owner == ex.graph_owner == str(meta.graph_info(graph.graph).owner)
    # a ran first: model 0; b is model 1. Each has its own owner, named after the graph's.
    assert [o.name for o in ex.owners] == [f"{owner}.m0.eager", f"{owner}.m1.eager"]
    assert all(o.name.startswith(owner + ".") for o in ex.owners)
    out = _show(capsys, tmp_path)
    assert "  owners at run time: 2 model(s), 2 owner(s)" in out
    assert f"    model {owner}.m0: {owner}.m0.eager (uncaptured runs, the first of f32[4,8])" in out
    assert f"    model {owner}.m1: {owner}.m1.eager (uncaptured runs, the first of f32[4,8])" in out
    (g,) = json.loads(_show(capsys, tmp_path, "--json"))["graphs"]
    assert g["owner"] == owner and g["runtime_owners_recorded"] and g["runtime_owners_not_shown"] is None
    assert [(o["name"], o["model"], o["role"], o["device"]) for o in g["runtime_owners"]] == [
        (f"{owner}.m0.eager", f"{owner}.m0", "eager", "cpu"), (f"{owner}.m1.eager", f"{owner}.m1", "eager", "cpu")]
    page = tmp_path / "page.html"
    _show(capsys, tmp_path, "--html", str(page))
    html = page.read_text()
    assert f"<code>{owner}.m0.eager</code> — model {owner}.m0" in html and f"<code>{owner}.m1.eager</code>" in html
    trace = tmp_path / "trace.json"
    _show(capsys, tmp_path, "--trace", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    (process,) = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    (labels,) = [e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"]
    assert process.endswith(f" · {owner}")
    assert labels == f"owners at run time: {owner}.m0.eager, {owner}.m1.eager"
    torch._dynamo.reset()


@torch.no_grad()
def test_a_model_keeps_its_number_until_it_dies():
    torch._dynamo.reset()
    a, b = _Lin(1.0), _Lin(3.0)
    ca, cb = _compile(a), _compile(b)
    x = torch.randn(4, 8)
    ca(x), cb(x)
    ex = last_compiled()[-1].executor
    g = ex.graph_owner
    assert capturepass.release(a) == 1  # released while it lives: the same model when it runs again
    ca(x)
    assert sorted(o.name for o in ex.owners) == [f"{g}.m0.eager", f"{g}.m1.eager"]
    del a, ca
    gc.collect()
    assert [o.name for o in ex.owners] == [f"{g}.m1.eager"]
    c = _Lin(5.0)  # a new model, wherever its parameters landed: a new number
    torch.testing.assert_close(_compile(c)(x), c(x))
    assert [o.name for o in ex.owners] == [f"{g}.m1.eager", f"{g}.m2.eager"]
    torch._dynamo.reset()


def _scratch_impl(x: torch.Tensor) -> torch.Tensor:
    # A workspace asked for on another device than the running owner keeps its workspaces on.
    capturepass.workspace("scratch", (4,), torch.float32, device="meta")
    return x + 1


@torch.no_grad()
def test_runtime_errors_name_the_owner_capturepass_show_lists(tmp_path, capsys):
    try:
        op = torch.library.custom_op("cptest_names::scratch", mutates_args=())(_scratch_impl)
        op.register_fake(lambda x: torch.empty_like(x))

        class _Scratch(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.ops.cptest_names.scratch(self.l(x))

        torch._dynamo.reset()
        model = _Scratch()
        compiled = _compile(model, tmp_path)
        x = torch.randn(4, 8)
        with pytest.raises(ResourceError) as err:
            compiled(x)
        ex = last_compiled()[-1].executor
        name = f"{ex.graph_owner}.m0.eager"
        assert f"workspace 'scratch' on meta, but owner {name} keeps its workspaces on cpu" in str(err.value)
        out = _show(capsys, tmp_path)
        assert f"owner {ex.graph_owner}, " in out and f"    model {ex.graph_owner}.m0: {name} (" in out
        # A closed callable names its graph owner, whose owners it released.
        ex.close()
        with pytest.raises(CapturePassError, match=rf"this compiled inference graph {ex.graph_owner} was closed "
                                                   rf"\(its owners {ex.graph_owner}\.m\* are released\)"):
            compiled(x)
    finally:
        torch._dynamo.reset()


def test_owners_json_of_another_compile_is_not_shown(tmp_path, capsys):
    torch._dynamo.reset()
    with torch.no_grad():
        _compile(_Lin(1.0), tmp_path)(torch.randn(4, 8))
    owner = _graph_json(tmp_path)["owner"]
    (graph_dir,) = os.listdir(tmp_path)
    path = tmp_path / graph_dir / naming.OWNERS_FILE
    doc = json.loads(path.read_text())
    assert doc["format"] == naming.OWNERS_FORMAT and doc["owner"] == owner and doc["pid"] == os.getpid()
    doc["owner"] = "g999999"
    path.write_text(json.dumps(doc))
    out = _show(capsys, tmp_path)
    assert (f"  owners at run time: not shown (owners.json belongs to owner g999999, another compile than "
            f"graph.json's {owner})") in out
    path.write_text("[]")
    assert "  owners at run time: not shown (owners.json is not a capturepass-owners/1 document)" in _show(capsys, tmp_path)
    path.unlink()
    assert "owners at run time" not in _show(capsys, tmp_path)
    torch._dynamo.reset()


def test_owner_names_are_unique_among_open_owners():
    first = GraphOwner("g77.m0.c0", 1, None, captured=False)
    with pytest.raises(CapturePassError, match=r"an open owner is named 'g77.m0.c0' already"):
        GraphOwner("g77.m0.c0", 1, None, captured=False)
    first.close()
    again = GraphOwner("g77.m0.c0", 1, None, captured=False)  # a closed owner's name is free
    again.close()


def test_names_of_each_kind():
    # Graph owners no compile in this process reaches: their model numbers start at 0.
    model = naming.next_model("g900041")
    assert model == "g900041.m0" and naming.next_model("g900041") == "g900041.m1"
    assert naming.next_model("g900042") == "g900042.m0"
    assert naming.capture_owner(model, 2) == "g900041.m0.c2"
    assert naming.eager_owner(model) == "g900041.m0.eager" and naming.profile_owner(model) == "g900041.m0.profile"
    assert naming.describe_inputs([torch.zeros(3, 2, dtype=torch.bfloat16), torch.zeros(4), 5], [1]) == "bf16[3,2], 5"
    assert naming.describe_inputs([torch.zeros(3, 2), torch.zeros(4), torch.zeros(2)], [1], in_place={2}) == \
        "f32[3,2], f32[2] in place"


@torch.no_grad()
def test_capture_owners_are_numbered_per_model_and_shape():
    torch._dynamo.reset()
    a, b = _Lin(1.0), _Lin(3.0)
    ca, cb = _compile(a), _compile(b)
    x = torch.randn(4, 8)
    ca(x), cb(x)
    ex = last_compiled()[-1].executor
    g = ex.graph_owner
    inst_a, inst_b = ex._eager_owners  # the two instances' static-input addresses, a's first
    # (On the host nothing is captured: the names the capture owners would get.)
    names = [ex._capture_owner_name((inst, shape))[1]
             for inst, shape in ((inst_a, "4x8"), (inst_b, "4x8"), (inst_a, "6x8"), (inst_a, "4x8"))]
    assert names == [f"{g}.m0.c0", f"{g}.m1.c0", f"{g}.m0.c1", f"{g}.m0.c0"]
    torch._dynamo.reset()


@pytest.mark.gpu
@torch.no_grad()
def test_capture_owners_on_cuda_are_named_per_model_and_shape(tmp_path, capsys):
    torch._dynamo.reset()
    a, b = _Lin(1.0, "cuda"), _Lin(3.0, "cuda")
    ca, cb = _compile(a, tmp_path, cudagraphs="monolithic"), _compile(b, tmp_path, cudagraphs="monolithic")
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(6, 8, device="cuda")
    torch._dynamo.mark_dynamic(x, 0)  # one graph for both batch sizes
    for _ in range(2):
        torch.testing.assert_close(ca(x), a(x))
        torch.testing.assert_close(cb(x), b(x))
    torch.testing.assert_close(ca(y), a(y))
    torch.testing.assert_close(ca(y), a(y))
    (graph,) = [g for g in last_compiled() if g.dump_dir and g.dump_dir.startswith(str(tmp_path))]
    g = graph.executor.graph_owner
    assert g == _graph_json(tmp_path)["owner"]
    assert sorted(o.name for o in graph.executor.owners) == [f"{g}.m0.c0", f"{g}.m0.c1", f"{g}.m1.c0"]
    out = _show(capsys, tmp_path)
    assert "  owners at run time: 2 model(s), 3 owner(s)" in out
    # (A dynamic graph takes the batch size as an input of its own, before the tensors.)
    # x and y, passed again at their addresses, are captured again at their second call, in place.
    assert re.search(rf"^    model {g}\.m0: {g}\.m0\.c0 \(capture of (4, )?f32\[4,8\] in place\), "
                     rf"{g}\.m0\.c1 \(capture of (6, )?f32\[6,8\] in place\)$", out, re.M), out
    assert re.search(rf"^    model {g}\.m1: {g}\.m1\.c0 \(capture of (4, )?f32\[4,8\] in place\)$", out, re.M), out
    torch._dynamo.reset()


@pytest.mark.parametrize("lane_map, why", [((1, 0, 0), "lane 0"), ((0, 1), "3 lane(s)"), ((0, -1, 3), "3 lane(s)")])
def test_a_lane_map_that_moves_lane_0_or_misses_a_lane_is_refused_naming_the_owner(lane_map, why):
    """Lane 0 is the caller's stream by definition (the capture stream under capture); a map
    must say where each of the graph's lanes runs."""
    with pytest.raises(CapturePassError, match=rf"owner g9\.m0\.c0\.serial: lane map .* {re.escape(why)}"):
        GraphOwner("g9.m0.c0.serial", 3, None, captured=True, lane_map=lane_map)


def test_a_lane_map_on_the_host_keeps_the_map_and_no_streams():
    owner = GraphOwner("g9.m0.c0.aux1", 3, None, captured=True, lane_map=(0, 1, 0))
    try:
        assert owner.lane_map == (0, 1, 0) and owner.streams == [] and owner.side_streams == []
    finally:
        owner.close()
    plain = GraphOwner("g9.m0.c0", 3, None, captured=True)
    try:
        assert plain.lane_map == (0, 1, 2)
    finally:
        plain.close()


def test_an_owner_made_again_under_its_name_replaces_its_entry(tmp_path):
    """A shape captured again (an input that moved, or that stayed put and is now read in place)
    is the same owner name: owners.json lists each owner once, with its latest inputs."""
    record = naming.OwnersRecord(str(tmp_path), "g9", "inference")
    record.add("g9.m0.c0", "g9.m0", "capture", "f32[4,8]", "cuda:0")
    record.add("g9.m0.c1", "g9.m0", "capture", "f32[6,8]", "cuda:0")
    record.add("g9.m0.c0", "g9.m0", "capture", "f32[4,8] in place", "cuda:0")
    owners = json.loads((tmp_path / naming.OWNERS_FILE).read_text())["owners"]
    assert [(o["name"], o["inputs"]) for o in owners] == [("g9.m0.c0", "f32[4,8] in place"), ("g9.m0.c1", "f32[6,8]")]
