"""Negative tests of the verifier: break one thing in a valid graph, get the right rule.

Every test starts from a graph that verifies (one of the shared cases of
``tests/passes/cases.py``, run through ``partition``), changes exactly one
thing, and checks that :func:`capturepass.ir.verify.verify` raises a
:class:`~capturepass.errors.VerificationError` with the expected rule, naming
the offending node, in a message short enough to read (the first line plus a
window of the dump around the node). The positive test runs the verifier on
every valid graph of the golden tests.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

import capturepass
from capturepass.errors import VerificationError
from capturepass.ir import meta
from capturepass.ir.meta import Effect, LaneId, LeaseId, OwnerId
from capturepass.ir.verify import verify
from capturepass.passes.base import ALL_PROPERTIES, EMITTED, VERIFIED
from tests.helpers import aten_graph, dump, run_passes, sync_nodes
from tests.passes.cases import CASES, build

L = capturepass.lane
MAX_LINES = 20


def _valid(name: str) -> fx.GraphModule:
    gm, _ = build(name, "partition", verify_each=False)
    verify(gm)
    return gm


def _node(gm, name: str):
    return next(n for n in gm.graph.nodes if n.name == name)


def _wait(gm, why: str, lane: int):
    (node,) = [n for n in sync_nodes(gm, Effect.WAIT) if meta.info(n).why == why and meta.lane_of(n).index == lane]
    return node


def _record_of(gm, wait):
    event = meta.info(wait).event
    (node,) = [n for n in sync_nodes(gm, Effect.RECORD) if meta.info(n).event == event]
    return node


def _fails(gm, rule: str, node: str) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify(gm)
    err = info.value
    text = str(err)
    assert (err.rule, err.node) == (rule, node), text
    first = text.splitlines()[0]
    assert first.startswith(f"[{rule}] %{node}"), text
    assert len(text.splitlines()) < MAX_LINES, text
    # The window around the node marks it.
    assert any(line.startswith(">> ") for line in text.splitlines()[1:]), text
    return err


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_golden_graph_verifies(name):
    gm = _valid(name)
    assert "partitioned" in meta.graph_info(gm).properties
    # Also with every property claimed, as the verify pass sees it.
    verify(gm, properties=set(ALL_PROPERTIES) - {VERIFIED, EMITTED})


def test_dropped_join_wait_is_an_unordered_read():
    gm = _valid("fork_join")
    gm.graph.erase_node(_wait(gm, "%mm->%add", lane=0))
    err = _fails(gm, "unordered-read", "add")
    assert "on s0 reads %mm produced on s1" in str(err)


def test_dropped_fork_wait_leaves_the_lane_unforked():
    gm = _valid("fork_join")
    gm.graph.erase_node(_wait(gm, "fork k0", lane=1))
    err = _fails(gm, "unforked-lane", "mm")
    assert "first node of lane s1 (aux)" in str(err)


def test_record_on_the_waiting_lane():
    gm = _valid("fork_join")
    record = _record_of(gm, _wait(gm, "%mm->%add", lane=0))
    meta.update(record, "test", lane=meta.MAIN_LANE)
    err = _fails(gm, "wait-before-record", "wait_default_1")
    assert "recorded on the same lane by %record_default_1" in str(err)


def test_record_on_a_lane_that_does_not_know_the_producer():
    gm = _valid("diamond")
    record = _record_of(gm, _wait(gm, "%sin->%cos", lane=2))
    meta.update(record, "test", lane=meta.MAIN_LANE)
    err = _fails(gm, "unordered-read", "cos")
    assert "on s2 reads %sin produced on s1" in str(err)


def test_wait_moved_before_its_record():
    gm = _valid("fork_join")
    wait = _wait(gm, "%mm->%add", lane=0)
    record = _record_of(gm, wait)
    record.prepend(wait)
    err = _fails(gm, "wait-before-record", "wait_default_1")
    assert "which no earlier node records" in str(err)
    assert "(created by insert_syncs; changed by lease_events, partition)" in str(err)


def test_lease_of_another_owner():
    gm = _valid("fork_join")
    record = _record_of(gm, _wait(gm, "%mm->%add", lane=0))
    lease = meta.info(record).lease
    meta.update(record, "test", lease=LeaseId(OwnerId(lease.owner.index + 1), lease.role, lease.index))
    err = _fails(gm, "lease-owner", "record_default_1")
    assert "but the graph's owner is" in str(err)


def test_lease_of_another_role():
    gm = _valid("fork_join")
    fork = _record_of(gm, _wait(gm, "fork k0", lane=1))
    join_wait = _wait(gm, "%mm->%add", lane=0)
    join = _record_of(gm, join_wait)
    for node in (join, join_wait):
        meta.update(node, "test", lease=meta.info(fork).lease)
    err = _fails(gm, "lease-owner", "record_default_1")
    assert "uses a 'fork' lease for a 'join' event" in str(err)


def test_two_live_events_share_a_lease():
    gm = _valid("two_joins")
    first = _wait(gm, "%mm->%add", lane=0)
    second = _wait(gm, "%mm_1->%add", lane=0)
    lease = meta.info(first).lease
    for node in (second, _record_of(gm, second)):
        meta.update(node, "test", lease=lease)
    err = _fails(gm, "lease-overlap", "record_default_2")
    assert "while event" in str(err) and "is still waited on" in str(err)


def test_removed_retention():
    gm = _valid("retention")
    (retain,) = sync_nodes(gm, Effect.RETAIN)
    gm.graph.erase_node(retain)
    err = _fails(gm, "unretained-owner", "mm")
    assert "bakes the storage of %w1_1 into a captured segment" in str(err)


def test_removed_retention_of_a_resource():
    gm = _valid("resources")
    (retain,) = sync_nodes(gm, Effect.RETAIN)
    meta.update(retain, "test", resources=meta.info(retain).resources[1:])
    err = _fails(gm, "unretained-owner", "fused")
    assert "uses resource workspace@" in str(err)


def test_lane_left_unjoined():
    gm = _valid("chain")
    gm.graph.erase_node(_wait(gm, "join k0", lane=0))
    err = _fails(gm, "unjoined-lane", "output")
    assert "lane s1 (aux) has not joined s0" in str(err)


def test_lane_left_unjoined_before_a_break():
    gm = _valid("host_break")
    gm.graph.erase_node(_wait(gm, "join k0", lane=0))
    _fails(gm, "unjoined-lane", "_local_scalar_dense")


def test_removed_deferred_release():
    gm = _valid("deferred_release")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    gm.graph.erase_node(release)
    err = _fails(gm, "unordered-free", "sin")
    assert "while %cos on s1 may still read it (a deferred release is missing)" in str(err)


def test_removed_release_of_storage_read_in_a_later_segment():
    """Regression: the free of ``%cos`` (aux, k0) after ``%mul`` (main, k1) races ``%sin`` (aux, k1).

    The verifier used to look for later aux work in ``%cos``'s own segment only.
    """
    gm = _valid("cross_segment_release")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    gm.graph.erase_node(release)
    err = _fails(gm, "unordered-free", "cos")
    assert "while %mul on s0 may still read it" in str(err)


def test_release_moved_before_it_is_safe():
    gm = _valid("deferred_release")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    _node(gm, "exp").prepend(release)
    err = _fails(gm, "unordered-free", release.name)
    assert "releases %sin on s0 while %cos on s1 may still read it" in str(err)


def test_release_on_the_wrong_lane():
    gm = _valid("deferred_release")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    meta.update(release, "test", lane=LaneId(1))
    err = _fails(gm, "unordered-free", release.name)
    assert "but it was allocated on s0" in str(err)


def test_break_on_an_aux_lane():
    gm = _valid("host_break")
    meta.update(_node(gm, "_local_scalar_dense"), "test", lane=LaneId(1))
    err = _fails(gm, "lane", "_local_scalar_dense")
    assert "is a break (host sync" in str(err) and "but is on s1, not s0" in str(err)


def test_node_on_an_unknown_lane():
    gm = _valid("fork_join")
    meta.update(_node(gm, "mm_1"), "test", lane=LaneId(5))
    err = _fails(gm, "lane", "mm_1")
    assert "the graph has lanes s0..s1" in str(err)


def test_serialized_op_beside_aux_work():
    gm = _valid("serialized")
    gm.graph.erase_node(_wait(gm, "serialize %opaque", lane=0))
    err = _fails(gm, "serialize", "opaque")
    assert "lane s1 may still be running" in str(err)


def test_aux_work_beside_a_serialized_op():
    gm = _valid("serialized")
    gm.graph.erase_node(_wait(gm, "serialize %opaque", lane=1))
    err = _fails(gm, "serialize", "sin")
    assert "beside serialized %opaque" in str(err)


def test_node_outside_every_segment():
    gm = _valid("fork_join")
    meta.update(_node(gm, "mm_1"), "test", segment=None)
    err = _fails(gm, "segment", "mm_1")
    assert "belongs to no segment" in str(err)


def test_use_before_definition_fails_lint():
    gm = _valid("fork_join")
    _node(gm, "mm").prepend(_node(gm, "add"))
    with pytest.raises(VerificationError) as info:
        verify(gm)
    assert info.value.rule == "graph"
    assert "FX lint failed" in str(info.value) and "add" in str(info.value)


def test_rules_wait_for_their_property():
    """A rule is checked only once the pass that establishes its property has run."""
    gm = _valid("fork_join")
    gm.graph.erase_node(_wait(gm, "%mm->%add", lane=0))
    verify(gm, properties={"hints", "capabilities", "lanes"})
    with pytest.raises(VerificationError):
        verify(gm, properties={"lanes", "synced"})


def test_message_and_window_use_the_dump_ids():
    """Regression: the message named raw event ids, the window numbered its own from its first line.

    Here the first record in print order is the second event insert_syncs made
    (``%neg`` needed ``%sin`` after ``%exp`` needed ``%cos``), so raw and
    canonical ids differ; message, window and dump must all say the same.
    """

    def fn(x):
        a = x.sin()
        b = x.cos()
        with L("a1"):
            c = b.exp()
        with L("a2"):
            d = a.neg()
        return c + d

    gm = aten_graph(fn, torch.randn(4, 4))
    run_passes(gm, upto="partition", policy="hints")
    wait = _wait(gm, "%sin->%neg", lane=2)
    assert meta.info(wait).event.index == 1  # raw id; the dump calls it e0
    _record_of(gm, wait).prepend(wait)
    (line,) = [line for line in dump(gm).splitlines() if line.strip().startswith(f"%{wait.name} ")]
    assert re.search(r"wait=(e\d+)", line).group(1) == "e0"
    err = _fails(gm, "wait-before-record", wait.name)
    text = str(err)
    assert re.search(r"waits for event (e\d+)", text).group(1) == "e0"
    (marked,) = [line for line in text.splitlines() if line.startswith(">> ")]
    assert re.search(r"wait=(e\d+)", marked).group(1) == "e0"


def test_check_joins_alone_catches_an_unjoined_lane_and_nothing_else():
    from capturepass.ir.verify import check_joins

    gm = _valid("chain")
    check_joins(gm)  # a valid graph passes
    gm.graph.erase_node(_wait(gm, "join k0", lane=0))
    with pytest.raises(VerificationError) as info:
        check_joins(gm)
    assert (info.value.rule, info.value.node) == ("unjoined-lane", "output")
    # Rules partition does not cut on (here: a lane that runs before its fork) are left to
    # the verify pass.
    gm = _valid("chain")
    gm.graph.erase_node(next(n for n in sync_nodes(gm, Effect.WAIT) if meta.info(n).why.startswith("%")))
    check_joins(gm)
    with pytest.raises(VerificationError, match="unforked-lane"):
        verify(gm)


def test_partition_refuses_to_cut_where_a_lane_has_not_joined():
    from capturepass.passes.partition import Partition
    from tests.helpers import context

    gm, ctx = build("chain", "insert_retention", verify_each=False)
    gm.graph.erase_node(_wait(gm, "join k0", lane=0))
    with pytest.raises(VerificationError, match=r"\[unjoined-lane\] %output"):
        Partition().run(gm, ctx)


def test_dropped_war_wait_lets_a_write_pass_an_earlier_read():
    """The issue's first program: ``a = x @ w; x.add_(1)`` with the matmul on another lane. Data
    edges alone leave the in-place write unordered with the read: the storage model catches it."""
    gm = _valid("write_after_read")
    gm.graph.erase_node(_wait(gm, "%mm->%add_ (war %x_1)", lane=0))
    err = _fails(gm, "storage-order", "add_")
    assert "on s0 writes %x_1 while %mm on s1, earlier in program order, may still read it" in str(err)


def test_dropped_raw_wait_lets_a_read_pass_an_earlier_write_through_a_view():
    gm = _valid("read_after_write")
    gm.graph.erase_node(_wait(gm, "%mul_->%mm (raw %x_1)", lane=1))
    err = _fails(gm, "storage-order", "mm")
    assert "on s1 reads %x_1, which %mul_ on s0 writes earlier in program order" in str(err)


def test_dropped_rng_wait_lets_random_draws_reorder():
    gm = _valid("random_order")
    gm.graph.erase_node(_wait(gm, "%rand_like->%rand_like_1 (raw rng)", lane=0))
    err = _fails(gm, "storage-order", "rand_like_1")
    assert "reads the RNG state, which %rand_like on s1 writes earlier in program order" in str(err)
