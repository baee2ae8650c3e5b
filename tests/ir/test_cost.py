"""The cost model: exact FLOPs and bytes on static shapes, formulas on dynamic ones, and
graceful degradation when a FLOP formula is missing or fails."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from capturepass.ir import analysis, cost, meta
from capturepass.ir.meta import Cost
from tests.helpers import aten_graph, run_passes

aten = torch.ops.aten
F32 = 4  # bytes per float32 element


def _node(gm: fx.GraphModule, target) -> fx.Node:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
    assert len(nodes) == 1, f"expected one {target} node, found {len(nodes)}"
    return nodes[0]


def _estimate(node: fx.Node) -> Cost:
    return cost.estimate(node, analysis.aliases_input(node) is not None)


def _matmuls(x, w, b, y, z):
    return torch.mm(x, w), torch.addmm(b, x, w), torch.bmm(y, z)


M, K, N, B = 3, 5, 7, 2
MATMUL_INPUTS = (
    torch.randn(M, K),
    torch.randn(K, N),
    torch.randn(N),
    torch.randn(B, M, K),
    torch.randn(B, K, N),
)


# -- static shapes ---------------------------------------------------------------------------------


def test_mm_flops_and_bytes_are_exact():
    gm = aten_graph(_matmuls, *MATMUL_INPUTS)
    c = _estimate(_node(gm, aten.mm.default))
    assert c == Cost(flops=2 * M * N * K, bytes=(M * K + K * N + M * N) * F32, symbolic=None, exact=True)


def test_addmm_flops_and_bytes_count_the_bias_as_input():
    gm = aten_graph(_matmuls, *MATMUL_INPUTS)
    c = _estimate(_node(gm, aten.addmm.default))
    assert c == Cost(flops=2 * M * N * K, bytes=(N + M * K + K * N + M * N) * F32, symbolic=None, exact=True)


def test_bmm_flops_and_bytes_are_exact():
    gm = aten_graph(_matmuls, *MATMUL_INPUTS)
    c = _estimate(_node(gm, aten.bmm.default))
    assert c == Cost(
        flops=2 * B * M * N * K, bytes=(B * M * K + B * K * N + B * M * N) * F32, symbolic=None, exact=True
    )


def test_bytes_follow_the_dtype():
    gm = aten_graph(torch.mm, torch.randn(4, 6, dtype=torch.float16), torch.randn(6, 8, dtype=torch.float16))
    c = _estimate(_node(gm, aten.mm.default))
    assert (c.flops, c.bytes) == (2 * 4 * 6 * 8, (4 * 6 + 6 * 8 + 4 * 8) * 2)


@pytest.mark.parametrize(
    "fn, target",
    [
        (lambda x: x.t() + 1, aten.t.default),
        (lambda x: x.view(-1) + 1, aten.view.default),
        (lambda x: x[1:] + 1, aten.slice.Tensor),
        (lambda x: x.unsqueeze(0) + 1, aten.unsqueeze.default),
    ],
    ids=["t", "view", "slice", "unsqueeze"],
)
def test_a_view_costs_nothing(fn, target):
    gm = aten_graph(fn, torch.randn(4, 6))
    node = _node(gm, target)
    assert analysis.aliases_input(node) is not None
    assert _estimate(node) == Cost(flops=0.0, bytes=0.0, symbolic=None, exact=True)
    # The same node, were it a kernel, would move bytes: the view flag is what zeroes it.
    assert cost.estimate(node, alias=False).bytes > 0


def test_tuple_selection_costs_nothing_and_the_producer_counts_every_output():
    gm = aten_graph(lambda x: torch.max(x, dim=0), torch.randn(4, 6))
    producer = _node(gm, aten.max.dim)
    # reads f32[4,6]; writes f32[6] values and i64[6] indices
    assert _estimate(producer) == Cost(flops=0.0, bytes=4 * 6 * F32 + 6 * F32 + 6 * 8, exact=True)
    getitems = [n for n in gm.graph.nodes if analysis.is_getitem(n)]
    assert len(getitems) == 2
    for n in getitems:
        assert _estimate(n) == Cost()


def test_op_without_a_flop_formula_counts_bytes_only():
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 6))
    node = _node(gm, aten.sin.default)
    assert aten.sin not in flop_registry
    assert _estimate(node) == Cost(flops=0.0, bytes=2 * 4 * 6 * F32, symbolic=None, exact=True)


def test_a_failing_formula_is_inexact_instead_of_raising(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("formula bug")

    monkeypatch.setitem(flop_registry, aten.sin, broken)
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 6))
    c = _estimate(_node(gm, aten.sin.default))
    assert c == Cost(flops=0.0, bytes=2 * 4 * 6 * F32, symbolic=None, exact=False)


def test_a_failing_formula_does_not_fail_the_pipeline(monkeypatch):
    monkeypatch.setitem(flop_registry, aten.mm, lambda *a, **k: 1 // 0)
    gm = aten_graph(lambda x, w: torch.mm(x, w).relu(), torch.randn(4, 4), torch.randn(4, 4))
    run_passes(gm, upto="annotate_capabilities", inner="eager")
    c = meta.info(_node(gm, aten.mm.default)).cost
    assert (c.flops, c.bytes, c.exact) == (0.0, 3 * 16 * F32, False)


def test_annotate_capabilities_records_costs():
    gm = aten_graph(lambda x, w: torch.mm(x, w.t()), torch.randn(3, 5), torch.randn(7, 5))
    run_passes(gm, upto="annotate_capabilities", inner="eager")
    assert meta.info(_node(gm, aten.t.default)).cost == Cost()
    assert meta.info(_node(gm, aten.mm.default)).cost == Cost(
        flops=2 * 3 * 7 * 5, bytes=(15 + 35 + 21) * F32, exact=True
    )


# -- dynamic shapes --------------------------------------------------------------------------------


def _hints(gm: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """Every size symbol of the graph's inputs, with its hint."""
    out: dict[sympy.Symbol, int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        for d in node.meta["val"].shape:
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                out[d.node.expr] = d.node.hint
    return out


def _formula(symbolic: str, key: str, hints: dict[sympy.Symbol, int]) -> sympy.Expr:
    """Parses ``key=<formula>`` over the graph's own size symbols."""
    assert symbolic is not None and symbolic.startswith(f"{key}="), symbolic
    return sympy.sympify(symbolic[len(key) + 1 :], locals={str(sym): sym for sym in hints})


def test_dynamic_matmul_costs_are_formulas_evaluated_at_the_hints():
    gm = aten_graph(_matmuls, *MATMUL_INPUTS, tracing_mode="symbolic")
    hints = _hints(gm)
    assert hints, "symbolic tracing should give the inputs size symbols"
    x_shape = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape
    m_sym, k_sym = (d.node.expr for d in x_shape)
    for target, flops, nbytes in [
        (aten.mm.default, 2 * M * N * K, (M * K + K * N + M * N) * F32),
        (aten.addmm.default, 2 * M * N * K, (N + M * K + K * N + M * N) * F32),
        (aten.bmm.default, 2 * B * M * N * K, (B * M * K + B * K * N + B * M * N) * F32),
    ]:
        c = _estimate(_node(gm, target))
        assert (c.flops, c.bytes, c.exact) == (flops, nbytes, True), target
        expr = _formula(c.symbolic, "flops", hints)
        assert {m_sym, k_sym} <= expr.free_symbols, (target, c.symbolic)
        assert expr.free_symbols <= set(hints), (target, c.symbolic)
        assert int(expr.subs(hints)) == flops, (target, c.symbolic)


def test_dynamic_op_without_formula_keeps_the_bytes_formula():
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 6), tracing_mode="symbolic")
    hints = _hints(gm)
    c = _estimate(_node(gm, aten.sin.default))
    assert (c.flops, c.bytes, c.exact) == (0.0, 2 * 4 * 6 * F32, True)
    expr = _formula(c.symbolic, "bytes", hints)
    assert expr.free_symbols == set(hints) and len(hints) == 2
    assert int(expr.subs(hints)) == 2 * 4 * 6 * F32


