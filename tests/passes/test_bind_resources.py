"""Golden tests of ``bind_resources``: declared resources bind to the graph owner and the node's lane.

``cptest_passes::fused`` declares a ``workspace`` only inside
``cases.fused_declared()``, which unregisters it again; the same op on two
lanes gets two bindings, so that two lanes never share one buffer.
"""

from __future__ import annotations

from expecttest import assert_expected_inline

from capturepass.ir.capabilities import REGISTRY
from capturepass.ir import meta
from capturepass.ir.meta import LaneId, ResourceBinding
from tests.passes.cases import CASES, before_after, case_before_after, fused


def _bindings(gm) -> dict[str, tuple[ResourceBinding, ...]]:
    return {n.name: meta.info(n).resources for n in gm.graph.nodes if meta.info(n).resources}


def test_declared_resources_bind_per_owner_and_lane():
    key = REGISTRY.key()
    gm, _, after, ctx = case_before_after("resources", "bind_resources")
    assert REGISTRY.key() == key  # the declaration was withdrawn
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=monolithic
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %y_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %fused : f32[4,4] = cptest_passes.fused.default(%y_1)  {lane=s1, hint=aux, resources=[workspace@g0/s1]}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%fused->%add}
  %fused_1 : f32[4,4] = cptest_passes.fused.default(%x_1)  {lane=s0, resources=[workspace@g0/s0]}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%fused->%add}
  %add : f32[4,4] = aten.add.Tensor(%fused, %fused_1)  {lane=s0}
  return %add  {lane=s0}
""")
    owner = meta.graph_info(gm).owner
    assert _bindings(gm) == {
        "fused": (ResourceBinding("workspace", owner, LaneId(1)),),
        "fused_1": (ResourceBinding("workspace", owner, LaneId(0)),),
    }
    assert ctx.counters["bind_resources"] == {"bindings": 2}


def test_one_lane_means_one_shared_binding():
    gm, _, _, _ = case_before_after("resources", "bind_resources", policy="off")
    owner = meta.graph_info(gm).owner
    binding = ResourceBinding("workspace", owner, LaneId(0))
    assert _bindings(gm) == {"fused": (binding,), "fused_1": (binding,)}


def test_undeclared_op_binds_nothing():
    """Without the declaration ``fused`` is an undeclared custom op: serialized, no resources."""
    gm = CASES["resources"].trace()
    before, after, ctx = before_after(gm, "bind_resources", policy="hints")
    assert after == before
    assert "bind_resources" not in ctx.counters
    ops = [n for n in gm.graph.nodes if n.target is fused._opoverload]
    assert len(ops) == 2
    assert all(meta.info(n).capability.overlap == "serialize" for n in ops)


def test_graph_without_resources_is_unchanged():
    _, before, after, ctx = case_before_after("fork_join", "bind_resources")
    assert after == before
    assert "bind_resources" not in ctx.counters
