"""Golden tests of ``assign_streams``: lanes by policy, views follow consumers, breaks are marked.

``hints`` puts hinted nodes on their named lanes and everything else on main;
``auto`` schedules unhinted kernels over automatic lanes; ``off`` keeps one
lane. Whatever the policy, a non-capturable op stays on main and becomes a
break under a capturing mode (``monolithic`` then switches to ``breakable``,
and says why).
"""

from __future__ import annotations

import torch
from expecttest import assert_expected_inline

import capturepass
from capturepass.ir import meta
from capturepass.ir.meta import MAIN_LANE, Effect
from tests.helpers import aten_graph
from tests.passes.cases import before_after, case_before_after, host_break, run_one

L = capturepass.lane


def _lanes(gm) -> dict[str, int]:
    return {n.name: meta.lane_of(n).index for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE}


def test_hinted_nodes_run_on_their_lanes():
    gm, _, after, ctx = case_before_after("two_joins", "assign_streams")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=a1}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s2, hint=a2}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")
    assert meta.graph_info(gm).lanes == ("main", "a1", "a2")
    assert ctx.counters["assign_streams"] == {"lanes": 3, "aux_nodes": 2, "breaks": 0}


def test_views_follow_their_consumers():
    def fn(x, w):
        v = x.view(16)
        with L("aux"):
            a = v.sin()
        t = w.t()
        with L("aux"):
            b = torch.mm(t, x)
        return a.view(4, 4) + b

    gm = aten_graph(fn, torch.randn(4, 4), torch.randn(4, 4))
    _, after, _ = before_after(gm, "assign_streams", policy="hints")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w_1 : f32[4,4] = input  {lane=s0}
  %view : f32[16] = aten.view.default(%x_1, [16])  {lane=s1}
  %sin : f32[16] = aten.sin.default(%view)  {lane=s1, hint=aux}
  %t : f32[4,4] = aten.t.default(%w_1)  {lane=s1}
  %mm : f32[4,4] = aten.mm.default(%t, %x_1)  {lane=s1, hint=aux}
  %view_1 : f32[4,4] = aten.view.default(%sin, [4, 4])  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%view_1, %mm)  {lane=s0}
  return %add  {lane=s0}
""")
    assert _lanes(gm) == {"view": 1, "sin": 1, "t": 1, "mm": 1, "view_1": 0, "add": 0}


def test_auto_policy_spreads_independent_branches():
    gm, _, after, _ = case_before_after("auto_branches", "assign_streams")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux0; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s0}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s1}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")
    assert _lanes(gm) == {"mm": 0, "mm_1": 1, "add": 0}


def test_auto_policy_keeps_a_chain_on_main():
    gm, _, after, ctx = case_before_after("single_lane", "assign_streams", policy="auto")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w_1 : f32[4,4] = input  {lane=s0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w_1)  {lane=s0}
  %relu : f32[4,4] = aten.relu.default(%mm)  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%relu, %x_1)  {lane=s0}
  return %add  {lane=s0}
""")
    # The automatic lanes the schedule left empty are dropped.
    assert meta.graph_info(gm).lanes == ("main",)
    assert "aux_nodes" not in ctx.counters["assign_streams"]


def _busy_producer_lane(x, w):
    m = torch.mm(x, w)
    a = m.relu()                        # pointwise, after its product on main
    m2 = torch.mm(a, w)                 # keeps main busy
    b = (a * 2).sigmoid()               # fuses with %relu: on its lane, not on an idle one
    return m2 + b


def test_a_kernel_inductor_fuses_with_its_producer_stays_on_the_producers_lane():
    # Large enough that the products dwarf an event: an idle lane would finish %mul sooner.
    args = (torch.randn(2048, 2048), torch.randn(2048, 2048))
    gm = aten_graph(_busy_producer_lane, *args)
    _, after, _ = before_after(gm, "assign_streams", policy="auto")
    lanes = _lanes(gm)
    # Apart from %relu, %mul and %sigmoid would launch a kernel of their own (with an event
    # between), where Inductor fuses the three into one.
    assert lanes["relu"] == lanes["mul"] == lanes["sigmoid"] == lanes["mm"] == 0


def _constants_for_a_side_lane(x, w, v):
    pos = torch.arange(64, dtype=torch.float32)     # reads no device data
    scale = torch.full((64,), 0.5) * pos            # and what only it feeds
    main = torch.mm(torch.mm(x, w), w)
    with L("side"):
        side = torch.mm(v, w) * scale               # their only reader, on the hinted lane
    return main + side


