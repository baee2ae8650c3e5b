"""insert_syncs: the minimal record/wait pairs, forks, joins and deferred releases.

Walks the program order keeping a vector clock per lane: ``clock[B][A]`` is the
last node of lane ``A`` that lane ``B`` is known to run after. A node on lane
``B`` that reads a value produced on lane ``A`` needs ``clock[B][A]`` to cover
the producer; when it does not, the pass records an event on ``A`` right after
the producer (reusing a record already there) and makes ``B`` wait for it. A
wait teaches ``B`` everything ``A`` knew at the record, so a dependency that is
implied by earlier edges gets no wait: the inserted set is the transitive
reduction of the cross-lane edges. When several waits are needed at once, the
one whose record implies the most others goes first.

Segment structure (breaks come from ``assign_streams``):

- fork: an auxiliary lane's first node in a segment waits for the main lane at
  the segment's start (inside a capture this is what pulls the lane into the
  capture; outside, it orders the lane after the caller's work on inputs);
- join: the main lane waits for every auxiliary lane's last node before the
  segment ends (a capture must end joined);
- a serialized op (capability ``overlap="serialize"``) is a barrier: it waits
  for every lane, and later auxiliary work waits for it; an op of
  ``overlap="join"`` waits for every lane but is no barrier for later work.
- external streams (``GraphInfo.external``): a ``capturepass.join_external``
  into the main lane where each segment starts (before its fork), for streams
  the graph reads from, and out of it where each segment ends (after its
  joins), for streams that read the graph's results.

Deferred release: the caching allocator hands a freed block to the next
allocation on the lane that allocated it, without knowing that another lane may
still read it. Host code frees a tensor after its last use in program order, so
for every storage allocated on lane ``A`` and read on another lane ``B``, the
free must come where ``A`` already runs after that read (``clock[A][B]``), or
after ``A``'s last node in the segment (the next fork orders ``A`` after the
join). Where the default free is too early, a ``capturepass.release`` on ``A``
keeps the storage alive until the first point that is safe.

Before::

    %mm   = aten.mm(%x, %w)      {lane=s1}
    %add  = aten.add(%mm, %y)    {lane=s0}

After::

    %record = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, why=fork k0}
    %wait   = capturepass.wait(0, 1)    {lane=s1, wait=e0, role=fork, why=fork k0}
    %mm     = aten.mm(%x, %w)           {lane=s1}
    %record_1 = capturepass.record(1, 1) {lane=s1, record=e1, role=join, why=%mm->%add}
    %wait_1 = capturepass.wait(1, 0)    {lane=s0, wait=e1, role=join, why=%mm->%add}
    %add    = aten.add(%mm, %y)         {lane=s0}
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from capturepass.ir import analysis, effects, meta, ops
from capturepass.ir.meta import MAIN_LANE, Effect, EventId, EventRole, LaneId, Overlap
from capturepass.passes.base import LANES, SYNCED, Pass, PassContext

Clock = tuple[int, ...]


@dataclasses.dataclass
class _Point:
    """A point on one lane that can be recorded: after node ``anchor`` (or before ``before``)."""

    lane: LaneId
    seq: int
    clock: Clock
    after: fx.Node | None = None
    before: fx.Node | None = None
    label: str = ""


class _Walker:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, by: str) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.ctx = ctx
        self.by = by
        self.nlanes = len(meta.graph_info(gm).lanes)
        self.lanes = [LaneId(i) for i in range(self.nlanes)]
        self.clock: list[list[int]] = [[0] * self.nlanes for _ in range(self.nlanes)]
        self.count = [0] * self.nlanes
        # The points of each lane, indexed by seq - 1: the lane's clock there and the node it
        # follows (None for a virtual point, whose node to precede and label are in _virtual).
        # A _Point is only built for a point that is recorded.
        self._clocks: list[list[Clock]] = [[] for _ in range(self.nlanes)]
        self._after: list[list[fx.Node | None]] = [[] for _ in range(self.nlanes)]
        self._virtual: dict[tuple[int, int], tuple[fx.Node, str]] = {}
        self.pos: dict[fx.Node, tuple[int, int]] = {}
        self.records: dict[tuple[int, int], EventId] = {}
        self.next_event = 0

    # -- clocks ---------------------------------------------------------------------------
    def issue(self, lane: LaneId, node: fx.Node | None, before: fx.Node | None = None, label: str = "") -> int:
        """Advances ``lane`` by one node (a real node, or a virtual point before ``before``); returns its seq."""
        li = lane.index
        seq = self.count[li] = self.count[li] + 1
        clock = self.clock[li]
        clock[li] = seq
        self._clocks[li].append(tuple(clock))
        self._after[li].append(node)
        if node is not None:
            self.pos[node] = (li, seq)
        else:
            assert before is not None
            self._virtual[(li, seq)] = (before, label)
        return seq

    def point(self, li: int, seq: int) -> _Point:
        """Point ``seq`` of lane number ``li``."""
        before, label = self._virtual.get((li, seq), (None, ""))
        return _Point(self.lanes[li], seq, self._clocks[li][seq - 1], self._after[li][seq - 1], before, label)

    def knows(self, lane: LaneId, other: int, seq: int) -> bool:
        return self.clock[lane.index][other] >= seq

    # -- sync insertion ---------------------------------------------------------------------
    def _record(self, point: _Point, why: str) -> EventId:
        key = (point.lane.index, point.seq)
        event = self.records.get(key)
        if event is not None:
            return event
        event = EventId(self.next_event)
        self.next_event += 1
        role = EventRole.FORK if point.lane == MAIN_LANE else EventRole.JOIN
        if point.after is not None:
            anchor = point.after
            ops.insert_record(self.graph, anchor, point.lane, event, role, self.by, why)
        else:
            assert point.before is not None
            with self.graph.inserting_before(point.before):
                node = self.graph.call_function(ops.record, (event.index, point.lane.index))
            meta.create(node, self.by, effect=Effect.RECORD, lane=point.lane, event=event, role=role, why=why)
        self.records[key] = event
        self.ctx.count(self.by, "records")
        return event

    def require(self, lane: LaneId, need: dict[int, tuple[int, str]], before: fx.Node) -> None:
        """Makes ``lane`` run after ``need[A] = (seq, why)`` on each lane ``A``, before ``before``."""
        if not need:
            return
        li = lane.index
        reqs = [(a, s, why) for a, (s, why) in need.items() if a != li and self.clock[li][a] < s]
        while reqs:
            def implied(r: tuple[int, int, str]) -> int:
                c = self._clocks[r[0]][r[1] - 1]
                return sum(1 for o in reqs if c[o[0]] >= o[1])

            a, s, why = max(reqs, key=lambda r: (implied(r), r[1], -r[0])) if len(reqs) > 1 else reqs[0]
            point = self.point(a, s)
            event = self._record(point, why)
            role = EventRole.FORK if a == MAIN_LANE.index else EventRole.JOIN
            ops.insert_wait(self.graph, before, lane, event, role, self.by, why)
            self.ctx.count(self.by, "waits")
            mine = self.clock[li]
            for i, v in enumerate(point.clock):
                if v > mine[i]:
                    mine[i] = v
            reqs = [r for r in reqs if self.clock[li][r[0]] < r[1]]


def _need(acc: dict[int, tuple[int, str]], lane: int, seq: int, why: str) -> None:
    if seq > acc.get(lane, (0, ""))[0]:
        acc[lane] = (seq, why)


class InsertSyncs(Pass):
    """Inserts the minimal cross-lane record/wait pairs, forks, joins and releases."""

    name = "insert_syncs"
    requires = (LANES,)
    ensures = (SYNCED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        graph = gm.graph
        w = _Walker(gm, ctx, self.name)
        nodes = list(graph.nodes)
        releases = _ReleasePlan(nodes, graph)
        # Accesses of one storage (and random draws) keep their program order across lanes.
        self._order = effects.order_deps(nodes)

        seg_index = 0
        seg_start: _Point | None = None  # the fork point of the open segment
        forked: set[int] = set()
        barrier: tuple[int, str] | None = None  # main-lane seq every aux lane must follow

        external = meta.graph_info(gm).external

        def open_segment(first: fx.Node) -> None:
            nonlocal seg_start, forked, barrier
            for x, (name, relation) in enumerate(external):
                if relation in ("before", "both"):
                    ops.insert_join_external(graph, first, x, name, True, self.name, f"start of k{seg_index}")
                    ctx.count(self.name, "external_joins")
            seg_start = w.point(0, w.issue(MAIN_LANE, None, before=first, label=f"fork k{seg_index}"))
            forked = set()
            barrier = None

        def close_segment(anchor: fx.Node) -> None:
            nonlocal seg_start, seg_index
            if seg_start is None:
                return
            need: dict[int, tuple[int, str]] = {}
            for lane in range(1, w.nlanes):
                if lane in forked and w.count[lane] > w.clock[0][lane]:
                    _need(need, lane, w.count[lane], f"join k{seg_index}")
            w.require(MAIN_LANE, need, anchor)
            for x, (name, relation) in enumerate(external):
                if relation in ("after", "both"):
                    ops.insert_join_external(graph, anchor, x, name, False, self.name, f"end of k{seg_index}")
                    ctx.count(self.name, "external_joins")
            seg_start = None
            seg_index += 1

        for i, node in enumerate(nodes):
            rec = meta.record_of(node)
            eff = rec.effect
            if eff is Effect.INPUT or eff is Effect.CONSTANT:
                w.issue(MAIN_LANE, node)
                continue
            if eff is Effect.OUTPUT:
                close_segment(node)
                self._deps(w, node, MAIN_LANE)
                continue
            if eff is not Effect.COMPUTE:
                continue
            lane = MAIN_LANE if rec.lane is None else rec.lane
            if rec.brk is not None:
                close_segment(node)
                self._deps(w, node, lane)
                w.issue(lane, node)
                continue
            if seg_start is None:
                open_segment(node)
            need = self._need_of(w, node, lane)
            if lane != MAIN_LANE:
                if lane.index not in forked:
                    forked.add(lane.index)
                    _need(need, 0, seg_start.seq, seg_start.label)
                if barrier is not None:
                    _need(need, 0, barrier[0], barrier[1])
            serialize = rec.capability is not None and rec.capability.overlap != Overlap.SAFE
            if serialize:
                for other in range(1, w.nlanes):
                    if w.count[other] > w.clock[lane.index][other]:
                        _need(need, other, w.count[other], f"{rec.capability.overlap} %{node.name}")
            w.require(lane, need, node)
            w.issue(lane, node)
            if serialize and rec.capability.overlap == Overlap.SERIALIZE:
                # "join" stops here: lanes may run beside the launch once it has started.
                barrier = (w.count[0], f"serialize %{node.name}")
            releases.after(w, node, i, self.name)

    def _need_of(self, w: _Walker, node: fx.Node, lane: LaneId) -> dict[int, tuple[int, str]]:
        need: dict[int, tuple[int, str]] = {}
        li = lane.index
        pos = w.pos
        known = w.clock[li]
        for p in node.all_input_nodes:
            where = pos.get(p)
            if where is None:
                continue
            a, s = where
            # Reads the lane already runs after need nothing (require would drop them), and a
            # host scalar needs no event.
            if a != li and known[a] < s and analysis.carries_tensor(p):
                _need(need, a, s, f"%{p.name}->%{node.name}")
        for dep in self._order.get(node, ()):
            # NOTE: an effect orders the earlier node's execution, whatever it produced (a host
            # scalar read from the storage too): no carries_tensor filter here.
            where = pos.get(dep.earlier)
            if where is None:
                continue
            a, s = where
            if a != li and known[a] < s:
                _need(need, a, s, dep.why(node))
        return need

    def _deps(self, w: _Walker, node: fx.Node, lane: LaneId) -> None:
        w.require(lane, self._need_of(w, node, lane), node)


def _first(entry: tuple[int, fx.Node]) -> int:
    return entry[0]


class _ReleasePlan:
    """Finds tensors whose default free would race, and defers them.

    A storage root allocated on lane ``A`` is freed by host code right after its
    last use (over all its views) in program order. That is safe when ``A``
    already runs after every read on other lanes, or when ``A`` issues nothing
    more in the segment.
    """

    def __init__(self, nodes: list[fx.Node], graph: fx.Graph) -> None:
        records = [meta.record_of(n) for n in nodes]
        self.layout = analysis.LaneLayout(nodes, records)
        outputs = analysis.output_roots(graph)
        self._due: dict[int, list[fx.Node]] = {}
        # One walk in program order: the storage root of each node, the program index of the
        # last node that holds each root (uses it or a view of it), and the roots that a
        # compute node reads on a lane other than the root's own.
        root_of: dict[fx.Node, fx.Node] = {}
        root_lane: dict[fx.Node, int] = {}  # root -> the number of its lane
        last_holder: dict[fx.Node, int] = {}
        cross_read: set[fx.Node] = set()
        for i, (node, rec) in enumerate(zip(nodes, records)):
            src = analysis.alias_source(node)
            li = 0 if rec.lane is None else rec.lane.index
            if src is None:
                root_of[node] = node
                root_lane[node] = li
            else:
                root_of[node] = root_of.get(src) or analysis.storage_root(src)
            compute = rec.effect is Effect.COMPUTE
            for p in node.all_input_nodes:
                root = root_of.get(p) or analysis.storage_root(p)
                last_holder[root] = i
                if compute:
                    a = root_lane.get(root)
                    if a is None:
                        a = root_lane[root] = meta.lane_of(root).index
                    if a != li:
                        cross_read.add(root)
        # root -> (allocating lane, its reads on other lanes with their lanes): computed once,
        # since this pass never changes lanes or the compute users of a node.
        self._cross: dict[fx.Node, tuple[int, list[tuple[fx.Node, int]]]] = {}
        for node, rec in zip(nodes, records):
            if node not in cross_read or rec.effect is not Effect.COMPUTE or root_of[node] is not node:
                continue
            if not analysis.is_tensor_node(node) or node in outputs:
                continue
            alloc = meta.lane_of(node)
            self._due.setdefault(last_holder[node], []).append(node)
            cross = [(u, meta.lane_of(u).index) for u in analysis.reads_of(node) if meta.lane_of(u) != alloc]
            self._cross[node] = (alloc.index, cross)
        # Deferred roots, tagged with the order in which they were deferred, kept by
        # (allocating lane A, lane B of the first read of the root that A does not yet run
        # after). Every root under (A, B) was last found unsafe when A's clock entry for B
        # was _checked[(A, B)]; while that entry is unchanged and A still issues work in the
        # segment, the root stays unsafe (a read issued since then on B is later than
        # anything A knows of B), so it is not looked at again.
        self._waiting: dict[tuple[int, int], list[tuple[int, fx.Node]]] = {}
        self._checked: dict[tuple[int, int], int] = {}
        self._deferred = 0
        self._ends_segment = -1
        self._ends: dict[int, int] = {}

    def _blocker(self, w: _Walker, root: fx.Node) -> int | None:
        """The lane of the first read of ``root`` its allocating lane does not yet run after, if any."""
        alloc, cross = self._cross[root]
        clock = w.clock[alloc]
        for u, li in cross:
            where = w.pos.get(u)
            if where is None or clock[li] < where[1]:
                return li
        return None

    def _defer(self, w: _Walker, entry: tuple[int, fx.Node], blocker: int) -> None:
        key = (self._cross[entry[1]][0], blocker)
        self._waiting.setdefault(key, []).append(entry)
        self._checked[key] = w.clock[key[0]][blocker]

    def after(self, w: _Walker, node: fx.Node, now: int, by: str) -> None:
        """Called after ``node`` (at program index ``now``) was issued: defers releases that became
        due, places safe ones."""
        safe: list[tuple[int, fx.Node]] = []
        moved: list[tuple[tuple[int, fx.Node], int]] = []
        ends: dict[int, int] | None = None  # lane number -> its last program index in this segment
        waiting = self._waiting
        checked = self._checked
        clock = w.clock
        for key, group in waiting.items():
            if not group:
                continue
            alloc, lane = key
            if ends is None:
                ends = self._lane_ends(now)
            end = ends.get(alloc)
            if end is None:
                end = ends[alloc] = self.layout.last_index(self._ends_segment, alloc)
            if end <= now:  # alloc issues nothing more in the segment
                safe.extend(group)
                waiting[key] = []
            elif clock[alloc][lane] != checked[key]:
                still = []
                for entry in group:
                    blocker = self._blocker(w, entry[1])
                    if blocker is None:
                        safe.append(entry)
                    elif blocker == lane:
                        still.append(entry)
                    else:
                        moved.append((entry, blocker))
                waiting[key] = still
                checked[key] = clock[alloc][lane]
        for entry, blocker in moved:
            self._defer(w, entry, blocker)
        due = self._due.pop(now, None)
        if due is not None:
            if ends is None:
                ends = self._lane_ends(now)
            for root in due:
                alloc = self._cross[root][0]
                end = ends.get(alloc)
                if end is None:
                    end = ends[alloc] = self.layout.last_index(self._ends_segment, alloc)
                if end > now:  # alloc issues more after now
                    blocker = self._blocker(w, root)
                    if blocker is not None:
                        self._defer(w, (self._deferred, root), blocker)
                        self._deferred += 1
        if len(safe) > 1:
            safe.sort(key=_first)  # in the order they were deferred
        for _, root in safe:
            self._place(w, root, node, by)

    def _lane_ends(self, now: int) -> dict[int, int]:
        """The last program index of each lane (filled in as asked) in the segment of ``now``."""
        segment = self.layout.segment_at(now)
        if segment != self._ends_segment:
            self._ends_segment = segment
            self._ends = {}
        return self._ends

    def _place(self, w: _Walker, root: fx.Node, node: fx.Node, by: str) -> None:
        lane = meta.lane_of(root)
        readers = ",".join(sorted({f"%{u.name}" for u, _ in self._cross[root][1]}))
        ops.insert_release(w.graph, node.next, [root], lane, by, f"read by {readers}")
        w.ctx.count(by, "releases")
