"""Golden tests of ``insert_retention``: every captured segment retains the storage it bakes in.

Static inputs (parameters, buffers), module constants and owner-bound
resources are not allocated by the capture, so each captured segment ends in
one ``capturepass.retain`` that ties them to the graph's life. An uncaptured
graph (``cudagraphs="none"``) gets no retention at all.
"""

from __future__ import annotations

import torch
from expecttest import assert_expected_inline

from capturepass.ir import meta
from capturepass.ir.meta import Effect, LaneId, ResourceBinding
from tests.helpers import aten_graph, sync_nodes
from tests.passes.cases import before_after, case_before_after, fork_join, host_break

_CONSTANT = torch.arange(4.0)


def _retained(gm) -> list[list[str]]:
    return [[a.name for a in n.all_input_nodes] for n in sync_nodes(gm, Effect.RETAIN)]


def test_monolithic_capture_retains_its_static_input():
    gm, _, after, ctx = case_before_after("retention", "insert_retention")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=monolithic
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%mm->%add}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%mm->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  %retain_default : () = capturepass.retain([%w1_1], 0)  {lane=s0, by=insert_retention, why=storage owners of segment 0}
  return %add  {lane=s0}
""")
    # Only input 1 (%w1_1) is static; %x_1 and %w2_1 are the caller's per-call buffers.
    assert _retained(gm) == [["w1_1"]]
    assert ctx.counters["insert_retention"] == {"retained": 1}


def test_constants_are_retained():
    def fn(x):
        return x.sin() + _CONSTANT

    gm = aten_graph(fn, torch.randn(4, 4), cudagraphs="monolithic", tracing_mode="real")
    _, after, _ = before_after(gm, "insert_retention", policy="hints")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=monolithic
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s0}
  %_tensor_constant0 : f32[4] = constant _tensor_constant0  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%sin, %_tensor_constant0)  {lane=s0}
  %retain_default : () = capturepass.retain([%_tensor_constant0], 0)  {lane=s0, by=insert_retention, why=storage owners of segment 0}
  return %add  {lane=s0}
""")
    assert _retained(gm) == [["_tensor_constant0"]]


def test_each_segment_retains_what_it_uses():
    # %y_1 (static) is read in both segments, %x_1 (static too) only by k0's %sum_1.
    gm = aten_graph(host_break, torch.randn(4, 4), torch.randn(4, 4), cudagraphs="breakable", static_inputs=(0, 1))
    _, after, _ = before_after(gm, "insert_retention", policy="hints")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %y_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=join k0}
  %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=join k0}
  %retain_default : () = capturepass.retain([%y_1, %x_1], 0)  {lane=s0, by=insert_retention, why=storage owners of segment 0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k1}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k1}
  %sin : f32[4,4] = aten.sin.default(%y_1)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, lease=l1, owner=g0, by=insert_syncs, why=%sin->%mul}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, lease=l1, owner=g0, by=insert_syncs, why=%sin->%mul}
  %mul : f32[4,4] = aten.mul.Tensor(%sin, %_local_scalar_dense)  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%cos, %mul)  {lane=s0}
  %retain_default_1 : () = capturepass.retain([%y_1], 0)  {lane=s0, by=insert_retention, why=storage owners of segment 1}
  return %add  {lane=s0}
""")
    assert _retained(gm) == [["y_1", "x_1"], ["y_1"]]
    nodes = list(gm.graph.nodes)
    brk = next(n for n in nodes if meta.info(n).brk is not None)
    first, second = sync_nodes(gm, Effect.RETAIN)
    assert nodes.index(first) < nodes.index(brk) < nodes.index(second)


def test_resources_are_retained_with_the_segment():
    gm, _, after, _ = case_before_after("resources", "insert_retention")
    (retain,) = sync_nodes(gm, Effect.RETAIN)
    owner = meta.graph_info(gm).owner
    assert meta.info(retain).resources == (
        ResourceBinding("workspace", owner, LaneId(1)),
        ResourceBinding("workspace", owner, LaneId(0)),
    )
    assert retain.all_input_nodes == []


def test_capture_without_external_storage_is_unchanged():
    gm = aten_graph(fork_join, *(torch.randn(4, 4) for _ in range(3)), cudagraphs="monolithic")
    before, after, ctx = before_after(gm, "insert_retention", policy="hints")
    assert after == before
    assert "insert_retention" not in ctx.counters


def test_uncaptured_graph_retains_nothing():
    gm = aten_graph(fork_join, *(torch.randn(4, 4) for _ in range(3)), cudagraphs="none", static_inputs=(1,))
    before, after, ctx = before_after(gm, "insert_retention", policy="hints")
    assert after == before
    assert sync_nodes(gm, Effect.RETAIN) == []
    assert "insert_retention" not in ctx.counters
