"""Lane hints through torch.compile: context manager, decorator, policies, nesting, Dynamo streams."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from backends.e2e_util import (
    assert_cross_lane_reads_ordered,
    assert_main_joins,
    compile_eager,
    compute_nodes,
    lane_name,
    new_compiles,
    unwrap,
)

import capturepass
from capturepass.backends import inner as inner_compilers
from capturepass.ir.meta import HINT_KEY
from capturepass.ir import meta

AUX_OPS = (torch.ops.aten.relu.default, torch.ops.aten.sigmoid.default)
MAIN_OPS = (torch.ops.aten.tanh.default,)


class _WithBlock(nn.Module):
    """relu and sigmoid on the hinted lane, tanh beside them, unhinted."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.sigmoid(torch.relu(self.a(x)))
        return h + torch.tanh(self.b(x))


class _Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    @capturepass.lane("aux")
    def side(self, x):
        return torch.sigmoid(torch.relu(self.a(x)))

    def forward(self, x):
        return self.side(x) + torch.tanh(self.b(x))


def _run(model: nn.Module, **options):
    torch.manual_seed(0)
    x = torch.randn(4, model.a.in_features)
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compile_eager(model, **options)(x), model(x))
    assert [g.name for g in graphs] == ["inference"]
    return graphs[0]


def _nodes_with(gm, targets):
    nodes = [n for n in compute_nodes(gm) if n.target in targets]
    assert nodes, f"no node calls {targets}"
    return nodes


@pytest.fixture
def inner_graphs(monkeypatch):
    """Every region graph the inner compiler receives."""
    seen = []
    original = inner_compilers._COMPILERS["eager"]

    def spy(gm, example_inputs):
        seen.append(gm)
        return original(gm, example_inputs)

    monkeypatch.setitem(inner_compilers._COMPILERS, "eager", spy)
    return seen


def _assert_untagged(graphs) -> None:
    for gm in graphs:
        for node in gm.graph.nodes:
            custom = node.meta.get("custom") or {}
            assert "stream" not in custom, f"%{node.name} still carries a Dynamo stream tag"
            assert HINT_KEY not in custom, f"%{node.name} still carries a lane hint"
            assert meta.META_KEY not in node.meta, f"%{node.name} still carries capturepass metadata"


@pytest.mark.parametrize("model_cls", [_WithBlock, _Decorated], ids=["with", "decorator"])
def test_hint_puts_the_code_on_the_named_lane(model_cls, inner_graphs):
    record = _run(model_cls())
    gm = record.graph
    gi = meta.graph_info(gm)
    assert gi.lanes[0] == "main" and "aux" in gi.lanes
    for node in _nodes_with(gm, AUX_OPS):
        assert meta.info(node).hint == "aux"
        assert lane_name(gm, node) == "aux"
        assert meta.lane_of(node).index == gi.lanes.index("aux")
    for node in _nodes_with(gm, MAIN_OPS):
        assert meta.info(node).hint is None
        assert lane_name(gm, node) != "aux"
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)
    # What the inner compiler sees carries no hint and no capturepass data.
    regions = [r.graph for r in record.program.regions]
    assert regions and all(any(g is r for g in inner_graphs) for r in regions)
    _assert_untagged(inner_graphs)


