"""The verifier: a standalone check of every synchronisation invariant.

It recomputes happens-before from the sync nodes actually present (not from
what ``insert_syncs`` meant to do), with one vector clock per lane, and checks
the rules whose IR property has been established:

=====================  ==========  ==========================================================
rule                   needs       what must hold
=====================  ==========  ==========================================================
graph                  --          FX lint: every use is dominated by its definition
lane                   lanes       every compute node has a known lane; breaks on main
unordered-read         synced      a cross-lane read runs after its producer (happens-before)
storage-order          synced      accesses of one storage keep program order across lanes: a
                                   write after every earlier read and write of the storage (through
                                   any view), a read after the last earlier write; random ops draw
                                   from the generator's hidden state in program order
wait-before-record     synced      every wait follows a record of its event, on another lane
unforked-lane          synced      an auxiliary lane's first node in a segment runs after the fork
unjoined-lane          synced      every lane has joined the main lane when a segment ends
serialize              synced      nothing runs beside a serialized op; a joined op
                                   (overlap="join") starts with every lane joined
unordered-free         synced      storage is freed only where its allocating lane runs after
                                   every read on other lanes (or issues nothing more)
external-join          synced      each declared external stream joins into s0 before a segment's
                                   first node and out of s0 after its last, every lane joined
lease-owner            leased      every event has one lease, of the graph's owner, of its role
lease-overlap          leased      two events that are live at once never share a lease
unretained-owner       retained    a captured segment retains every static input, constant
                                   and resource it uses
segment                partitioned every node but inputs, output and breaks is in a segment
=====================  ==========  ==========================================================

Errors are :class:`~capturepass.errors.VerificationError`, name the node, the
lanes and the event, say which pass created the node, and show about ten lines
of the dump around it. Events, leases and owners carry the dump's canonical ids
(numbered in print order over the whole graph), in the message and the window
alike, so that both read against ``capturepass show`` and the dump files.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from capturepass.errors import VerificationError
from capturepass.ir import analysis, effects, meta, printer
from capturepass.ir.meta import MAIN_LANE, Effect, EventId, EventRole, LaneId, Overlap, Property

CONTEXT_LINES = 5


def _provenance(node: fx.Node) -> str:
    rec = meta.info(node)
    parts = []
    if rec.created_by:
        parts.append(f"created by {rec.created_by}")
    if rec.changed_by:
        parts.append(f"changed by {', '.join(rec.changed_by)}")
    return f" ({'; '.join(parts)})" if parts else ""


def print_ids(gm: fx.GraphModule) -> printer._Canon:
    """The canonical ids the dump of ``gm`` uses (events, leases, owners, segments)."""
    gi = meta.graph_info(gm)
    canon = printer._Canon()
    canon("g", gi.owner)
    settings = printer.PrintSettings(shapes=False)
    for node in gm.graph.nodes:
        printer.node_attrs(node, gi, canon, settings)
    return canon


def _context(gm: fx.GraphModule, node: fx.Node) -> str:
    nodes = list(gm.graph.nodes)
    try:
        i = nodes.index(node)
    except ValueError:
        return ""
    gi = meta.graph_info(gm)
    # NOTE: ids numbered from the window's first line would differ from the message's and
    # the dump's; number them over the whole graph first.
    canon = print_ids(gm)
    settings = printer.PrintSettings(shapes=False)
    lo, hi = max(0, i - CONTEXT_LINES), min(len(nodes), i + CONTEXT_LINES)
    lines = []
    for j in range(lo, hi):
        mark = ">> " if j == i else "   "
        lines.append(mark + printer.format_node(nodes[j], gi, canon, settings))
    return "\n".join(lines)


def fail(gm: fx.GraphModule, rule: str, node: fx.Node, message: str) -> VerificationError:
    """Builds the error for ``rule`` at ``node`` with provenance and context."""
    text = f"[{rule}] %{node.name}{_provenance(node)}: {message}\n{_context(gm, node)}"
    return VerificationError(rule, node.name, text)


class _Checker:
    def __init__(self, gm: fx.GraphModule, properties: frozenset[str]) -> None:
        self.gm = gm
        self.props = properties
        self.gi = meta.graph_info(gm)
        self.nlanes = len(self.gi.lanes)
        self.clock = [[0] * self.nlanes for _ in range(self.nlanes)]
        self.count = [0] * self.nlanes
        self.seq: dict[fx.Node, tuple[int, int]] = {}
        self.events: dict[EventId, tuple[tuple[int, ...], LaneId, fx.Node]] = {}
        self._ids: printer._Canon | None = None
        self.nodes = list(gm.graph.nodes)
        # Every rule reads each node's record: look it up once (with the effect derived for
        # a node that has none, as meta.effect_of does).
        self.recs = [meta.record_of(n) for n in self.nodes]
        # Filled by _free_points: the storage root of each node; of each root, the program index
        # of its last compute read and its compute reads issued on another lane than its own;
        # the roots freed after a node beyond the first.
        self.root_of: dict[fx.Node, fx.Node] = {}
        self.last_read: dict[fx.Node, int] = {}
        self.cross_reads: dict[fx.Node, list[fx.Node]] = {}
        self.frees_more: dict[fx.Node, list[fx.Node]] = {}
        # The storage model (storage-order): for each storage some node writes, its last write
        # and, per lane, the last read since that write, as (seq, node).
        self.written: set = set()
        self.last_write: dict[object, tuple[int, int, fx.Node]] = {}
        self.reads_since: dict[object, dict[int, tuple[int, fx.Node]]] = {}

    def id(self, kind: str, key: object) -> str:
        """The canonical (dump) name of an event (``e``), lease (``l``) or owner (``g``), for messages."""
        if self._ids is None:
            self._ids = print_ids(self.gm)
        return self._ids(kind, key)

    def lane(self, node: fx.Node, rec: meta.NodeInfo | None = None) -> LaneId:
        lane = (meta.info(node) if rec is None else rec).lane
        if lane is None:
            lane = MAIN_LANE
        if not 0 <= lane.index < self.nlanes:
            raise fail(self.gm, "lane", node, f"is on {lane}, but the graph has lanes s0..s{self.nlanes - 1}")
        return lane

    def issue(self, lane: LaneId, node: fx.Node | None) -> None:
        li = lane.index
        n = self.count[li] = self.count[li] + 1
        self.clock[li][li] = n
        if node is not None:
            self.seq[node] = (li, n)

    def run(self) -> None:
        props = self.props
        synced = Property.SYNCED in props
        lanes = Property.LANES in props
        nodes = self.nodes
        self.layout = analysis.LaneLayout(nodes, self.recs)
        order = self.layout.order
        frees = self._free_points() if synced else {}
        if synced:
            self.written = effects.written_roots(nodes)
        segment_open = False
        seg_start = 0
        forked: set[int] = set()
        in_segment: set[int] = set()
        barrier: tuple[int, fx.Node] | None = None
        clock = self.clock
        count = self.count
        ext = self.gi.external
        ext_in: set[str] = set()
        ext_out: set[str] = set()
        seg_work = False
        for node, rec in zip(nodes, self.recs):
            eff = rec.effect
            if eff is Effect.INPUT or eff is Effect.CONSTANT:
                self.issue(MAIN_LANE, node)
                continue
            is_break = eff is Effect.COMPUTE and rec.brk is not None
            if eff is Effect.OUTPUT or is_break:
                if synced and segment_open:
                    self.check_joined(node, in_segment)
                    if ext:
                        self.check_external_joined(node, ext, ext_in, ext_out, "after")
                segment_open = False
                if is_break:
                    if lanes and self.lane(node, rec) != MAIN_LANE:
                        raise fail(self.gm, "lane", node, f"is a break ({rec.brk}) but is on {rec.lane}, not s0")
                if synced:
                    self.check_reads(node, MAIN_LANE)
                    if self.written:
                        self.check_storage(node, MAIN_LANE)
                if is_break:
                    self.issue(MAIN_LANE, node)
                    if synced:
                        self.note_storage(node, MAIN_LANE)
                        self.check_frees(node, frees, order)
                continue
            if not segment_open:
                segment_open = True
                self.issue(MAIN_LANE, None)  # the fork point of this segment
                seg_start = count[0]
                forked, in_segment, barrier = set(), set(), None
                ext_in, ext_out, seg_work = set(), set(), False
            lane = self.lane(node, rec) if (rec.lane is not None or lanes) else MAIN_LANE
            if eff is Effect.EXTERNAL:
                if synced:
                    self.check_external(node, rec, lane, seg_work, in_segment, ext_in, ext_out)
                continue
            if synced and not seg_work:
                seg_work = True
                if ext:
                    self.check_external_joined(node, ext, ext_in, ext_out, "before")
            if synced and ext_out and eff is Effect.COMPUTE:
                raise fail(
                    self.gm, "external-join", node,
                    f"runs on {lane} after the segment joined s0 out to external stream(s) "
                    f"{', '.join(sorted(ext_out))}: they do not wait for it",
                )
            if eff is Effect.RECORD:
                self.events[rec.event] = (tuple(clock[lane.index]), lane, node)
                continue
            if eff is Effect.WAIT:
                if synced:
                    self.check_wait(node, lane)
                continue
            if eff is Effect.RELEASE:
                if synced:
                    self.check_release(node, lane, order)
                continue
            if eff is not Effect.COMPUTE:
                continue
            cap = rec.capability
            serializes = cap is not None and cap.overlap != Overlap.SAFE
            if synced:
                li = lane.index
                if li != 0 and li not in forked:
                    if clock[li][0] < seg_start:
                        raise fail(
                            self.gm, "unforked-lane", node,
                            f"is the first node of lane {lane} ({self.gi.lane_name(lane)}) in its segment, "
                            f"but {lane} does not wait for the segment's fork on s0",
                        )
                    forked.add(li)
                if li != 0 and barrier is not None and clock[li][0] < barrier[0]:
                    raise fail(
                        self.gm, "serialize", node,
                        f"runs on {lane} beside serialized %{barrier[1].name}: {lane} does not wait for it",
                    )
                self.check_reads(node, lane)
                if self.written:
                    self.check_storage(node, lane)
                if serializes:
                    for other in range(1, self.nlanes):
                        if count[other] > clock[li][other]:
                            raise fail(
                                self.gm, "serialize", node,
                                ("is serialized" if cap.overlap == Overlap.SERIALIZE else "must start with every lane joined")
                                + f" ({cap.reason}) but lane s{other} may still be running work issued before it",
                            )
            self.issue(lane, node)
            in_segment.add(lane.index)
            if synced:
                if self.written:
                    self.note_storage(node, lane)
                if serializes and cap.overlap == Overlap.SERIALIZE:  # JOIN: lanes may resume beside it
                    barrier = (count[0], node)
                self.check_frees(node, frees, order)
        if Property.LEASED in props:
            self.check_leases()
        if Property.RETAINED in props:
            self.check_retention()
        if Property.PARTITIONED in props:
            self.check_segments()

    def run_joins(self) -> None:
        """Only the unjoined-lane rule, on happens-before from the syncs present.

        Walks the clocks as :meth:`run` does, checking no other rule than those the walk
        stands on: lanes exist, and every wait follows a record of its event.
        """
        segment_open = False
        in_segment: set[int] = set()
        for node, rec in zip(self.nodes, self.recs):
            eff = rec.effect
            if eff is Effect.INPUT or eff is Effect.CONSTANT:
                self.issue(MAIN_LANE, node)
                continue
            is_break = eff is Effect.COMPUTE and rec.brk is not None
            if eff is Effect.OUTPUT or is_break:
                if segment_open:
                    self.check_joined(node, in_segment)
                segment_open = False
                if is_break:
                    self.issue(MAIN_LANE, node)
                continue
            if not segment_open:
                segment_open = True
                self.issue(MAIN_LANE, None)
                in_segment = set()
            lane = self.lane(node, rec)
            if eff is Effect.RECORD:
                self.events[rec.event] = (tuple(self.clock[lane.index]), lane, node)
            elif eff is Effect.WAIT:
                self.check_wait(node, lane)
            elif eff is Effect.COMPUTE:
                self.issue(lane, node)
                in_segment.add(lane.index)

    # -- rules ----------------------------------------------------------------------------
    def check_reads(self, node: fx.Node, lane: LaneId) -> None:
        li = lane.index
        clock = self.clock[li]
        seq = self.seq
        for p in node.all_input_nodes:
            where = seq.get(p)
            if where is None:
                continue
            a, s = where
            # Same-lane and ordered reads first: host scalars (no tensor) need no order either.
            if a != li and clock[a] < s and analysis.carries_tensor(p):
                raise fail(
                    self.gm, "unordered-read", node,
                    f"on {lane} reads %{p.name} produced on s{a}, but no wait orders it after %{p.name}",
                )

    def check_storage(self, node: fx.Node, lane: LaneId) -> None:
        """The storage-order rule at ``node`` (before it is issued on ``lane``)."""
        acc = effects.accesses(node)
        li = lane.index
        clock = self.clock[li]
        for root in acc.reads:
            if root not in self.written:
                continue
            last = self.last_write.get(root)
            if last is not None and last[0] != li and clock[last[0]] < last[1]:
                raise fail(
                    self.gm, "storage-order", node,
                    f"on {lane} reads {effects.describe(root)}, which %{last[2].name} on s{last[0]} writes "
                    f"earlier in program order, but no wait orders it after %{last[2].name}",
                )
        for root in acc.writes:  # written arguments are read too: the last write is checked above
            for a, (s, reader) in self.reads_since.get(root, {}).items():
                if a != li and clock[a] < s:
                    raise fail(
                        self.gm, "storage-order", node,
                        f"on {lane} writes {effects.describe(root)} while %{reader.name} on s{a}, earlier in "
                        "program order, may still read it: no wait orders the write after the read",
                    )

    def note_storage(self, node: fx.Node, lane: LaneId) -> None:
        """Records ``node``'s accesses (just issued on ``lane``) in the storage model."""
        acc = effects.accesses(node)
        li = lane.index
        seq = self.count[li]
        for root in acc.reads:
            if root in self.written:
                self.reads_since.setdefault(root, {})[li] = (seq, node)
        for root in acc.writes:
            self.last_write[root] = (li, seq, node)
            self.reads_since[root] = {}

    def check_wait(self, node: fx.Node, lane: LaneId) -> None:
        rec = meta.info(node)
        entry = self.events.get(rec.event)
        if entry is None:
            raise fail(
                self.gm, "wait-before-record", node,
                f"on {lane} waits for event {self.id('e', rec.event)}, which no earlier node records",
            )
        clock, rlane, rnode = entry
        if rlane == lane:
            raise fail(
                self.gm, "wait-before-record", node,
                f"on {lane} waits for event {self.id('e', rec.event)} recorded on the same lane by "
                f"%{rnode.name}",
            )
        rrec = meta.info(rnode)
        if rrec.owner != rec.owner:
            raise fail(
                self.gm, "lease-owner", node,
                f"waits for event {self.id('e', rec.event)} recorded by %{rnode.name} of another owner "
                f"({self.id('g', rrec.owner)} vs {self.id('g', rec.owner)})",
            )
        mine = self.clock[lane.index]
        for i, v in enumerate(clock):
            if v > mine[i]:
                mine[i] = v

    def check_external(
        self, node: fx.Node, rec: meta.NodeInfo, lane: LaneId, seg_work: bool,
        in_segment: set[int], ext_in: set[str], ext_out: set[str],
    ) -> None:
        """The external-join rule at one ``capturepass.join_external``."""
        name = rec.external
        declared = dict(self.gi.external)
        if name not in declared:
            raise fail(
                self.gm, "external-join", node,
                f"joins external stream {name!r}, which the graph does not declare "
                f"(declared: {', '.join(declared) or 'none'})",
            )
        if lane != MAIN_LANE:
            raise fail(self.gm, "external-join", node, f"joins external stream {name!r} on {lane}; joins run on s0")
        if rec.role == EventRole.IN:
            if seg_work:
                raise fail(
                    self.gm, "external-join", node,
                    f"joins external stream {name!r} into s0 after the segment's work began: "
                    "the work before it does not wait for the stream",
                )
            ext_in.add(name)
            return
        for li in sorted(in_segment):
            if li != 0 and self.clock[0][li] < self.count[li]:
                raise fail(
                    self.gm, "external-join", node,
                    f"joins s0 out to external stream {name!r}, but lane s{li} ({self.gi.lane_name(LaneId(li))}) "
                    "has not joined s0: the stream would not wait for its work",
                )
        ext_out.add(name)

    def check_external_joined(
        self, node: fx.Node, ext: tuple[tuple[str, str], ...], ext_in: set[str], ext_out: set[str], where: str
    ) -> None:
        """Every external stream of relation ``where`` (or ``both``) has joined at this boundary."""
        seen = ext_in if where == "before" else ext_out
        for name, relation in ext:
            if relation in (where, "both") and name not in seen:
                what = "starts" if where == "before" else "ends"
                direction = "into s0" if where == "before" else "out of s0"
                raise fail(
                    self.gm, "external-join", node,
                    f"{what} a segment without joining external stream {name!r} ({relation}) {direction}",
                )

    def check_joined(self, anchor: fx.Node, in_segment: Iterable[int]) -> None:
        for li in sorted(in_segment):
            if li != 0 and self.clock[0][li] < self.count[li]:
                lane = LaneId(li)
                raise fail(
                    self.gm, "unjoined-lane", anchor,
                    f"ends a segment, but lane {lane} ({self.gi.lane_name(lane)}) has not joined s0",
                )

    def _races(self, alloc: int, u: fx.Node) -> bool:
        """Whether read ``u`` may still run when lane number ``alloc`` frees what it reads."""
        where = self.seq.get(u)
        if where is None:
            return True
        li, s = where
        return li != alloc and self.clock[alloc][li] < s

    def _racing_read(self, root: fx.Node, now: int) -> fx.Node | None:
        """A read of ``root`` on another lane that a free after program index ``now`` would race."""
        if not self.layout.issues_after(root, now):
            return None  # the allocating lane issues nothing more before the next fork
        alloc = meta.lane_of(root).index
        if self.root_of.get(root) is root:
            # A read after ``now`` is not issued yet (it races); one issued on the allocating
            # lane never does: what is left to look at is the reads on other lanes.
            if self.last_read.get(root, -1) <= now and not any(
                self._races(alloc, u) for u in self.cross_reads.get(root, ())
            ):
                return None
        # Name the same read as a walk of the views would, in the order of their uses.
        for u in analysis.reads_of(root):
            if self._races(alloc, u):
                return u
        return None

    def check_release(self, node: fx.Node, lane: LaneId, order: dict[fx.Node, int]) -> None:
        for root in node.all_input_nodes:
            if meta.lane_of(root) != lane:
                raise fail(
                    self.gm, "unordered-free", node,
                    f"releases %{root.name} on {lane}, but it was allocated on {meta.lane_of(root)}",
                )
            bad = self._racing_read(root, order[node])
            if bad is not None:
                raise fail(
                    self.gm, "unordered-free", node,
                    f"releases %{root.name} on {lane} while %{bad.name} on {meta.lane_of(bad)} may still read it",
                )

    def check_frees(self, node: fx.Node, frees: dict[fx.Node, fx.Node], order: dict[fx.Node, int]) -> None:
        root = frees.get(node)
        if root is None:
            return
        now = order[node]
        for root in (root, *self.frees_more.get(node, ())):
            bad = self._racing_read(root, now)
            if bad is not None:
                raise fail(
                    self.gm, "unordered-free", root,
                    f"allocated on {meta.lane_of(root)} is freed after %{node.name}, while %{bad.name} on "
                    f"{meta.lane_of(bad)} may still read it (a deferred release is missing)",
                )

    def check_leases(self) -> None:
        nodes = self.nodes
        owner = self.gi.owner
        lease_of: dict[EventId, tuple] = {}
        live: dict[EventId, list[int]] = {}
        for i, (node, rec) in enumerate(zip(nodes, self.recs)):
            if rec.effect is not Effect.RECORD and rec.effect is not Effect.WAIT:
                continue
            if rec.lease is None:
                raise fail(self.gm, "lease-owner", node, f"uses event {self.id('e', rec.event)} without a lease")
            if rec.lease.owner != owner or rec.owner not in (None, owner):
                raise fail(
                    self.gm, "lease-owner", node,
                    f"uses lease {self.id('l', rec.lease)} of owner {self.id('g', rec.lease.owner)}, "
                    f"but the graph's owner is {self.id('g', owner)}",
                )
            if rec.lease.role != rec.role:
                raise fail(
                    self.gm, "lease-owner", node,
                    f"uses a {rec.lease.role!r} lease for a {rec.role!r} event",
                )
            prev = lease_of.setdefault(rec.event, rec.lease)
            if prev != rec.lease:
                raise fail(self.gm, "lease-owner", node, f"event {self.id('e', rec.event)} has two leases")
            span = live.get(rec.event)
            if span is None:
                live[rec.event] = [i, i]
            else:  # nodes come in program order: the span only grows at its end
                span[1] = i
        by_lease: dict = {}
        for event, lease in lease_of.items():
            by_lease.setdefault(lease, []).append((live[event][0], live[event][1], event))
        for lease, spans in by_lease.items():
            spans.sort()
            for (a0, a1, ea), (b0, b1, eb) in zip(spans, spans[1:]):
                if b0 <= a1:
                    raise fail(
                        self.gm, "lease-overlap", nodes[b0],
                        f"records event {self.id('e', eb)} into lease {self.id('l', lease)} while event "
                        f"{self.id('e', ea)} of the same lease is still "
                        f"waited on (until %{nodes[a1].name})",
                    )

    def check_retention(self) -> None:
        if not self.gi.captured:
            return
        external = analysis.external_owners(self.gm)
        needed: dict[fx.Node, fx.Node] = {}
        resources: dict = {}
        retained: set = set()
        for node, rec in zip(self.nodes, self.recs):
            eff = rec.effect
            boundary = eff is Effect.OUTPUT or (eff is Effect.COMPUTE and rec.brk is not None)
            if boundary:
                for owner_node, user in needed.items():
                    if owner_node not in retained:
                        raise fail(
                            self.gm, "unretained-owner", user,
                            f"bakes the storage of %{owner_node.name} into a captured segment that does not "
                            "retain it",
                        )
                for binding, user in resources.items():
                    if binding not in retained:
                        raise fail(
                            self.gm, "unretained-owner", user,
                            f"uses resource {binding} in a captured segment that does not retain it",
                        )
                needed, resources, retained = {}, {}, set()
                continue
            if eff is Effect.RETAIN:
                retained.update(node.all_input_nodes)
                retained.update(rec.resources)
            elif eff is Effect.COMPUTE:
                for arg in node.all_input_nodes:
                    if arg in external:
                        needed.setdefault(arg, node)
                for binding in rec.resources:
                    resources.setdefault(binding, node)

    def check_segments(self) -> None:
        seen: list = []
        seen_set: set = set()
        last = None
        for node, rec in zip(self.nodes, self.recs):
            eff = rec.effect
            if eff is Effect.INPUT or eff is Effect.CONSTANT or eff is Effect.OUTPUT or rec.brk is not None:
                continue
            segment = rec.segment
            if segment is None:
                raise fail(self.gm, "segment", node, "belongs to no segment")
            if not seen:
                seen.append(segment)
                seen_set.add(segment)
                last = segment
            elif segment != last:
                if segment in seen_set:
                    raise fail(self.gm, "segment", node, f"returns to segment {segment} after leaving it")
                seen.append(segment)
                seen_set.add(segment)
                last = segment

    def _free_points(self) -> dict[fx.Node, fx.Node]:
        """node -> the first storage root whose last reference dies right after it (roots without a
        release); the others freed after the same node, in program order, go to ``frees_more``.

        One walk in program order: the storage root of each node (its own, or that of the
        input it is a view of), the last node holding each root (any user of it or of a view
        of it), whether a release holds it, and its compute reads (for :meth:`_racing_read`).
        """
        root_of = self.root_of
        last_read = self.last_read
        cross_reads = self.cross_reads
        alloc: dict[fx.Node, int] = {}  # root -> the number of its lane
        last_holder: dict[fx.Node, fx.Node] = {}
        released: set[fx.Node] = set()

        def read(root: fx.Node, node: fx.Node, i: int, lane: int) -> None:
            """A compute read of ``root`` by ``node`` (position ``i``) on ``lane``."""
            last_read[root] = i
            a = alloc.get(root)
            if a is None:
                a = alloc[root] = meta.lane_of(root).index
            if lane != a:
                cross_reads.setdefault(root, []).append(node)

        for i, (node, rec) in enumerate(zip(self.nodes, self.recs)):
            src = analysis.alias_source(node)
            if src is None:
                root_of[node] = node
            else:
                root = root_of.get(src)
                root_of[node] = analysis.storage_root(src) if root is None else root
            eff = rec.effect
            compute = eff is Effect.COMPUTE
            if compute:  # the lane run() issues it on
                lane = 0 if rec.brk is not None or rec.lane is None else rec.lane.index
            for p in node.all_input_nodes:
                root = root_of.get(p)
                if root is None:
                    root = analysis.storage_root(p)
                last_holder[root] = node  # program order: the last one written is the last holder
                if compute:
                    read(root, node, i, lane)
                elif eff is Effect.RELEASE:
                    released.add(root)
            if compute:
                # A wait_tensor reads its collective's inputs (NCCL reads them until the wait)
                # without holding them: a read for the races below, not a later free point.
                for p in analysis.pending_reads(node):
                    root = root_of.get(p)
                    read(analysis.storage_root(p) if root is None else root, node, i, lane)
        outputs = analysis.output_roots(self.gm.graph)
        points: dict[fx.Node, fx.Node] = {}
        for node, rec in zip(self.nodes, self.recs):
            if rec.effect is not Effect.COMPUTE or root_of[node] is not node or not analysis.is_tensor_node(node):
                continue
            if node in outputs or node in released:
                continue  # the caller frees it; checked where the release is
            last = last_holder.get(node)
            if last is None:
                continue
            if last in points:
                self.frees_more.setdefault(last, []).append(node)
            else:
                points[last] = node
        return points