def test_constants_follow_their_readers():
    args = (torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64))
    gm = aten_graph(_constants_for_a_side_lane, *args)
    _, after, _ = before_after(gm, "assign_streams", policy="auto")
    lanes = _lanes(gm)
    side = meta.graph_info(gm).lanes.index("side")
    assert lanes["mul_1"] == side
    # They run where their one reader runs: no event carries them across.
    assert (lanes["arange"], lanes["full"], lanes["mul"]) == (side, side, side)


def test_a_random_draw_is_no_constant():
    """A draw reads no device data either, but it is a new value at every call, in the order of
    the draws: it is scheduled as a kernel, not moved to its readers."""
    from capturepass.ir import analysis, effects
    from capturepass.passes.assign_streams import _Fusion

    def fn(x):
        return x * torch.full((64,), 0.5) + torch.normal(0.0, 1.0, (64,))

    gm = aten_graph(fn, torch.randn(64))
    nodes = list(analysis.compute_nodes(gm.graph))
    fusing = _Fusion(effects.order_deps(nodes))
    got = {n.target.overloadpacket.__name__: fusing.computes_a_constant(n) for n in nodes}
    assert got["full"] is True and got["normal"] is False, got


def test_non_capturable_op_stays_on_main_and_monolithic_becomes_breakable():
    def fn(x):
        with L("aux"):
            s = x.sum().item()
        return x * s

    gm = aten_graph(fn, torch.randn(4, 4), cudagraphs="monolithic")
    _, after, ctx = before_after(gm, "assign_streams", policy="hints")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s1, hint=aux}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, hint=aux, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  %mul : f32[4,4] = aten.mul.Tensor(%x_1, %_local_scalar_dense)  {lane=s0}
  return %mul  {lane=s0}
# decision: %_local_scalar_dense: hint ignored, host sync: aten::_local_scalar_dense reads a tensor value on the host
# decision: cudagraphs=monolithic switched to breakable: %_local_scalar_dense is not capturable (host sync: aten::_local_scalar_dense reads a tensor value on the host)
""")
    item = next(n for n in gm.graph.nodes if n.name == "_local_scalar_dense")
    assert meta.lane_of(item) == MAIN_LANE
    assert meta.info(item).brk == "host sync: aten::_local_scalar_dense reads a tensor value on the host"
    assert meta.graph_info(gm).cudagraphs == "breakable"
    assert ctx.counters["assign_streams"]["breaks"] == 1


def test_non_capturable_op_is_a_break_only_under_capture():
    captured, _, _, _ = case_before_after("host_break", "assign_streams")
    assert [n.name for n in captured.graph.nodes if meta.info(n).brk is not None] == ["_local_scalar_dense"]
    eager = aten_graph(host_break, torch.randn(4, 4), torch.randn(4, 4), cudagraphs="none")
    _, after, ctx = before_after(eager, "assign_streams", policy="hints")
    assert all(meta.info(n).brk is None for n in eager.graph.nodes)
    assert meta.graph_info(eager).cudagraphs == "none"
    assert ctx.counters["assign_streams"]["breaks"] == 0


def test_hinted_lanes_beyond_max_aux_lanes_fold_onto_main():
    def fn(x):
        with L("a1"):
            a = x.sin()
        with L("a2"):
            b = x.cos()
        with L("a3"):
            c = x.exp()
        return a + b + c

    gm = aten_graph(fn, torch.randn(4, 4))
    _, after, _ = before_after(gm, "assign_streams", policy="hints", max_aux_lanes=1)
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=a1; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s1, hint=a1}
  %cos : f32[4,4] = aten.cos.default(%x_1)  {lane=s0, hint=a2}
  %exp : f32[4,4] = aten.exp.default(%x_1)  {lane=s0, hint=a3}
  %add : f32[4,4] = aten.add.Tensor(%sin, %cos)  {lane=s0}
  %add_1 : f32[4,4] = aten.add.Tensor(%add, %exp)  {lane=s0}
  return %add_1  {lane=s0}
# decision: max_aux_lanes=1: hinted lane(s) a2, a3 run on the main lane
""")
    assert _lanes(gm) == {"sin": 1, "cos": 0, "exp": 0, "add": 0, "add_1": 0}


def test_policy_off_keeps_one_lane():
    gm, _, after, ctx = case_before_after("two_joins", "assign_streams", policy="off")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s0}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