def test_dynamic_view_costs_nothing():
    gm = aten_graph(lambda x: x.t() + 1, torch.randn(4, 6), tracing_mode="symbolic")
    assert _estimate(_node(gm, aten.t.default)) == Cost()


def test_static_dims_of_a_dynamic_graph_stay_numbers():
    # The second operand is made inside the graph with constant sizes: only the rows are symbolic.
    gm = aten_graph(lambda x: torch.mm(x, torch.ones(K, N)), torch.randn(M, K), tracing_mode="symbolic")
    hints = _hints(gm)
    rows = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0].node.expr
    c = _estimate(_node(gm, aten.mm.default))
    assert c.flops == 2 * M * N * K
    expr = _formula(c.symbolic, "flops", hints)
    assert expr.free_symbols == {rows}
    assert sympy.simplify(expr - 2 * K * N * rows) == 0
    assert int(expr.subs(hints)) == 2 * M * N * K


# -- roofline time ---------------------------------------------------------------------------------


def test_node_time():
    assert cost.node_time(None) == 0.0
    assert cost.node_time(Cost()) == 0.0
    assert cost.node_time(Cost(flops=1.0, bytes=1.0)) == cost.LAUNCH_FLOOR_S
    big_flops = Cost(flops=cost.PEAK_FLOPS, bytes=1.0)
    assert cost.node_time(big_flops) == pytest.approx(1.0)
    big_bytes = Cost(flops=1.0, bytes=cost.PEAK_BYTES_PER_S * 2)
    assert cost.node_time(big_bytes) == pytest.approx(2.0)
    unknown_hint = Cost(flops=math.nan, bytes=cost.PEAK_BYTES_PER_S)
    assert cost.node_time(unknown_hint) == pytest.approx(1.0)


