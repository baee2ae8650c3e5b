"""Golden tests of ``lease_events``: role-separated leases of the graph owner, reused when free.

A lease stands for one event object. An event whose last wait was issued may
be recorded again, so the next event of the same role whose record comes after
that wait reuses the lease; events live at the same time never share one, and
a fork event never shares a lease with a join event.
"""

from __future__ import annotations

from expecttest import assert_expected_inline

from capturepass.ir import meta
from capturepass.ir.meta import Effect
from tests.helpers import sync_nodes
from tests.passes.cases import case_before_after


def _leases(gm) -> dict[int, tuple[str, int]]:
    """Raw event index -> (role, lease index), from the records."""
    return {
        meta.info(n).event.index: (meta.info(n).role, meta.info(n).lease.index)
        for n in sync_nodes(gm, Effect.RECORD)
    }


def test_sequential_events_of_one_role_share_a_lease():
    gm, _, after, ctx = case_before_after("chain", "lease_events")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=%sin->%cos}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=%sin->%cos}
  %cos : f32[4,4] = aten.cos.default(%sin)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%cos->%exp}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%cos->%exp}
  %exp : f32[4,4] = aten.exp.default(%cos)  {lane=s0}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, lease=l0, owner=g0, by=insert_syncs, why=%exp->%neg}
  %release_default : () = capturepass.release([%sin], 0)  {lane=s0, by=insert_syncs, why=read by %cos}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, lease=l0, owner=g0, by=insert_syncs, why=%exp->%neg}
  %neg : f32[4,4] = aten.neg.default(%exp)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, lease=l1, owner=g0, by=insert_syncs, why=join k0}
  %release_default_1 : () = capturepass.release([%cos], 1)  {lane=s1, by=insert_syncs, why=read by %exp}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, lease=l1, owner=g0, by=insert_syncs, why=join k0}
  return %neg  {lane=s0}
""")
    # e0 and e2 are forks, e1 and e3 joins; each event's waits end before the next one of its
    # role is recorded, so two leases serve four events.
    assert _leases(gm) == {0: ("fork", 0), 1: ("join", 1), 2: ("fork", 0), 3: ("join", 1)}
    assert ctx.counters["lease_events"] == {"leases": 2, "events": 4, "reused": 2}


def test_events_live_at_once_get_their_own_leases():
    gm, _, after, ctx = case_before_after("two_joins", "lease_events")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=a1}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%mm->%add}
  %wait_default_1 : () = capturepass.wait(0, 2)  {lane=s2, wait=e0, role=fork, lease=l0, owner=g0, by=insert_syncs, why=fork k0}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s2, hint=a2}
  %record_default_2 : () = capturepass.record(2, 2)  {lane=s2, record=e2, role=join, lease=l2, owner=g0, by=insert_syncs, why=%mm_1->%add}
  %wait_default_2 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, by=insert_syncs, why=%mm->%add}
  %wait_default_3 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, lease=l2, owner=g0, by=insert_syncs, why=%mm_1->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")
    # Both joins are recorded before either is waited on.
    assert _leases(gm) == {0: ("fork", 0), 1: ("join", 1), 2: ("join", 2)}
    assert ctx.counters["lease_events"] == {"leases": 3, "events": 3}


def test_breakable_segments_reuse_fork_and_join_leases():
    gm, _, _, ctx = case_before_after("host_break", "lease_events")
    assert _leases(gm) == {0: ("fork", 0), 1: ("join", 1), 2: ("fork", 0), 3: ("join", 1)}
    assert ctx.counters["lease_events"]["reused"] == 2


def test_every_sync_node_gets_a_lease_of_the_graph_owner():
    gm, _, _, _ = case_before_after("diamond", "lease_events")
    owner = meta.graph_info(gm).owner
    syncs = sync_nodes(gm, Effect.RECORD) + sync_nodes(gm, Effect.WAIT)
    assert syncs
    for node in syncs:
        rec = meta.info(node)
        assert rec.owner == owner and rec.lease.owner == owner
        assert rec.lease.role == rec.role
    # A wait uses the lease of the event it waits for.
    by_event = {meta.info(n).event: meta.info(n).lease for n in sync_nodes(gm, Effect.RECORD)}
    assert all(meta.info(n).lease == by_event[meta.info(n).event] for n in sync_nodes(gm, Effect.WAIT))


def test_graph_without_events_is_unchanged():
    _, before, after, ctx = case_before_after("single_lane", "lease_events")
    assert after == before
    assert ctx.counters["lease_events"] == {"leases": 0, "events": 0}


def test_policy_off_leases_nothing():
    _, before, after, ctx = case_before_after("chain", "lease_events", policy="off")
    assert after == before
    assert ctx.counters["lease_events"] == {"leases": 0, "events": 0}