# decision: policy=off: ignored the lane hints of 2 node(s)
""")
    assert set(_lanes(gm).values()) == {0}
    assert meta.graph_info(gm).lanes == ("main",)


def test_running_again_changes_nothing():
    gm, _, after, _ = case_before_after("host_break", "assign_streams")
    again, _ = run_one(gm, "assign_streams", policy="hints")
    assert again == after


def _rotary_pair(x, wq, wk, cos, sin):
    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[:, half:], t[:, :half]], -1) * sin

    return rope(torch.mm(x, wq)), rope(torch.mm(x, wk))


def test_a_group_inductor_fuses_into_one_kernel_runs_on_one_lane():
    """A rotary embedding of two products: each product may run on a lane of its own, but each
    embedding's negation, concatenation, products and sum are one kernel of Inductor's, on one
    lane (split over lanes, each piece would launch a kernel between two events)."""
    args = (torch.randn(2048, 2048), torch.randn(2048, 2048), torch.randn(2048, 2048),
            torch.randn(2048, 2048), torch.randn(2048, 2048))
    gm = aten_graph(_rotary_pair, *args)
    _, after, _ = before_after(gm, "assign_streams", policy="auto")
    lanes = _lanes(gm)
    first = ["neg", "cat", "mul", "mul_1", "add"]
    second = ["neg_1", "cat_1", "mul_2", "mul_3", "add_1"]
    assert {lanes[n] for n in first} == {lanes["mm"]}, lanes
    assert {lanes[n] for n in second} == {lanes["mm_1"]}, lanes
    assert lanes["mm"] != lanes["mm_1"], lanes


def _router_before_experts(x, wr, w1, w2, ws):
    # Written as a MoE block is: the router (one small product and a softmax) before the
    # experts (two large products), which do not read it until the end; a shared product beside.
    gate = torch.softmax(torch.mm(x, wr), dim=-1)
    experts = torch.mm(torch.mm(x, w1).relu(), w2)
    shared = torch.mm(x, ws)
    return experts * gate[:, :1] + shared


def _compute_order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE]


def test_the_longest_path_is_issued_first():
    """A lane runs its kernels in program order: the experts' chain, written after the router,
    is issued before it, so that the critical path starts at once and the router fills a lane
    beside it."""
    args = (torch.randn(64, 2048), torch.randn(2048, 8), torch.randn(2048, 8192),
            torch.randn(8192, 2048), torch.randn(2048, 2048))
    gm = aten_graph(_router_before_experts, *args)
    assert _compute_order(gm).index("mm") < _compute_order(gm).index("mm_1")
    _, after, _ = before_after(gm, "assign_streams", policy="auto")
    order = _compute_order(gm)
    assert order.index("mm_1") < order.index("mm"), order   # the experts' first product first
    assert order.index("mm_2") < order.index("mm"), order   # then its second: still the longest
    lanes = _lanes(gm)
    assert len(set(lanes.values())) > 1, lanes
    # Every node still comes after what it reads.
    seen: set = set()
    for n in gm.graph.nodes:
        assert all(a in seen for a in n.all_input_nodes), n.name
        seen.add(n)


def test_a_schedule_on_one_lane_keeps_the_written_order():
    # Every lane shorter than the threshold goes back to main: one lane, and the program stays
    # as written (Inductor's fusion and buffer reuse see the order policy="off" gives them).
    args = (torch.randn(64, 2048), torch.randn(2048, 8), torch.randn(2048, 8192),
            torch.randn(8192, 2048), torch.randn(2048, 2048))
    gm = aten_graph(_router_before_experts, *args)
    written = _compute_order(gm)
    before_after(gm, "assign_streams", policy="auto", merge_lanes_below_us=1e9)
    assert set(_lanes(gm).values()) == {0}
    assert _compute_order(gm) == written


def _interleaved(x, w):
    with L("side"):
        a = torch.mm(x, w)
    b = torch.mm(w, x)
    with L("side"):
        a2 = torch.mm(a, w)
    b2 = torch.mm(b, x)
    with L("side"):
        a3 = a2.sin()
    return a3 + b2.cos()


def test_each_lane_runs_in_long_stretches_of_the_program():
    """Written alternating between two lanes, the program is reordered into one stretch per
    lane (each switch of lane is a sync point of the compiled code), each lane keeping its own
    order. Under policy="hints" the program keeps the order its author wrote."""
    gm = aten_graph(_interleaved, torch.randn(64, 64), torch.randn(64, 64))
    # The hinted lane is the one aux lane: the scheduler leaves the rest on main.
    before_after(gm, "assign_streams", policy="auto", max_aux_lanes=1)
    lanes = _lanes(gm)
    order = [n for n in _compute_order(gm) if n in lanes]
    seq = [lanes[n] for n in order]
    switches = sum(a != b for a, b in zip(seq, seq[1:]))
    assert switches <= 2, list(zip(order, seq))
    side = [n for n in order if lanes[n] == 1]
    assert side == ["mm", "mm_2", "sin"], side
    assert [n for n in order if lanes[n] == 0][:2] == ["mm_1", "mm_3"], order
    gm = aten_graph(_interleaved, torch.randn(64, 64), torch.randn(64, 64))
    written = _compute_order(gm)
    before_after(gm, "assign_streams", policy="hints")
    assert _compute_order(gm) == written
