"""Tests of the typed metadata accessors: frozen records, provenance, graph-wide data.

Every capturepass fact lives in one frozen record per node
(``node.meta["capturepass"]``) and one per graph; these tests pin what the
accessors promise: records are replaced, never mutated; ``update`` notes the
pass that changed a node (once per run of a pass, never the creator); nodes
without a record read as defaults derived from their FX op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from capturepass.ir import meta
from capturepass.ir.meta import (
    MAIN_LANE,
    Capability,
    Effect,
    EventId,
    GraphInfo,
    LaneId,
    LeaseId,
    NodeInfo,
    OwnerId,
    ResourceBinding,
    SegmentId,
)


@pytest.fixture
def gm() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    c = g.get_attr("c")
    y = g.call_function(torch.ops.aten.add.Tensor, (x, c))
    g.output(y)
    root = torch.nn.Module()
    root.c = torch.ones(2)
    return fx.GraphModule(root, g)


def _nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.op: n for n in gm.graph.nodes}


def test_nodes_without_a_record_read_as_defaults(gm):
    nodes = _nodes(gm)
    assert not any(meta.has_info(n) for n in gm.graph.nodes)
    assert meta.info(nodes["call_function"]) == NodeInfo()
    assert {op: meta.effect_of(n) for op, n in nodes.items()} == {
        "placeholder": Effect.INPUT,
        "get_attr": Effect.CONSTANT,
        "call_function": Effect.COMPUTE,
        "output": Effect.OUTPUT,
    }
    assert all(meta.lane_of(n) == MAIN_LANE for n in gm.graph.nodes)


def test_the_record_effect_wins_over_the_op(gm):
    add = _nodes(gm)["call_function"]
    meta.create(add, "insert_syncs", effect=Effect.WAIT, lane=LaneId(1), event=EventId(0))
    assert meta.effect_of(add) is Effect.WAIT
    assert meta.lane_of(add) == LaneId(1)


def test_update_records_which_passes_changed_a_node(gm):
    add = _nodes(gm)["call_function"]
    meta.update(add, "assign_streams", lane=LaneId(1))
    meta.update(add, "assign_streams", hint="aux")  # the same pass again: noted once
    meta.update(add, "partition", segment=SegmentId(0))
    meta.update(add, "", owner=OwnerId(3))  # anonymous changes leave no trace
    rec = meta.info(add)
    assert (rec.lane, rec.hint, rec.segment, rec.owner) == (LaneId(1), "aux", SegmentId(0), OwnerId(3))
    assert rec.created_by is None
    assert rec.changed_by == ("assign_streams", "partition")
    meta.update(add, "assign_streams", lane=MAIN_LANE)  # a pass that ran before, again later
    assert meta.info(add).changed_by == ("assign_streams", "partition", "assign_streams")


def test_the_creator_is_not_listed_as_a_changer(gm):
    add = _nodes(gm)["call_function"]
    meta.create(add, "insert_syncs", effect=Effect.RECORD, event=EventId(2))
    meta.update(add, "insert_syncs", why="fork k0")
    meta.update(add, "lease_events", lease=LeaseId(OwnerId(0), "fork", 0))
    rec = meta.info(add)
    assert rec.created_by == "insert_syncs"
    assert rec.changed_by == ("lease_events",)
    assert rec.why == "fork k0"


def test_update_replaces_the_record_and_leaves_the_old_one_alone(gm):
    add = _nodes(gm)["call_function"]
    meta.set_info(add, NodeInfo(hint="aux"))
    old = meta.info(add)
    new = meta.update(add, "assign_streams", lane=LaneId(1))
    assert new is meta.info(add) and new is not old
    assert old.lane is None and old.changed_by == ()
    assert new.hint == "aux"


def test_update_refuses_unknown_fields(gm):
    add = _nodes(gm)["call_function"]
    with pytest.raises(TypeError):
        meta.update(add, "test", colour="red")


@pytest.mark.parametrize(
    "record, field",
    [
        (NodeInfo(), "lane"),
        (GraphInfo(), "lanes"),
        (LaneId(1), "index"),
        (EventId(1), "index"),
        (LeaseId(OwnerId(0), "join", 1), "role"),
        (Capability(), "overlap"),
        (ResourceBinding("workspace", OwnerId(0), LaneId(1)), "lane"),
    ],
)
def test_records_are_frozen(record, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, None)


def test_frozen_record_on_a_node_cannot_be_mutated_in_place(gm):
    add = _nodes(gm)["call_function"]
    rec = meta.update(add, "assign_streams", lane=LaneId(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.lane = MAIN_LANE
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.info(add).changed_by = ()
    assert meta.lane_of(add) == LaneId(1)


def test_graph_record(gm):
    assert meta.graph_info(gm) == GraphInfo()  # created on first read
    gi = meta.update_graph(gm, lanes=("main", "aux"), cudagraphs="breakable")
    meta.add_decision(gm, "first")
    meta.add_decision(gm, "second")
    gi2 = meta.graph_info(gm)
    assert gi.decisions == () and gi2.decisions == ("first", "second")
    assert gi2.lane_name(LaneId(1)) == "aux"
    assert gi2.lane_name(LaneId(7)) == "<unknown lane 7>"
    assert gi2.captured and not GraphInfo().captured


def test_strip_removes_every_record(gm):
    for n in gm.graph.nodes:
        meta.update(n, "read_hints", hint=None)
    meta.update_graph(gm, name="forward")
    meta.strip(gm)
    assert not any(meta.has_info(n) for n in gm.graph.nodes)
    assert meta.META_KEY not in gm.meta


def test_ids_print_short():
    owner = OwnerId(3)
    assert [str(LaneId(1)), str(EventId(2)), str(owner), str(SegmentId(4)), str(LeaseId(owner, "fork", 5))] == [
        "s1",
        "e2",
        "g3",
        "k4",
        "l5",
    ]
    assert str(ResourceBinding("workspace", owner, LaneId(1))) == "workspace@g3/s1"
    assert LaneId(0) == MAIN_LANE and LaneId(0) < LaneId(1)


def test_shared_records_share_alike_changes_only_inside_the_block():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,))
    b = g.call_function(torch.ops.aten.relu.default, (x,))
    c = g.call_function(torch.ops.aten.relu.default, (x,))
    g.output((a, b, c))
    lane = meta.LaneId(1)
    with meta.shared_records():
        ra = meta.update(a, "p", lane=lane)
        rb = meta.update(b, "p", lane=lane)
        rc = meta.update(c, "p", lane=meta.LaneId(2))  # another value: its own record
    assert ra is rb and rc is not ra
    assert meta.lane_of(a) == meta.lane_of(b) == lane and meta.lane_of(c) == meta.LaneId(2)
    assert ra.changed_by == ("p",)
    # Outside the block every update makes its own record; sharing is invisible to readers.
    ra2 = meta.update(a, "q", lane=lane)
    rb2 = meta.update(b, "q", lane=lane)
    assert ra2 is not rb2 and ra2 == rb2
