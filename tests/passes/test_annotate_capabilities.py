"""Golden tests of ``annotate_capabilities``: a capability answer and a cost on every compute node.

The default dump shows only non-default answers (``capturable=no``,
``overlap=serialize``), so a graph of plain aten ops prints the same before and
after the pass; the cost-enabled dump shows the estimates. Inputs and the
output get neither.
"""

from __future__ import annotations

from expecttest import assert_expected_inline

from capturepass.ir import meta
from capturepass.ir.meta import Effect
from tests.helpers import dump
from tests.passes.cases import case_before_after


def _compute(gm):
    return [n for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE]


def test_every_compute_node_gets_a_capability_and_a_cost():
    gm, _, _, _ = case_before_after("fork_join", "annotate_capabilities")
    assert_expected_inline(dump(gm, cost=True), """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input
  %w1_1 : f32[4,4] = input
  %w2_1 : f32[4,4] = input
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {hint=aux, cost=128fl/192B}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {cost=128fl/192B}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {cost=0fl/192B}
  return %add
""")
    for node in _compute(gm):
        rec = meta.info(node)
        assert rec.capability is not None and rec.capability.reason == "aten op"
        assert rec.cost is not None and rec.cost.exact
        assert rec.created_by is None and rec.changed_by == ("annotate_capabilities",)
    for node in gm.graph.nodes:
        if meta.effect_of(node) is not Effect.COMPUTE:
            assert meta.info(node).capability is None and meta.info(node).cost is None


def test_host_sync_is_not_capturable():
    gm, _, after, ctx = case_before_after("host_break", "annotate_capabilities")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input
  %y_1 : f32[4,4] = input
  %cos : f32[4,4] = aten.cos.default(%y_1)  {hint=aux}
  %sum_1 : f32[] = aten.sum.default(%x_1)
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {capturable=no}
  %sin : f32[4,4] = aten.sin.default(%y_1)  {hint=aux}
  %mul : f32[4,4] = aten.mul.Tensor(%sin, %_local_scalar_dense)
  %add : f32[4,4] = aten.add.Tensor(%cos, %mul)
  return %add
""")
    item = next(n for n in gm.graph.nodes if n.name == "_local_scalar_dense")
    cap = meta.info(item).capability
    assert not cap.capturable
    assert cap.reason == "host sync: aten::_local_scalar_dense reads a tensor value on the host"
    assert ctx.counters["annotate_capabilities"] == {"not_capturable": 1}


def test_undeclared_custom_op_is_serialized():
    gm, _, after, ctx = case_before_after("serialized", "annotate_capabilities")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input
  %y_1 : f32[4,4] = input
  %cos : f32[4,4] = aten.cos.default(%y_1)  {hint=aux}
  %opaque : f32[4,4] = cptest_passes.opaque.default(%x_1)  {overlap=serialize}
  %sin : f32[4,4] = aten.sin.default(%cos)  {hint=aux}
  %add : f32[4,4] = aten.add.Tensor(%opaque, %sin)
  return %add
""")
    op = next(n for n in gm.graph.nodes if n.name == "opaque")
    cap = meta.info(op).capability
    assert (cap.overlap, cap.source, cap.reason) == (
        "serialize",
        "default",
        "undeclared custom op cptest_passes::opaque",
    )
    assert ctx.counters["annotate_capabilities"] == {"serialized": 1}


def test_declared_custom_op_comes_from_the_registry():
    gm, _, _, _ = case_before_after("resources", "annotate_capabilities")
    for name in ("fused", "fused_1"):
        node = next(n for n in gm.graph.nodes if n.name == name)
        cap = meta.info(node).capability
        assert (cap.overlap, cap.source, cap.resources) == ("safe", "registry", ("workspace",))


def test_plain_aten_graph_dump_is_unchanged():
    _, before, after, ctx = case_before_after("fork_join", "annotate_capabilities")
    assert after == before
    assert "annotate_capabilities" not in ctx.counters


def test_policy_off_still_annotates():
    """Capabilities decide breaks and serialization even on one lane, so policy=off keeps them."""
    on, _, _, _ = case_before_after("host_break", "annotate_capabilities")
    off, _, _, _ = case_before_after("host_break", "annotate_capabilities", policy="off")
    assert [meta.info(n).capability for n in _compute(on)] == [meta.info(n).capability for n in _compute(off)]
    assert any(not meta.info(n).capability.capturable for n in _compute(off))
