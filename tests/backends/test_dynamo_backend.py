"""End to end through torch.compile: results equal eager, and the dump shows the lanes and waits.

Most tests use the eager inner compiler (fast); one MoE test and one training
test compile their regions with Inductor (marked ``slow``, still run in CI).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from backends.e2e_util import (
    HappensBefore,
    assert_cross_lane_reads_ordered,
    assert_main_joins,
    assert_waits_well_formed,
    compile_eager,
    compute_nodes,
    from_function,
    kernels,
    lane_name,
    lanes_used,
    new_compiles,
    sync_nodes,
)

import capturepass
import capturepass.show.cli
from capturepass.show.summary import summarize
from capturepass.ir import meta
from capturepass.ir import verify as ir_verify
from capturepass.ir.meta import Effect
from capturepass.testing.models import AttnIndexer, MoEBlock


def _check_overlapped(gm: torch.fx.GraphModule, branch_a: str, branch_b: str) -> None:
    """The kernels of two independent functions do not all share one lane, and every crossing is ordered."""
    nodes = compute_nodes(gm)
    a = kernels(n for n in nodes if from_function(n, branch_a))
    b = kernels(n for n in nodes if from_function(n, branch_b))
    assert a and b, f"no kernels traced from {branch_a} ({len(a)}) or {branch_b} ({len(b)})"
    lanes_a, lanes_b = lanes_used(gm, a), lanes_used(gm, b)
    assert len(lanes_a | lanes_b) >= 2, f"{branch_a} and {branch_b} both run only on {lanes_a | lanes_b}"
    # Some kernel of one branch may run while one of the other does: neither is ordered before the other.
    hb = HappensBefore(gm)
    concurrent = [(x, y) for x in a for y in b if not hb(x, y) and not hb(y, x)]
    assert concurrent, f"every kernel of {branch_a} is ordered with every kernel of {branch_b}"
    edges = assert_cross_lane_reads_ordered(gm)
    assert edges, "branches on different lanes, but no tensor crosses lanes"
    assert_waits_well_formed(gm)
    assert_main_joins(gm)


def _check_dump(dump_dir: os.PathLike, gm: torch.fx.GraphModule) -> dict:
    """The dump of one graph agrees with the graph: lanes, waits, a join wait on the main lane."""
    summary = summarize(os.fspath(dump_dir))
    assert len(summary["graphs"]) == 1
    g = summary["graphs"][0]
    gi = meta.graph_info(gm)
    assert g["lane_names"] == list(gi.lanes)
    assert g["lanes"] >= 2
    assert g["waits"] == len(sync_nodes(gm, Effect.WAIT)) > 0
    assert g["records"] == len(sync_nodes(gm, Effect.RECORD)) > 0
    main_joins = [w for w in g["wait_reasons"] if w["lane"] == 0 and w["role"] == "join"]
    assert main_joins, f"no join wait on the main lane: {g['wait_reasons']}"
    assert all(w["why"] for w in g["wait_reasons"]), "every wait says why it exists"
    return g


# -- reference models ---------------------------------------------------------------------------


def test_moe_block_matches_eager_with_branches_on_separate_lanes(tmp_path):
    torch.manual_seed(0)
    model = MoEBlock()
    compiled = compile_eager(model, dump_dir=str(tmp_path))
    x = torch.randn(16, 64)
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compiled(x), model(x))
        x2 = torch.randn(16, 64)
        torch.testing.assert_close(compiled(x2), model(x2))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    _check_overlapped(gm, "shared_expert", "routed_experts")
    _check_dump(tmp_path, gm)


def test_attn_indexer_matches_eager_with_branches_on_separate_lanes(tmp_path):
    torch.manual_seed(0)
    model = AttnIndexer()
    q, x = model.example_inputs()
    compiled = compile_eager(model, dump_dir=str(tmp_path))
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compiled(q, x), model(q, x))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    _check_overlapped(gm, "attention", "indexer")
    # The attention kernel itself may run beside an indexer kernel.
    (attn,) = kernels(n for n in compute_nodes(gm) if from_function(n, "attention"))
    idx = kernels(n for n in compute_nodes(gm) if from_function(n, "indexer"))
    hb = HappensBefore(gm)
    assert any(not hb(attn, n) and not hb(n, attn) for n in idx), f"%{attn.name} is ordered with the whole indexer"
    _check_dump(tmp_path, gm)


# -- Dynamo graph breaks ------------------------------------------------------------------------


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x)) + torch.sigmoid(self.b(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.a(y)) * self.b(y)


def test_graph_break_gives_two_correct_graphs_and_the_dump_names_the_break(tmp_path, capsys):
    torch.manual_seed(0)
    model = _Broken()
    compiled = compile_eager(model, dump_dir=str(tmp_path))
    x = torch.randn(4, 8)
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compiled(x), model(x))
    assert [g.name for g in graphs] == ["inference", "inference"]
    for g in graphs:
        gm = g.graph
        assert len(meta.graph_info(gm).lanes) >= 2
        assert_cross_lane_reads_ordered(gm)
        assert_main_joins(gm)
    # The break belongs to the graph compiled when Dynamo broke the frame: the first one.
    first, second = (meta.graph_info(g.graph).breaks for g in graphs)
    assert [b.source for b in first] == ["dynamo"]
    assert "graph_break()" in first[0].reason
    assert second == ()

    summary = summarize(str(tmp_path))
    assert len(summary["graphs"]) == 2
    assert [b["source"] for b in summary["breaks"]] == ["dynamo"]
    assert capturepass.show.cli.main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "break (dynamo): Call to `torch._dynamo.graph_break()`" in out


def _fn_with_break(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def _fn_without_break(x):
    return x.sin() + x.cos()


def test_dynamo_breaks_are_attributed_to_the_graph_they_cut():
    # A break in a frame compiled by another backend is not this graph's break.
    x = torch.randn(3)
    torch.compile(_fn_with_break, backend="eager")(x)
    with new_compiles() as graphs:
        torch.testing.assert_close(compile_eager(_fn_without_break)(x), _fn_without_break(x))
    assert [meta.graph_info(g.graph).breaks for g in graphs] == [()]

    # Clearing Dynamo's counters (as test suites do) does not hide the next break.
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    with new_compiles() as graphs:
        torch.testing.assert_close(compile_eager(_fn_with_break)(x), _fn_with_break(x))
    breaks = [meta.graph_info(g.graph).breaks for g in graphs]
    assert len(breaks) == 2
    assert [b.source for b in breaks[0]] == ["dynamo"] and breaks[1] == ()


# -- non-capturable ops inside one graph --------------------------------------------------------


class _HostSync(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x))
        n = y.sum().item()  # a host read: not capturable
        return self.b(y) * torch.full_like(x, n) + torch.sigmoid(self.a(x))


@pytest.mark.parametrize("mode", ["breakable", "monolithic"])
def test_host_sync_splits_the_graph_into_two_segments(mode, tmp_path):
    torch.manual_seed(0)
    model = _HostSync()
    x = torch.randn(4, 8)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad(), new_compiles() as graphs:
        compiled = compile_eager(model, cudagraphs=mode, dump_dir=str(tmp_path))
        torch.testing.assert_close(compiled(x), model(x))
        x2 = torch.randn(4, 8)
        torch.testing.assert_close(compiled(x2), model(x2))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    gi = meta.graph_info(gm)
    assert gi.cudagraphs == "breakable"
    assert len(gi.segments) == 2
    assert len(gi.breaks) == 1
    brk = gi.breaks[0]
    assert brk.source == "partition"
    assert brk.node.startswith("_local_scalar_dense")
    assert "host sync" in brk.reason and "_local_scalar_dense" in brk.reason

    # The break runs on the main lane, in no segment, after every lane has joined.
    node = next(n for n in gm.graph.nodes if n.name == brk.node)
    assert meta.lane_of(node).index == 0 and meta.info(node).segment is None
    hb = HappensBefore(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for other in gm.graph.nodes:
        if meta.lane_of(other).index != 0 and order[other] < order[node]:
            assert hb(other, node), f"%{other.name} is not joined before the break"
    assert_cross_lane_reads_ordered(gm)

    switched = [d for d in gi.decisions if "switched to breakable" in d]
    if mode == "monolithic":
        assert len(switched) == 1 and "_local_scalar_dense" in switched[0]
    else:
        assert switched == []
    (graph_dir,) = [d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)]
    with open(tmp_path / graph_dir / "graph.json") as f:
        doc = json.load(f)
    assert doc["cudagraphs"] == "breakable"
    assert len(doc["segments"]) == 2
    assert [b["node"] for b in doc["breaks"]] == [brk.node]
    assert doc["decisions"] == list(gi.decisions)


# -- dynamic shapes -----------------------------------------------------------------------------


def test_dynamic_batch_sizes_match_eager_without_recompiling():
    torch.manual_seed(0)
    model = MoEBlock()
    compiled = compile_eager(model, dynamic=True)
    with torch.no_grad(), new_compiles() as graphs:
        for batch in (3, 5, 9, 16):
            x = torch.randn(batch, 64)
            torch.testing.assert_close(compiled(x), model(x))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    symbolic = [
        n for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        and any(isinstance(d, torch.SymInt) for d in n.meta["val"].shape)
    ]
    assert symbolic, "the batch dimension is not symbolic"
    assert len(lanes_used(gm)) >= 2
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)


# -- training -----------------------------------------------------------------------------------


class _HintedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.relu(self.a(x))
        g = torch.tanh(self.b(x))
        return self.out(h * g)


def _train_and_compare(inner: str, dump_dir: str, steps: int = 2) -> list:
    torch.manual_seed(0)
    ref = _HintedMLP()
    mod = copy.deepcopy(ref)
    compiled = torch.compile(mod, backend="capturepass", options={"inner": inner, "dump_dir": dump_dir})
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mod = torch.optim.SGD(mod.parameters(), lr=0.1)
    x, target = torch.randn(5, 8), torch.randn(5, 4)
    with new_compiles() as graphs:
        for _ in range(steps):
            loss_ref = F.mse_loss(ref(x), target)
            loss_ref.backward()
            loss = F.mse_loss(compiled(x), target)
            loss.backward()
            torch.testing.assert_close(loss, loss_ref)
            for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
                assert q.grad is not None, name
                torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
            opt_ref.step()
            opt_mod.step()
            opt_ref.zero_grad()
            opt_mod.zero_grad()
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q, p)
    return graphs


def _check_training_graphs(graphs: list, dump_dir) -> None:
    assert [g.name for g in graphs] == ["forward", "backward"]
    fw, bw = graphs
    fgi = meta.graph_info(fw.graph)
    assert fgi.lanes[:2] == ("main", "aux")  # the policy may add automatic lanes after the hinted one
    hinted = [n for n in compute_nodes(fw.graph) if meta.info(n).hint == "aux"]
    assert hinted and all(lane_name(fw.graph, n) == "aux" for n in hinted)
    assert_cross_lane_reads_ordered(fw.graph)
    assert_main_joins(fw.graph)
    # The backward graph runs on one lane, uncaptured, and verifies.
    bgi = meta.graph_info(bw.graph)
    assert bgi.lanes == ("main",)
    assert bgi.cudagraphs == "none"
    assert {"verified", "emitted"} <= bgi.properties
    ir_verify.verify(bw.graph)
    assert bw.program.regions
    dirs = sorted(os.listdir(dump_dir))
    assert [d.split("_", 1)[1] for d in dirs] == ["backward", "forward"]
    with open(os.path.join(dump_dir, dirs[0], "graph.json")) as f:
        doc = json.load(f)
    assert doc["graph"] == "backward" and doc["lanes"] == ["main"]
    assert os.path.exists(os.path.join(dump_dir, dirs[0], "010_emit.txt"))


def test_training_step_gradients_match_eager(tmp_path):
    graphs = _train_and_compare("eager", str(tmp_path))
    _check_training_graphs(graphs, str(tmp_path))


# -- Inductor (one test each; tiny sizes) -------------------------------------------------------


@pytest.mark.slow
def test_moe_block_with_inductor_regions():
    torch.manual_seed(0)
    model = MoEBlock(d=16, shared=32, experts=4, expert_width=8, topk=2)
    # One auxiliary lane: fewer regions, fewer Inductor compiles.
    compiled = torch.compile(model, backend="capturepass", options={"inner": "inductor", "max_aux_lanes": 1})
    x = torch.randn(4, 16)
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compiled(x), model(x))
        x2 = torch.randn(4, 16)
        torch.testing.assert_close(compiled(x2), model(x2))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    _check_overlapped(gm, "shared_expert", "routed_experts")
    compilers = {r.compiler for r in graphs[0].program.regions}
    assert "inductor" in compilers


@pytest.mark.slow
def test_training_step_with_inductor_regions(tmp_path):
    graphs = _train_and_compare("inductor", str(tmp_path), steps=1)
    _check_training_graphs(graphs, str(tmp_path))
    assert {r.compiler for g in graphs for r in g.program.regions} >= {"inductor"}


def test_float_argument_that_changes_value_restarts_dynamo():
    """Regression: Dynamo's ``TensorifyScalarRestartAnalysis`` (a changed Python float that
    should become a tensor), raised while Inductor compiled a region, was wrapped into an
    ``EmitError`` and the second call failed instead of restarting the analysis."""

    def fn(x, s):
        return (x * s).sin() + s

    compiled = torch.compile(fn, backend="capturepass")
    x = torch.randn(8)
    with new_compiles() as records:
        for s in (2.5, 3.5, 4.5):
            torch.testing.assert_close(compiled(x, s), fn(x, s))
    assert records, "capturepass compiled nothing"


@pytest.mark.parametrize("name", ["RestartAnalysis", "TensorifyScalarRestartAnalysis", "SkipFrame", "Unsupported"])
def test_dynamo_signals_reach_dynamo_unwrapped(monkeypatch, name):
    """A Dynamo control-flow exception raised inside a region's compile is not an EmitError."""
    from torch._dynamo import exc as dynamo_exc

    from capturepass.backends import inner
    from capturepass.errors import is_dynamo_signal

    kind = getattr(dynamo_exc, name, None)
    if kind is None:
        pytest.skip(f"this torch has no torch._dynamo.exc.{name}")
    signal = kind.__new__(kind)  # constructors differ between these classes and torch versions
    Exception.__init__(signal, "from the inner compiler")
    assert is_dynamo_signal(signal)
    assert not is_dynamo_signal(RuntimeError("a real failure"))

    def raising(gm, example_inputs, compiler):
        raise signal

    monkeypatch.setattr(inner, "compile_region", raising)
    from capturepass.backends.dynamo import capturepass_backend

    gm = torch.fx.symbolic_trace(lambda x: (x.sin(),))
    with pytest.raises(kind) as info:
        capturepass_backend(gm, [torch.randn(4)], {"inner": "eager"})
    assert info.value is signal