class _ThreeBranches(nn.Module):
    """One hinted branch and two unhinted independent ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.sigmoid(torch.relu(self.a(x)))
        return h + torch.tanh(self.b(x)) + torch.exp(self.c(x))


def test_policy_auto_adds_lanes_beside_the_hinted_one():
    gm = _run(_ThreeBranches(), policy="auto", max_aux_lanes=3).graph
    lanes = meta.graph_info(gm).lanes
    assert lanes[:2] == ("main", "aux")
    assert len(lanes) >= 3, "auto policy found no lane for the unhinted branches"


def test_policy_hints_uses_only_the_hinted_lanes():
    gm = _run(_ThreeBranches(), policy="hints", max_aux_lanes=3).graph
    assert meta.graph_info(gm).lanes == ("main", "aux")
    for node in compute_nodes(gm):
        expected = "aux" if meta.info(node).hint == "aux" else "main"
        assert lane_name(gm, node) == expected, f"%{node.name} on {lane_name(gm, node)}"
    assert {lane_name(gm, n) for n in _nodes_with(gm, AUX_OPS)} == {"aux"}
    assert_cross_lane_reads_ordered(gm)


def test_policy_off_keeps_one_lane_and_says_it_dropped_the_hints():
    gm = _run(_ThreeBranches(), policy="off").graph
    gi = meta.graph_info(gm)
    assert gi.lanes == ("main",)
    assert all(meta.lane_of(n).index == 0 for n in gm.graph.nodes)
    assert all(meta.info(n).hint is None for n in gm.graph.nodes)
    assert not [n for n in gm.graph.nodes if meta.info(n).effect.value in ("record", "wait")]
    (decision,) = [d for d in gi.decisions if d.startswith("policy=off")]
    dropped = int(re.search(r"hints of (\d+) node", decision).group(1))
    # As many nodes as carry the hint when hints are honoured.
    torch._dynamo.reset()
    honoured = _run(_ThreeBranches(), policy="hints").graph
    assert dropped == len([n for n in honoured.graph.nodes if meta.info(n).hint == "aux"]) >= 2


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with capturepass.lane("outer"):
            o = torch.relu(self.a(x))
            with capturepass.lane("inner"):
                i = torch.sigmoid(self.b(x))
            o = torch.exp(o)  # back on the outer lane
        return o + torch.tanh(i)


def test_nested_hints_innermost_wins():
    gm = _run(_Nested(), policy="hints").graph
    assert meta.graph_info(gm).lanes == ("main", "outer", "inner")
    expected = {
        torch.ops.aten.relu.default: "outer",
        torch.ops.aten.exp.default: "outer",
        torch.ops.aten.sigmoid.default: "inner",
        torch.ops.aten.tanh.default: "main",
    }
    for target, lane in expected.items():
        for node in _nodes_with(gm, (target,)):
            assert lane_name(gm, node) == lane, f"%{node.name}"
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)


def test_hint_naming_main_is_refused():
    with pytest.raises(capturepass.HintError, match="'main'"):
        capturepass.lane("main")
    with pytest.raises(capturepass.HintError):
        capturepass.lane("")


def test_hint_naming_main_is_refused_at_compile_time():
    # A tag that bypassed capturepass.lane() (written with fx.traceback.annotate) is caught by read_hints.
    def fn(x):
        with fx_traceback.annotate({HINT_KEY: {"lane": "main"}}):
            y = x.sin()
        return y + x.cos()

    with pytest.raises(Exception) as info:
        compile_eager(fn)(torch.randn(4))
    err = unwrap(info.value)
    assert isinstance(err, capturepass.HintError), repr(info.value)
    assert "'main'" in str(err) and "%sin" in str(err)


class _DynamoStream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        s = torch.Stream(device="cpu")
        with s:
            h = torch.sigmoid(torch.relu(self.a(x)))
        return h + torch.tanh(self.b(x))


@pytest.mark.parametrize("policy", ["auto", "hints"])
def test_dynamo_stream_region_becomes_a_lane(policy, inner_graphs):
    record = _run(_DynamoStream(), policy=policy)
    gm = record.graph
    gi = meta.graph_info(gm)
    stream_lanes = [name for name in gi.lanes if re.fullmatch(r"stream\d+", name)]
    assert len(stream_lanes) == 1, gi.lanes
    for node in _nodes_with(gm, AUX_OPS):
        assert lane_name(gm, node) == stream_lanes[0]
    for node in _nodes_with(gm, MAIN_OPS):
        assert lane_name(gm, node) != stream_lanes[0]
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)
    # Neither the stream tag nor a capturepass tag survives: not in the annotated graph,
    # not in the region graphs, not in what the inner compiler received.
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        assert "stream" not in custom and HINT_KEY not in custom, f"%{node.name}: {custom}"
    regions = [r.graph for r in record.program.regions]
    _assert_untagged(regions)
    assert regions and all(any(g is r for g in inner_graphs) for r in regions)
    _assert_untagged(inner_graphs)


# -- one hint object, entered again and inside itself --------------------------------------------


def _dump_lanes(dump_dir) -> dict[str, str]:
    """``{node name: lane name}`` of every compute node, read back from the dump's graph.json."""
    import os

    from capturepass.ir import graph_json

    (graph_dir,) = os.listdir(dump_dir)
    doc = graph_json.load(os.path.join(dump_dir, graph_dir, "graph.json"))
    return {n["name"]: doc["lanes"][n["lane"]] for n in doc["nodes"] if n["effect"] == "compute"}