def test_a_device_model_scales_the_roofline_and_sets_the_floor():
    big = Cost(flops=cost.PEAK_FLOPS * 1e-3, bytes=1.0)  # 1 ms nominal
    tiny = Cost(flops=1.0, bytes=1.0)
    model = cost.DeviceModel(name="dev", scale=0.5, launch_floor_s=5e-6, samples=3)
    assert cost.roofline(big) == pytest.approx(1e-3) and cost.roofline(Cost()) == 0.0
    assert cost.node_time(big, model) == pytest.approx(0.5e-3)
    assert cost.node_time(tiny, model) == 5e-6
    assert cost.node_time(Cost(), model) == 0.0  # no kernel: no floor
    with cost.device_model(model):
        assert cost.current_model() is model and cost.node_time(tiny) == 5e-6
        with cost.device_model(None):
            assert cost.node_time(tiny) == cost.LAUNCH_FLOOR_S
    assert cost.current_model() is cost.NOMINAL
    assert model.describe() == ("cost model: calibrated on dev from 3 measured graph(s): roofline x0.5, "
                                "launch floor 5.00 us")
    assert cost.NOMINAL.describe() == "cost model: nominal device (roofline x1, launch floor 2.0 us)"


_GRAPHS = [
    [(1e-6, 100), (5e-6, 20), (4e-5, 8)],  # a decode: mostly tiny kernels
    [(2e-7, 300), (1e-5, 10)],
    [(8e-5, 40), (1e-6, 5)],  # a prefill: mostly big ones
]


def test_the_fit_recovers_a_devices_scale_and_floor_from_three_graphs():
    samples = [(r, cost.predicted(r, 0.5, 3e-6)) for r in _GRAPHS]
    model = cost.fit(samples, "dev")
    assert (model.name, model.samples, model.launch_floor_s) == ("dev", 3, 3e-6)
    assert model.scale == pytest.approx(0.5, rel=0.03)  # the scale grid's step is 6%
    for r, t in samples:
        assert cost.predicted(r, model.scale, model.launch_floor_s) == pytest.approx(t, rel=0.03)


def test_one_graph_fits_the_scale_alone_and_the_nominal_model_wins_ties():
    r = _GRAPHS[0]
    model = cost.fit([(r, cost.predicted(r, 0.5, 3e-6))], "dev")
    assert model.launch_floor_s == cost.LAUNCH_FLOOR_S and model.samples == 1
    assert cost.predicted(r, model.scale, model.launch_floor_s) == pytest.approx(cost.predicted(r, 0.5, 3e-6), rel=0.04)
    assert cost.fit([(r, cost.predicted(r, 1.0, cost.LAUNCH_FLOOR_S))], "dev").scale == 1.0


def test_a_fit_without_a_usable_measurement_says_so():
    with pytest.raises(ValueError, match="no measured graph"):
        cost.fit([(_GRAPHS[0], 0.0), ([], 1e-3)], "dev")


def test_an_unbacked_size_costs_nan_with_its_formula_and_warns_nothing():
    """A size only known at run time (``.item()`` into a slice) has no hint: its cost is NaN with
    the symbol's formula. Reading the hint raises no deprecation warning a user would see (torch
    2.13 deprecates ``ShapeEnv.size_hint`` with a ``FutureWarning``)."""
    import warnings

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    unbacked = env.create_unbacked_symint()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, formula = cost._numeric(unbacked)
    assert math.isnan(value) and formula == str(unbacked.node.expr)
    assert [str(w.message) for w in caught] == []