def test_a_host_graph_is_one_region_per_segment_its_lanes_kept_in_the_ir():
    """On the host every lane runs in program order: each segment compiles once (Inductor fuses
    across what would be lanes on a GPU); the IR keeps the lanes and syncs a GPU would run, and
    regions="lanes" emits them to inspect the outer program a GPU runs."""
    from capturepass.backends.compile import last_compiled
    from capturepass.testing.models import MoEBlock

    torch.manual_seed(0)
    model, x = MoEBlock(), torch.randn(16, 64)
    with torch.no_grad():
        expected = model(x)
        for regions, count in (("auto", 1), ("lanes", None)):
            torch._dynamo.reset()
            out = torch.compile(model, backend="capturepass", options={"regions": regions})(x)
            torch.testing.assert_close(out, expected)
            compiled = last_compiled()[-1]
            lanes = len(meta.graph_info(compiled.graph).lanes)
            assert lanes > 1
            n = len(compiled.program.regions)
            if count is not None:
                assert n == count and compiled.counters["emit"]["merged_lanes"] == 1
            else:
                assert n > lanes and "merged_lanes" not in compiled.counters["emit"]


def test_regions_get_the_size_symbols_their_inputs_do_not_bind():
    """A region that only sees a flattened activation (``s0*s1`` rows) still compiles with
    Inductor: the graph's size inputs are passed in where its own inputs cannot bind them."""

    def f(x, w1, w2, w3):
        t = x.reshape(-1, x.shape[-1])
        a = torch.relu(t @ w1)
        b = torch.sigmoid(t @ w2)
        return ((a * b) @ w3).view(x.shape[0], x.shape[1], -1) + x

    torch.manual_seed(0)
    w1, w2, w3 = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    compiled = torch.compile(f, backend="capturepass", dynamic=True, options={"regions": "lanes"})
    with new_compiles() as graphs:
        for shape in [(2, 3, 8), (4, 5, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x, w1, w2, w3), f(x, w1, w2, w3))
    assert len(graphs) == 1
    assert len(graphs[0].program.regions) > 1
    sym_inputs = {
        n.name for r in graphs[0].program.regions for n in r.inputs if isinstance(n.meta.get("val"), torch.SymInt)
    }
    assert sym_inputs, "no region took a size input"


