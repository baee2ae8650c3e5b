"""insert_syncs inserts the minimal set of waits, on hand-built graphs whose minimum is known.

Every graph here is traced with explicit lane hints (policy ``hints``), so the
lanes are fixed and the minimum can be counted by hand. The counts include the
segment's fork (an auxiliary lane's first node waits for the main lane) and join
(the main lane waits for every auxiliary lane before the segment ends); a fork
or join coincides with a data wait whenever one record covers both. Minimality
is checked from both sides: the counters equal the hand count, and dropping any
single inserted wait makes the verifier fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.fx as fx

import capturepass
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.ir.verify import verify
from tests.helpers import aten_graph, run_passes, sync_nodes, unneeded_waits

N = 4


def _on(lane: str | None, op: Callable, *args: torch.Tensor) -> torch.Tensor:
    if lane is None:
        return op(*args)
    with capturepass.lane(lane):
        return op(*args)


def _synced(fn: Callable, *inputs: torch.Tensor) -> tuple[fx.GraphModule, dict]:
    gm = aten_graph(fn, *(inputs or (torch.randn(N, N),)))
    ctx = run_passes(gm, upto="insert_syncs", policy="hints", max_aux_lanes=3)
    verify(gm)
    return gm, ctx.counters.get("insert_syncs", {})


def _lane_indices(gm: fx.GraphModule, effect: Effect) -> list[int]:
    return [meta.lane_of(n).index for n in sync_nodes(gm, effect)]


# -- the hand-built graphs ----------------------------------------------------------------------


def _chain(lanes: Sequence[str | None]) -> Callable:
    """x -> op -> op -> ... with op i on ``lanes[i]`` (``None``: the main lane)."""

    def fn(x):
        v = x
        for i, lane in enumerate(lanes):
            v = _on(lane, torch.sin if i % 2 == 0 else torch.cos, v)
        return v

    return fn


def _crossings(lanes: Sequence[str | None]) -> int:
    return sum(1 for a, b in zip(lanes, lanes[1:]) if a != b)


def _diamond(x):
    # a -> b on lane 1, b -> c on lane 2, and a -> c directly: the a -> c edge is implied.
    a = x.sin()
    b = _on("one", torch.relu, a)
    return _on("two", torch.add, a, b)


def _fan_out(x):
    # One main producer, three consumers on one other lane.
    p = x.sin()
    c1 = _on("one", torch.relu, p)
    c2 = _on("one", torch.cos, p)
    c3 = _on("one", torch.exp, p)
    return c1, c2, c3


def _two_lanes_read_one_value(x):
    p = x.sin()
    q = _on("one", torch.relu, p)
    r = _on("two", torch.cos, p)
    return q + r


def _implied_join(x):
    # p on lane 1, q on lane 2 reads p, main reads both: q's record implies p, and the
    # join of both lanes is implied by that same wait.
    p = _on("one", torch.sin, x)
    q = _on("two", torch.cos, p)
    return p + q


def _independent_aux_work(x):
    # Lane 1 reads only the input: its fork wait is all it needs.
    p = _on("one", torch.sin, x)
    q = x.cos()
    return p * q


# name -> (function, records, waits), counted by hand.
HAND_BUILT: dict[str, tuple[Callable, int, int]] = {
    # main->one (1, also one's fork); one->two (1, also two's fork, and it implies %sin->%add);
    # join two->main (1, which implies one's join).
    "diamond": (_diamond, 3, 3),
    # main->one (1, also the fork); join one->main (1).
    "fan-out": (_fan_out, 2, 2),
    # one record after %sin waited by both lanes (2 waits); two joins (2 records, 2 waits).
    "two-lanes-read-one": (_two_lanes_read_one_value, 3, 4),
    # fork(one) (1); one->two (1); two->main (1) implies one->main and both joins.
    "implied-join": (_implied_join, 3, 3),
    # fork(one) (1); join one->main before %mul (1).
    "independent-aux": (_independent_aux_work, 2, 2),
}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_chain_between_two_aux_lanes(k):
    """An aux-to-aux chain with k crossings: the fork of its first lane, one wait per crossing,
    and one join (the last lane's record implies the other lane)."""
    lanes = ["one" if i % 2 == 0 else "two" for i in range(k + 1)]
    assert _crossings(lanes) == k
    gm, counters = _synced(_chain(lanes))
    assert counters["waits"] == k + 2
    assert counters["records"] == k + 2
    assert _lane_indices(gm, Effect.WAIT).count(0) == 1  # the one join


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_chain_between_main_and_aux(k):
    """A chain starting on main and crossing k times to and from one aux lane.

    The first crossing's record (after a main node) also serves as the fork; when the
    chain ends on main, the last crossing also serves as the join; ending on the aux
    lane costs one join wait more.
    """
    lanes = [None if i % 2 == 0 else "one" for i in range(k + 1)]
    assert _crossings(lanes) == k
    ends_on_aux = lanes[-1] is not None
    gm, counters = _synced(_chain(lanes))
    assert counters["waits"] == k + ends_on_aux
    assert counters["records"] == k + ends_on_aux


def test_diamond_edge_implied_by_path_gets_no_wait():
    gm, counters = _synced(_diamond)
    assert (counters["records"], counters["waits"]) == (3, 3)
    # Lane two waits exactly once: for %relu's record, which already orders it after %sin.
    waits_two = [n for n in sync_nodes(gm, Effect.WAIT) if meta.lane_of(n).index == 2]
    assert len(waits_two) == 1
    (record,) = [
        n for n in sync_nodes(gm, Effect.RECORD) if meta.info(n).event == meta.info(waits_two[0]).event
    ]
    assert meta.lane_of(record).index == 1
    assert record.prev.name == "relu"


def test_fan_out_to_one_lane_waits_once():
    gm, counters = _synced(_fan_out)
    assert (counters["records"], counters["waits"]) == (2, 2)
    assert _lane_indices(gm, Effect.WAIT) == [1, 0]  # once on lane one, once for the join


def test_two_lanes_reading_one_value_share_one_record():
    gm, counters = _synced(_two_lanes_read_one_value)
    assert (counters["records"], counters["waits"]) == (3, 4)
    assert _lane_indices(gm, Effect.RECORD).count(0) == 1
    main_record = next(n for n in sync_nodes(gm, Effect.RECORD) if meta.lane_of(n).index == 0)
    event = meta.info(main_record).event
    readers = [n for n in sync_nodes(gm, Effect.WAIT) if meta.info(n).event == event]
    assert sorted(meta.lane_of(n).index for n in readers) == [1, 2]


def test_implied_join_needs_one_wait_on_main():
    gm, counters = _synced(_implied_join)
    assert (counters["records"], counters["waits"]) == (3, 3)
    assert _lane_indices(gm, Effect.WAIT).count(0) == 1


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_hand_built_counts(name):
    fn, records, waits = HAND_BUILT[name]
    _, counters = _synced(fn)
    assert (counters["records"], counters["waits"]) == (records, waits)


def test_single_lane_needs_no_syncs():
    gm, counters = _synced(_chain([None, None, None]))
    assert counters.get("waits", 0) == 0 and counters.get("records", 0) == 0
    assert sync_nodes(gm, Effect.WAIT) == [] and sync_nodes(gm, Effect.RECORD) == []


def test_one_aux_lane_all_the_way():
    # fork (1) and join (1): nothing in between.
    _, counters = _synced(_chain(["one"] * 4))
    assert (counters["records"], counters["waits"]) == (2, 2)


# -- minimality from the other side: every inserted wait is needed ------------------------------

ALL_HAND_BUILT: dict[str, Callable] = {
    **{name: fn for name, (fn, _, _) in HAND_BUILT.items()},
    **{f"chain-aux-{k}": _chain(["one" if i % 2 == 0 else "two" for i in range(k + 1)]) for k in (1, 3, 4)},
    **{f"chain-main-{k}": _chain([None if i % 2 == 0 else "one" for i in range(k + 1)]) for k in (1, 2, 5)},
    "chain-three-lanes": _chain(["one", "two", None, "three", "one", None, "two"]),
}


@pytest.mark.parametrize("name", sorted(ALL_HAND_BUILT))
def test_every_wait_is_needed(name):
    gm, counters = _synced(ALL_HAND_BUILT[name])
    assert counters["waits"] == len(sync_nodes(gm, Effect.WAIT)) > 0
    assert unneeded_waits(gm) == []


def test_the_removal_check_can_see_a_redundant_wait():
    """The check above is only meaningful if a surplus wait passes the verifier."""
    gm, _ = _synced(_diamond)
    first = sync_nodes(gm, Effect.WAIT)[0]
    rec = meta.info(first)
    # A second copy of the first wait: ordered, but redundant.
    with gm.graph.inserting_after(first):
        dup = gm.graph.call_function(first.target, first.args)
    meta.create(dup, "test", effect=Effect.WAIT, lane=rec.lane, event=rec.event, role=rec.role)
    verify(gm)
    # Either copy may go, as long as the other stays.
    assert sorted(unneeded_waits(gm)) == sorted([first.name, dup.name])