def cap_serializes(rec: meta.NodeInfo) -> bool:
    """Whether a node's capability makes it a barrier for later work on other lanes."""
    return rec.capability is not None and rec.capability.overlap == Overlap.SERIALIZE


def verify(gm: fx.GraphModule, properties: Iterable[str] | None = None) -> None:
    """Checks ``gm`` against every rule whose property is established.

    Args:
        gm: an annotated graph.
        properties: the established IR properties; defaults to the graph's own.

    Raises:
        VerificationError: the first violated rule, naming the node.
    """
    gi = meta.graph_info(gm)
    props = frozenset(gi.properties if properties is None else properties)
    try:
        gm.graph.lint()
    except Exception as exc:
        raise VerificationError("graph", "", f"[graph] FX lint failed: {exc}") from exc
    _Checker(gm, props).run()


def check_joins(gm: fx.GraphModule) -> None:
    """Checks the ``unjoined-lane`` rule alone: every lane has joined s0 where a segment ends.

    Happens-before is recomputed from the sync nodes present, as :func:`verify` does,
    without the other rules (which the ``verify`` pass checks on the finished graph).

    Raises:
        VerificationError: a segment ends where a lane has not joined (``unjoined-lane``),
            a node is on a lane the graph lacks (``lane``), or a wait has no earlier record
            of its event (``wait-before-record``, ``lease-owner``).
    """
    _Checker(gm, frozenset()).run_joins()