class _Reused(nn.Module):
    """One hint object entered twice in a row, and once inside itself, then left back to main."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        aux = capturepass.lane("aux")
        with aux:
            h = torch.relu(self.a(x))
        t = torch.tanh(self.b(x))
        with aux:
            s = torch.sigmoid(h)
            with aux:  # re-entered while open
                e = torch.exp(s)
            c = torch.cos(e)  # still inside the first entry
        return torch.sin(c) + t


def test_one_hint_object_entered_twice_and_inside_itself(tmp_path):
    """Regression: a second ``with`` of one hint object raised AttributeError."""
    gm = _run(_Reused(), policy="hints", dump_dir=str(tmp_path)).graph
    lanes = _dump_lanes(tmp_path)
    expected = {"relu": "aux", "sigmoid": "aux", "exp": "aux", "cos": "aux", "tanh": "main", "sin": "main"}
    assert {k: lanes[k] for k in expected} == expected
    assert meta.graph_info(gm).lanes == ("main", "aux")
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)


AUX_HINT = capturepass.lane("aux")


@AUX_HINT
def _hinted_inner(x):
    return torch.sigmoid(x)


@AUX_HINT
def _hinted_outer(x):
    return torch.relu(_hinted_inner(x))  # the same hint object, entered inside itself


class _DecoratedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return _hinted_outer(self.a(x)) + torch.tanh(self.b(x)) + _hinted_inner(x)


def test_one_hint_object_decorating_two_functions_that_nest(tmp_path):
    _run(_DecoratedTwice(), policy="hints", dump_dir=str(tmp_path))
    lanes = _dump_lanes(tmp_path)
    hinted = {n: lane for n, lane in lanes.items() if n.startswith(("sigmoid", "relu"))}
    assert sorted(hinted) == ["relu", "sigmoid", "sigmoid_1"] and set(hinted.values()) == {"aux"}
    assert lanes["tanh"] == "main"


def _dynamo_enters_a_hint_made_outside() -> bool:
    """Whether this torch's Dynamo traces ``with hint:`` for a hint object made outside the
    compiled function (torch 2.14 does; earlier releases give up on the frame and run it eagerly).
    Probed with a backend of its own, so that capturepass plays no part in the answer."""
    probe = capturepass.lane("probe")
    frames = []

    def count(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def fn(x):
        with probe:
            return x + 1

    torch.compile(fn, backend=count)(torch.ones(2))
    return bool(frames)


def test_a_hint_object_made_outside_is_reusable_and_says_when_dynamo_skips_it(caplog):
    """A hint object made outside the compiled code: where Dynamo traces it, its code goes on its
    lane; where Dynamo cannot enter a context manager it did not see made, it runs the frame
    eagerly (no compile), and the hint says so instead of leaving the lanes silently missing."""
    hint = capturepass.lane("outside")

    def fn(x):
        with hint:
            y = torch.relu(x)
        with hint:
            with hint:
                z = torch.sigmoid(y)
        return z + torch.tanh(x)

    x = torch.randn(4, 8)
    expected = fn(x)  # eagerly, twice in a row and nested: no AttributeError
    torch.testing.assert_close(fn(x), expected)
    assert hint._open == []
    traced = _dynamo_enters_a_hint_made_outside()
    caplog.clear()  # the probe's own hint warns where Dynamo runs it eagerly
    with caplog.at_level("WARNING", logger="capturepass"), new_compiles() as graphs:
        torch.testing.assert_close(compile_eager(fn)(x), expected)
    warnings = [r.getMessage() for r in caplog.records if "runs eagerly inside a compiled function" in r.getMessage()]
    if traced:
        assert [g.name for g in graphs] == ["inference"] and warnings == []
        gm = graphs[0].graph
        for node in _nodes_with(gm, AUX_OPS):
            assert meta.info(node).hint == "outside" and lane_name(gm, node) == "outside"
        for node in _nodes_with(gm, MAIN_OPS):
            assert lane_name(gm, node) == "main"
    else:
        assert graphs == []
        assert warnings == [
            "capturepass: the hint capturepass.lane('outside') runs eagerly inside a compiled function: Dynamo "
            "cannot enter a context manager made outside the compiled code, so it ran that frame without compiling "
            "it (no lanes). Write `with capturepass.lane('outside'):` inside the function, or use the hint as a "
            "decorator."
        ]
    assert hint._open == []