def test_a_size_input_replaced_by_another_symbol_binds_no_region():
    """Two inputs whose batch sizes Dynamo made dynamic one by one (automatic dynamic) have two
    symbols, one replaced by the other once an op finds them equal: the replaced one's SymInt
    input prints as the other but binds only itself in Inductor, so a region that sees only
    ``3*s`` rows must be given another input that binds ``s`` (DeBERTa-v2 on the H200 failed
    with "For 4*s43, expected [s43] to have been codegen-ed")."""

    def f(ids, mask, w1, w2, w3):
        x = ids * mask.unsqueeze(-1)
        t = x.reshape(-1, x.shape[-1])
        a = torch.relu(t @ w1)
        b = torch.sigmoid(t @ w2)
        return ((a * b) @ w3).view(x.shape[0], x.shape[1], -1) + x

    torch._dynamo.reset()
    torch.manual_seed(0)
    w1, w2, w3 = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    compiled = torch.compile(f, backend="capturepass", options={"regions": "lanes"})
    with new_compiles() as graphs:
        for batch in (2, 3, 5):
            ids, mask = torch.randn(batch, 3, 8), torch.randn(batch, 3)
            torch.testing.assert_close(compiled(ids, mask, w1, w2, w3), f(ids, mask, w1, w2, w3))
    dynamic = graphs[-1]
    replaced = [n for n in dynamic.graph.graph.nodes if n.op == "placeholder"
                and isinstance(v := n.meta.get("val"), torch.SymInt) and v.node._expr != v.node.expr]
    assert replaced, "no size input was replaced by another symbol: the case is not made"
    for region in dynamic.program.regions:
        assert not set(region.inputs) & set(replaced), f"region {region.index} takes a replaced size input"


def test_a_host_segment_returns_only_what_leaves_it():
    """On the host the lanes of a segment are one region: the events and releases between them
    are left out, and the values they name stay inside it (Inductor reuses their buffers)."""
    torch.manual_seed(0)
    model = MoEBlock()
    compiled = torch.compile(model, backend="capturepass", options={"inner": "eager"})
    x = torch.randn(8, 64)
    with torch.no_grad(), new_compiles() as graphs:
        torch.testing.assert_close(compiled(x), model(x))
    (g,) = graphs
    assert len(lanes_used(g.graph)) >= 2 and sync_nodes(g.graph, Effect.WAIT)  # lanes and waits in the IR
    (region,) = g.program.regions
    outputs = [n for n in g.graph.graph.nodes if n.op == "output"][0].all_input_nodes
    assert set(region.outputs) == set(outputs)
