"""Golden tests of ``partition``: segment ids, the graph owner on every node, breaks with reasons.

The segment structure was fixed by ``assign_streams`` (breaks) and
``insert_syncs`` (joins before each break); ``partition`` materializes it and
refuses to cut where a lane has not joined.
"""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

from capturepass.errors import VerificationError
from capturepass.ir import meta
from capturepass.ir.meta import Break, Effect, SegmentId
from tests.helpers import sync_nodes
from tests.passes.cases import case_before_after, run_one


def test_one_segment_without_breaks():
    gm, _, after, ctx = case_before_after("fork_join", "partition")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0, owner=g0}
  %w1_1 : f32[4,4] = input  {lane=s0, owner=g0}
  %w2_1 : f32[4,4] = input  {lane=s0, owner=g0}
  segment k0:
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=aux, owner=g0, segment=k0}
    %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm->%add}
    %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s0, owner=g0, segment=k0}
    %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm->%add}
    %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0, owner=g0, segment=k0}
  return %add  {lane=s0, owner=g0}
""")
    gi = meta.graph_info(gm)
    assert gi.segments == (SegmentId(0),)
    assert gi.breaks == ()
    assert all(meta.info(n).owner == gi.owner for n in gm.graph.nodes)
    assert ctx.counters["partition"] == {"segments": 1, "breaks": 0}


def test_host_sync_splits_two_segments_with_a_reason():
    gm, _, after, ctx = case_before_after("host_break", "partition")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0, owner=g0}
  %y_1 : f32[4,4] = input  {lane=s0, owner=g0}
  segment k0:
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s1, hint=aux, owner=g0, segment=k0}
    %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=join k0}
    %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s0, owner=g0, segment=k0}
    %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=join k0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, owner=g0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  segment k1:
    %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, lease=l0, owner=g0, segment=k1, by=insert_syncs, why=fork k1}
    %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, lease=l0, owner=g0, segment=k1, by=insert_syncs, why=fork k1}
    %sin : f32[4,4] = aten.sin.default(%y_1)  {lane=s1, hint=aux, owner=g0, segment=k1}
    %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, lease=l1, owner=g0, segment=k1, by=insert_syncs, why=%sin->%mul}
    %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, lease=l1, owner=g0, segment=k1, by=insert_syncs, why=%sin->%mul}
    %mul : f32[4,4] = aten.mul.Tensor(%sin, %_local_scalar_dense)  {lane=s0, owner=g0, segment=k1}
    %add : f32[4,4] = aten.add.Tensor(%cos, %mul)  {lane=s0, owner=g0, segment=k1}
  return %add  {lane=s0, owner=g0}
""")
    gi = meta.graph_info(gm)
    assert gi.segments == (SegmentId(0), SegmentId(1))
    assert gi.breaks == (
        Break(node="_local_scalar_dense", reason="host sync: aten::_local_scalar_dense reads a tensor value on the host"),
    )
    assert ctx.counters["partition"] == {"segments": 2, "breaks": 1}


def test_upstream_breaks_are_kept_and_printed():
    gm = case_before_after("fork_join", "insert_retention")[0]
    gi = meta.graph_info(gm)
    meta.update_graph(gm, breaks=(Break(node="", reason="call to print()", source="dynamo"),))
    after, _ = run_one(gm, "partition", policy="hints")
    assert after.endswith("# dynamo break: call to print()\n")
    assert meta.graph_info(gm).breaks == (Break(node="", reason="call to print()", source="dynamo"),)
    assert gi.owner == meta.graph_info(gm).owner


def test_running_again_changes_nothing():
    gm, _, after, _ = case_before_after("host_break", "partition")
    again, _ = run_one(gm, "partition", policy="hints")
    assert again == after
    assert len(meta.graph_info(gm).breaks) == 1


def test_policy_off_gives_the_same_segments_on_one_lane():
    gm, _, after, _ = case_before_after("host_break", "partition", policy="off")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0, owner=g0}
  %y_1 : f32[4,4] = input  {lane=s0, owner=g0}
  segment k0:
    %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s0, owner=g0, segment=k0}
    %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s0, owner=g0, segment=k0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, owner=g0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  segment k1:
    %sin : f32[4,4] = aten.sin.default(%y_1)  {lane=s0, owner=g0, segment=k1}
    %mul : f32[4,4] = aten.mul.Tensor(%sin, %_local_scalar_dense)  {lane=s0, owner=g0, segment=k1}
    %add : f32[4,4] = aten.add.Tensor(%cos, %mul)  {lane=s0, owner=g0, segment=k1}
  return %add  {lane=s0, owner=g0}
# decision: policy=off: ignored the lane hints of 2 node(s)
""")
    assert meta.graph_info(gm).segments == (SegmentId(0), SegmentId(1))
    assert sync_nodes(gm, Effect.WAIT) == []


def test_refuses_to_cut_where_a_lane_has_not_joined():
    gm, _, _, _ = case_before_after("host_break", "insert_retention")
    join = next(n for n in sync_nodes(gm, Effect.WAIT) if meta.info(n).why == "join k0")
    gm.graph.erase_node(join)
    with pytest.raises(VerificationError) as info:
        run_one(gm, "partition", policy="hints")
    assert info.value.rule == "unjoined-lane"
    assert info.value.node == "_local_scalar_dense"
