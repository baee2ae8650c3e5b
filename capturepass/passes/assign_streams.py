"""assign_streams: every compute node gets a lane; non-capturable ops become breaks.

Lanes come from the policy:

- ``off``: everything on the main lane;
- ``hints``: hinted nodes on their named lanes, the rest on main;
- ``auto``: hinted nodes on their lanes; the rest are list-scheduled over the
  main lane and up to ``max_aux_lanes`` automatic lanes (``aux0``, ``aux1``,
  ...). First the program is reordered so that, among the nodes ready at
  once, the one heading the longest estimated path to the end goes first (a
  lane runs its kernels in program order: a MoE block's experts, written after
  its router, would start behind it; its capture went from 0.1523 to 0.1417 ms
  on the H200). The scheduler then walks that order and puts each node on
  the lane where it would finish earliest, given the estimated cost of every
  node (``ir.cost``), the time each lane is busy, and a price for every
  cross-lane edge. Independent branches (a MoE's shared expert beside its
  routed experts) therefore spread over lanes, balanced along the critical
  path, while chains stay together. A kernel Inductor fuses with a producer it
  reads (pointwise work, reductions: ``cost.fuses``) stays on one of its
  producers' lanes: cut from them, each side would launch a kernel of its own
  and an event would order them, a cost its launch floor does not show (on a
  transformers Qwen2-MoE at Qwen1.5-MoE-A2.7B's shapes this halved the records
  and waits: 57 and 61 before). A pointwise producer whose only reader is such
  a kernel is computed inside the reader's kernel: the two are one group, and
  every member of a group runs on the lane its first member got (the zoo's
  Llama: 13 kernels and 14 sync points where each node chose alone made 19 and
  23; one lane makes 8). Kernels that read no device data (``iota``, ``full``
  and what only they feed) follow their readers, as views do. A schedule that
  ends on one lane gets the program's written order back; one on several lanes
  is reordered once more so that each lane's nodes run in long stretches of
  the program, each lane keeping its own order (the compiled code has a sync
  point wherever the program changes lane, and Inductor fuses nothing across
  one: the zoo's Llama went from 15 kernels and 17 sync points to 14 and 16).
  Under ``hints`` the program keeps the order its author wrote, and a program
  with collectives the collectives' order (below).

Collectives (ops whose capability says ``collective``: the functional
collectives of ``torch.distributed``) get a lane kind of their own: unless the
policy is ``off``, every collective without a hint runs on one lane named
``comm``, which ``max_aux_lanes`` does not count (it bounds the compute lanes,
hinted and automatic); a hint on a collective wins, and a hint naming ``comm``
puts compute beside the collectives. A collective's ``wait_tensor`` runs on its
collective's lane: readers of the result on other lanes wait for an event
recorded after it. Before lanes are assigned, whatever the policy, the program
order is rescheduled so that every collective is issued as soon as its inputs
(and the collective before it: every rank issues them in one order) are, and
every wait as late as possible: first the work the next collectives need, then
the independent work, then the waits, each in program order otherwise. Storage
effects and barriers (a serialized, joined, resident-grid or non-capturable op)
are never crossed.

Whatever the policy, ops that are not capturable or that must be serialized
(or joined: ``overlap="join"``) stay on the main lane, and view ops (no kernel)
follow their consumers. With a capturing mode, each non-capturable op is marked
as a break with its reason; ``monolithic`` capture of a graph that has one
switches to ``breakable`` and logs why, unless an op requires a monolithic
graph (``monolithic=True``): then the graph is refused, naming both ops. A
``breakable`` graph without breaks that holds such an op is captured
monolithic, and the switch is logged.

Before::

    %mm_1 : f32[16,64] = aten.mm.default(%x, %w1)

After::

    %mm_1 : f32[16,64] = aten.mm.default(%x, %w1)  {lane=s1}
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable

import torch
import torch.fx as fx

from capturepass.errors import CapturePassError
from capturepass.ir import analysis, collectives, cost, effects, meta
from capturepass.ir.meta import MAIN_LANE, CaptureMode, LaneId, Overlap
from capturepass.passes.base import CAPABILITIES, HINTS, LANES, Pass, PassContext

# What a cross-lane edge costs the consumer: one event record and wait, plus
# the loss of fusion across the cut (seconds, on the cost model's scale).
SYNC_PENALTY_S = 3e-6


def _pinned_to_main(node: fx.Node) -> bool:
    cap = meta.info(node).capability
    return cap is not None and (not cap.capturable or cap.overlap != Overlap.SAFE)


def _is_collective(node: fx.Node) -> bool:
    cap = meta.info(node).capability
    return cap is not None and cap.collective


def _is_barrier(node: fx.Node) -> bool:
    """A node nothing is reordered across: not capturable, gated, or a resident-grid launch."""
    cap = meta.info(node).capability
    return cap is not None and (not cap.capturable or cap.overlap != Overlap.SAFE or cap.resident_grid)


def _is_free(node: fx.Node) -> bool:
    """A node with no kernel of its own (a view, a tuple selection, host scalar math)."""
    if _pinned_to_main(node):
        return False
    return (
        analysis.is_getitem(node)
        or analysis.aliases_input(node) is not None
        or not analysis.carries_tensor(node)
    )


class _Fusion:
    """Which kernels Inductor fuses (:func:`cost.fuses`), asked once per node.

    A kernel that reads no device data (``iota``, ``full``, ``scalar_tensor`` and the
    pointwise work on them alone) is a *constant*: Inductor folds it into each reader's
    kernel, so it belongs on its readers' lane and costs no launch of its own.
    """

    def __init__(self, order: dict[fx.Node, list[effects.Dep]]) -> None:
        self._order = order  # a node with storage effects (a random draw, a write) is no constant
        self._fuses: dict[fx.Node, bool] = {}
        self._constant: dict[fx.Node, bool] = {}
        self.constants: set[fx.Node] = set()

    def fuses(self, node: fx.Node) -> bool:
        answer = self._fuses.get(node)
        if answer is None:
            answer = self._fuses[node] = cost.fuses(node)
        return answer

    def computes_a_constant(self, node: fx.Node) -> bool:
        answer = self._constant.get(node)
        if answer is None:
            answer = (
                node.op == "call_function" and not self._order.get(node) and self.fuses(node)
                and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())  # a draw
                and not any(self._reads_device_data(a) for a in node.all_input_nodes)
            )
            self._constant[node] = answer
            if answer:
                self.constants.add(node)
        return answer

    def _reads_device_data(self, node: fx.Node) -> bool:
        if not analysis.carries_tensor(node):
            return False  # a host scalar (a size)
        if node.op == "call_function" and _is_free(node):
            return any(self._reads_device_data(a) for a in node.all_input_nodes)
        return not self.computes_a_constant(node)


def _inlined(node: fx.Node) -> bool:
    """Whether Inductor computes ``node`` inside its reader's kernel: a pointwise op, or a
    concatenation (lowered as one). A reduction's output is a buffer of its own: its readers
    are another kernel."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket is torch.ops.aten.cat


def _kernel_behind(n: fx.Node, is_free: Callable[[fx.Node], bool]) -> fx.Node | None:
    """The node that produced ``n``'s data, through views and tuple selections (``None``: a
    free node with no input, such as host arithmetic on constants)."""
    while n.op == "call_function" and is_free(n):
        ins = n.all_input_nodes
        if not ins:
            return None
        n = ins[0]
    return n


def _fused_groups(nodes: list[fx.Node], fuses: Callable[[fx.Node], bool],
                  is_free: Callable[[fx.Node], bool]) -> dict[fx.Node, fx.Node]:
    """The groups of kernels Inductor fuses into one: each fusing node of ``nodes`` with a
    representative of its group (absent: a group of one).

    A pointwise producer (:func:`_inlined`) whose only reader (through views) is a fusing node
    is computed inside that reader's kernel, so the two are one group. A producer read by several nodes is left
    out: its readers may run apart (two branches that start from one value). Two chains of
    such nodes that a fusing node joins are one group, as Inductor computes them in the join's
    kernel; a matrix product or any other kernel of its own ends a chain, so the branches'
    heavy work stays free to run on lanes of its own.
    """
    members = set(nodes)

    def producer(n: fx.Node) -> fx.Node | None:
        k = _kernel_behind(n, is_free)
        return k if k in members and not is_free(k) else None

    def readers(n: fx.Node) -> set[fx.Node]:
        out: set[fx.Node] = set()
        stack = list(n.users)
        while stack:
            u = stack.pop()
            if u.op == "call_function" and is_free(u):
                stack.extend(u.users)
            else:
                out.add(u)
        return out

    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            parent[n] = parent.get(parent[n], parent[n])
            n = parent[n]
        return n

    for node in nodes:
        if is_free(node) or not fuses(node):
            continue
        for a in node.all_input_nodes:
            p = producer(a)
            if p is not None and fuses(p) and _inlined(p) and readers(p) == {node}:
                parent[find(p)] = find(node)
    return {n: find(n) for n in list(parent) + list(parent.values())}


class AssignStreams(Pass):
    """Assigns lanes by policy and marks breaks."""

    name = "assign_streams"
    requires = (HINTS, CAPABILITIES)
    ensures = (LANES,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        opts = ctx.options
        graph = gm.graph
        talking = [n for n in analysis.compute_nodes(graph) if _is_collective(n)]
        written = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        if talking:
            _order_for_collectives(graph)
        elif opts.policy == "auto" and opts.max_aux_lanes > 0:
            _order_by_critical_path(graph)
        nodes = list(analysis.compute_nodes(graph))
        lane_names: list[str] = [meta.MAIN_LANE_NAME]
        lanes: dict[fx.Node, LaneId] = {}
        # The comm lane: a lane kind of its own, not counted by max_aux_lanes.
        comm: LaneId | None = None
        if opts.policy != "off" and any(not _pinned_to_main(n) for n in talking):
            comm = LaneId(len(lane_names))
            lane_names.append(collectives.COMM_LANE)
        extra = 0 if comm is None else 1

        # Hinted lanes first, in order of first appearance, up to max_aux_lanes.
        folded: list[str] = []
        for node in nodes:
            hint = meta.info(node).hint
            if hint is None or _pinned_to_main(node):
                continue
            if hint not in lane_names:
                if len(lane_names) - 1 - extra >= opts.max_aux_lanes:
                    if hint not in folded:
                        folded.append(hint)
                    lanes[node] = MAIN_LANE
                    continue
                lane_names.append(hint)
            lanes[node] = LaneId(lane_names.index(hint))
        if folded:
            msg = (
                f"max_aux_lanes={opts.max_aux_lanes}: hinted lane(s) {', '.join(folded)} run on the main lane"
            )
            meta.add_decision(gm, msg, level=logging.WARNING)

        pinned = [n for n in nodes if _pinned_to_main(n) and meta.info(n).hint is not None]
        for node in pinned:
            meta.add_decision(gm, f"%{node.name}: hint ignored, {meta.info(node).capability.reason}")

        if comm is not None:
            for node in talking:
                if node not in lanes and not _pinned_to_main(node):
                    lanes[node] = comm
        for node in nodes:
            if collectives.is_wait(node) and not _pinned_to_main(node):
                source = collectives.collective_of(node)
                lanes[node] = lanes.get(source, MAIN_LANE) if source is not None else lanes.get(node, MAIN_LANE)

        auto_lanes: list[LaneId] = []
        constants: set[fx.Node] = set()  # kernels that read no device data: placed with their readers
        if opts.policy == "auto":
            for i in range(opts.max_aux_lanes - (len(lane_names) - 1 - extra)):
                auto_lanes.append(LaneId(len(lane_names)))
                lane_names.append(f"aux{i}")
            constants = self._schedule(nodes, lanes, [MAIN_LANE] + auto_lanes)
        if opts.merge_lanes_below_us > 0:
            self._merge_short_lanes(gm, nodes, lanes, lane_names, opts.merge_lanes_below_us)
        self._place_free_nodes(nodes, lanes, constants)

        used = {lanes.get(n, MAIN_LANE) for n in nodes} | {MAIN_LANE}
        if used == {MAIN_LANE} and not talking:
            # One lane after all: the program keeps the order it was written in (Inductor's
            # fusion and buffer reuse were tuned on it), as with policy="off".
            out = next(n for n in reversed(graph.nodes) if n.op == "output")
            for node in written:
                out.prepend(node)
            nodes = list(analysis.compute_nodes(graph))
        elif not talking and opts.policy == "auto":
            # Under policy="hints" the program keeps the order its author wrote.
            _order_by_lane(graph, lanes)
            nodes = list(analysis.compute_nodes(graph))
        # Drop automatic lanes the schedule left empty, renumbering densely.
        keep = [i for i, _ in enumerate(lane_names) if LaneId(i) in used]
        renumber = {LaneId(old): LaneId(new) for new, old in enumerate(keep)}
        lane_names = [lane_names[i] for i in keep]

        mode = meta.graph_info(gm).cudagraphs
        breaks = [n for n in nodes if not meta.info(n).capability.capturable] if mode != CaptureMode.NONE else []
        whole = [n for n in nodes if meta.info(n).capability.monolithic] if mode != CaptureMode.NONE else []
        if whole and breaks:
            first, brk = whole[0], breaks[0]
            raise CapturePassError(
                f"%{first.name} ({first.target}) requires the whole forward in one monolithic CUDA graph, "
                f"but %{brk.name} ({brk.target}) is not capturable ({meta.info(brk).capability.reason}), so the "
                f"graph can only be captured breakable (cudagraphs={mode!r}); make %{brk.name}'s op capturable, "
                "move it out of the compiled region, or compile with cudagraphs='none'"
            )
        if whole and mode == CaptureMode.BREAKABLE:
            msg = (
                f"cudagraphs=breakable switched to monolithic: %{whole[0].name} requires the whole forward "
                "in one CUDA graph (and the graph has no break)"
            )
            meta.add_decision(gm, msg)
            mode = CaptureMode.MONOLITHIC
        if breaks and mode == CaptureMode.MONOLITHIC:
            first = breaks[0]
            msg = (
                f"cudagraphs=monolithic switched to breakable: %{first.name} is not capturable "
                f"({meta.info(first).capability.reason})"
            )
            meta.add_decision(gm, msg, level=logging.WARNING)
            mode = CaptureMode.BREAKABLE
        meta.update_graph(gm, lanes=tuple(lane_names), cudagraphs=mode)

        brk_set = set(breaks)
        for node in graph.nodes:
            eff = meta.effect_of(node)
            if eff is meta.Effect.COMPUTE:
                lane = renumber[lanes.get(node, MAIN_LANE)]
                if node in brk_set:
                    meta.update(node, self.name, lane=MAIN_LANE, brk=meta.info(node).capability.reason)
                else:
                    meta.update(node, self.name, lane=lane)
                if lane != MAIN_LANE:
                    ctx.count(self.name, "aux_nodes")
            elif eff in (meta.Effect.INPUT, meta.Effect.CONSTANT, meta.Effect.OUTPUT):
                meta.update(node, self.name, lane=MAIN_LANE)
        ctx.count(self.name, "lanes", len(lane_names))
        ctx.count(self.name, "breaks", len(breaks))
        if talking:
            self._explain_collectives(gm, ctx, talking)
        self._gate(gm, ctx)

    def _explain_collectives(self, gm: fx.GraphModule, ctx: PassContext, talking: list[fx.Node]) -> None:
        """One decision per collective: its group, its lane, and the work issued before its wait."""
        gi = meta.graph_info(gm)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in talking:
            ctx.count(self.name, "collectives")
            what = (f"%{node.name}: collective on {collectives.describe_group(collectives.group_of(node))} "
                    f"on lane {gi.lane_name(meta.lane_of(node))}")
            waits = sorted(collectives.waits_of(node), key=order.__getitem__)
            if not waits:
                meta.add_decision(gm, f"{what}; no wait_tensor in this graph")
                continue
            wait = waits[0]
            between = [n for n in gm.graph.nodes if order[node] < order[n] < order[wait]
                       and meta.effect_of(n) is meta.Effect.COMPUTE and not _is_free(n)
                       and not _is_collective(n) and not collectives.is_wait(n)]
            meta.add_decision(gm, f"{what}; {len(between)} kernel(s) issued before %{wait.name}")

    def _gate(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Records each capability-gated decision; enqueues other lanes' work before resident launches.

        A serialized op (``overlap="serialize"``, or a grid barrier) gets its barrier in
        ``insert_syncs``. A barrier-free resident-grid launch may run beside other lanes,
        but work that does not depend on it is moved before it in program order: once the
        launch holds the multiprocessors, work submitted after it could wait for it to end.
        """
        gated = [
            n for n in gm.graph.nodes
            if meta.effect_of(n) is meta.Effect.COMPUTE and meta.info(n).capability is not None
            and (meta.info(n).capability.overlap != Overlap.SAFE or meta.info(n).capability.resident_grid)
        ]
        has_effects = bool(gated) and effects.has_effects(gm.graph)
        for launch in gated:
            cap = meta.info(launch).capability
            if cap.overlap == Overlap.SERIALIZE:
                meta.add_decision(gm, f"%{launch.name}: {cap.reason}: serialized, no other lane runs beside it")
                continue
            later: list[fx.Node] = []
            node = launch.next
            while node.op != "output" and meta.info(node).brk is None:
                if meta.effect_of(node) is meta.Effect.COMPUTE:
                    later.append(node)
                node = node.next
            after = set(later)
            # NOTE: moving a node before the launch must not reorder two accesses of one
            # storage (or two random draws): storage-effect dependencies count as edges here.
            order = effects.order_deps([launch, *later]) if has_effects else {}
            succ: dict[fx.Node, list[fx.Node]] = {}
            for n, deps in order.items():
                for d in deps:
                    succ.setdefault(d.earlier, []).append(n)
            descendants: set[fx.Node] = set()
            stack = [launch]
            while stack:
                cur = stack.pop()
                for user in (*cur.users, *succ.get(cur, ())):
                    if user in after and user not in descendants:
                        descendants.add(user)
                        stack.append(user)
            lane = meta.lane_of(launch)
            need = {n for n in later if n not in descendants and meta.lane_of(n) != lane}
            stack = list(need)
            while stack:  # what they read (and the accesses they follow) must move with them
                cur = stack.pop()
                for a in (*cur.all_input_nodes, *(d.earlier for d in order.get(cur, ()))):
                    if a in after and a not in need:
                        need.add(a)
                        stack.append(a)
            moved = [n for n in later if n in need]
            for n in moved:
                launch.prepend(n)
            names = ", ".join(f"%{n.name}" for n in moved[:6]) + (", ..." if len(moved) > 6 else "")
            what = f"enqueued {len(moved)} node(s) of other lanes before it ({names})" if moved else (
                "nothing on other lanes to enqueue before it")
            if cap.overlap == Overlap.JOIN:
                meta.add_decision(gm, f"%{launch.name}: {cap.reason}: joined; {what}; every lane joins before it starts")
            else:
                meta.add_decision(gm, f"%{launch.name}: {cap.reason}: may overlap; {what}")
            ctx.count(self.name, "enqueued_first", len(moved))

    def _schedule(
        self, nodes: list[fx.Node], lanes: dict[fx.Node, LaneId], candidates: list[LaneId],
    ) -> set[fx.Node]:
        """Earliest-finish list scheduling of the unhinted kernels over ``candidates``.

        A kernel Inductor fuses with a producer it reads stays on one of its producers' lanes,
        a member of a fused group (:func:`_fused_groups`) on its group's lane, and constants are
        left to follow their readers: cut from its neighbours, each would add a launch and an
        event that its estimate does not show. Returns the constants.
        """
        if len(candidates) < 2:
            return set()
        # Storage effects order nodes beyond their data edges (a write after the reads of its
        # storage, random ops in program order): the schedule must count them as edges too.
        order = effects.order_deps(nodes)
        ready: dict[LaneId, float] = {}
        finish: dict[fx.Node, float] = {}
        where: dict[fx.Node, LaneId] = {}
        free: dict[fx.Node, bool] = {}  # _is_free per node: asked again for each of its users

        def is_free(n: fx.Node) -> bool:
            answer = free.get(n)
            if answer is None:
                answer = free[n] = _is_free(n)
            return answer

        def source(n: fx.Node) -> fx.Node | None:
            k = _kernel_behind(n, is_free)
            return k if k in finish else None

        fusing = _Fusion(order)
        # A hinted node is no member: a hint is a cut the user asked for, and a group through
        # it would pull the code before it onto the code after it.
        group = _fused_groups(nodes, lambda n: n not in lanes and fusing.fuses(n), is_free)
        group_lane: dict[fx.Node, LaneId] = {}
        for node in nodes:
            if is_free(node) or fusing.computes_a_constant(node):
                continue  # placed with their readers (_place_free_nodes)
            t = cost.node_time(meta.info(node).cost)
            data = [p for p in (source(a) for a in node.all_input_nodes) if p is not None]
            preds = list(data)
            extra = order.get(node)
            if extra:
                preds += [d.earlier for d in extra if d.earlier in finish]
            if _pinned_to_main(node):
                # A serialized or joined op starts when every lane is idle; nothing runs
                # beside a serialized one, while other lanes may resume beside a joined one.
                start = max([ready.get(lane, 0.0) for lane in ready] + [finish[p] for p in preds] + [0.0])
                end = start + t
                joined = meta.info(node).capability.overlap == Overlap.JOIN
                for lane in list(ready) + [MAIN_LANE]:
                    ready[lane] = end if not joined or lane == MAIN_LANE else start
                finish[node], where[node] = end, MAIN_LANE
                continue
            fixed = lanes.get(node)
            root = group.get(node)
            if fixed is not None:
                options = [fixed]
            elif root is not None and root in group_lane:
                # Inductor fuses the group into one kernel on one lane: a member on another
                # lane would launch a kernel of its own between two events.
                options = [group_lane[root]]
            elif fusing.fuses(node) and any(fusing.fuses(p) for p in data):
                # Inductor fuses it into a producer's kernel on that lane; on a lane none of its
                # producers is on, it would launch a kernel of its own (the producer's value
                # realized for the event between them), which its launch floor does not show.
                # A producer that is a library call (a matrix product) counts too: its output
                # is read where it was made, and the lanes it could move to gain nothing.
                options = sorted({where[p] for p in data}, key=lambda lane: lane.index)
            else:
                options = candidates
            best: tuple[float, int, int, LaneId] | None = None
            latest_pred_lane = where[max(preds, key=finish.__getitem__)] if preds else MAIN_LANE
            for lane in options:
                start = ready.get(lane, 0.0)
                for p in preds:
                    start = max(start, finish[p] + (SYNC_PENALTY_S if where[p] != lane else 0.0))
                key = (start + t, 0 if lane == latest_pred_lane else 1, lane.index, lane)
                if best is None or key[:3] < best[:3]:
                    best = key
            assert best is not None
            end, lane = best[0], best[3]
            ready[lane] = end
            finish[node], where[node] = end, lane
            if root is not None:
                group_lane.setdefault(root, lane)
            if fixed is None and lane != MAIN_LANE:
                lanes[node] = lane
        return fusing.constants

    def _merge_short_lanes(
        self, gm: fx.GraphModule, nodes: list[fx.Node], lanes: dict[fx.Node, LaneId], lane_names: list[str],
        below_us: float,
    ) -> None:
        """Puts the kernels of every lane whose estimated busy time is below ``below_us`` back on
        the main lane: a short branch saves less than its fork and join cost (an event record and
        wait each, and the fusion lost across the cut), which the cost model prices only roughly."""
        busy: dict[LaneId, float] = {}
        for node in nodes:
            lane = lanes.get(node)
            if lane is not None and lane != MAIN_LANE and not _is_free(node):
                busy[lane] = busy.get(lane, 0.0) + cost.node_time(meta.info(node).cost) * 1e6
        short = sorted((lane for lane, us in busy.items() if us < below_us), key=lambda lane: lane.index)
        for node in nodes:
            if lanes.get(node) in short:
                del lanes[node]
        for lane in short:
            meta.add_decision(
                gm, f"lane {lane_names[lane.index]}: estimated busy {busy[lane]:.1f} us < merge_lanes_below_us="
                f"{below_us:g}: merged back onto the main lane",
            )

    def _place_free_nodes(self, nodes: list[fx.Node], lanes: dict[fx.Node, LaneId], constants: set[fx.Node]) -> None:
        """Views and ``constants`` (kernels that read no device data: ``iota``, ``full`` and
        what only they feed) follow their consumers; tuple selections follow their producer."""
        for node in reversed(nodes):
            if not (_is_free(node) or node in constants) or meta.info(node).hint is not None:
                continue
            if analysis.is_getitem(node):
                continue
            user_lanes = {lanes.get(u, MAIN_LANE) for u in node.users if meta.effect_of(u) is meta.Effect.COMPUTE}
            ins = node.all_input_nodes
            if len(user_lanes) == 1:
                lanes[node] = next(iter(user_lanes))
            else:
                lanes[node] = lanes.get(ins[0], MAIN_LANE) if ins else MAIN_LANE
            if lanes[node] == MAIN_LANE:
                lanes.pop(node)
        for node in nodes:
            if analysis.is_getitem(node):
                parent = node.args[0]
                if parent in lanes:
                    lanes[node] = lanes[parent]
                else:
                    lanes.pop(node, None)


SpanOrder = Callable[[list[fx.Node], dict[fx.Node, list[effects.Dep]]], list[fx.Node]]


def _reorder(graph: fx.Graph, order_span: SpanOrder) -> None:
    """Rewrites the program order span by span: between barriers (:func:`_is_barrier`), which
    nothing crosses, ``order_span`` gives each span's new order (a topological order of its
    data and storage-effect edges)."""
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    deps = effects.order_deps(body)
    spans: list[list[fx.Node]] = [[]]
    for node in body:
        if _is_barrier(node):
            spans.append([node])
            spans.append([])
        else:
            spans[-1].append(node)
    new: list[fx.Node] = []
    for span in spans:
        new.extend(order_span(span, deps) if len(span) > 1 else span)
    if new == body:
        return
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in new:
        out.prepend(node)


def _span_preds(span: list[fx.Node], deps: dict[fx.Node, list[effects.Dep]]) -> dict[fx.Node, set[fx.Node]]:
    """Each node's predecessors within ``span``: what it reads and what its storage effects follow."""
    index = set(span)
    preds: dict[fx.Node, set[fx.Node]] = {n: set() for n in span}
    for node in span:
        preds[node].update(a for a in node.all_input_nodes if a in index)
        preds[node].update(d.earlier for d in deps.get(node, ()) if d.earlier in index)
    return preds


def _span_succs(span: list[fx.Node], preds: dict[fx.Node, set[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
    """Each node's successors within ``span``, from ``preds``."""
    succs: dict[fx.Node, list[fx.Node]] = {n: [] for n in span}
    for n in span:
        for p in preds[n]:
            succs[p].append(n)
    return succs


def _heap_order(span: list[fx.Node], preds: dict[fx.Node, set[fx.Node]], succs: dict[fx.Node, list[fx.Node]],
                key: Callable[[fx.Node], tuple]) -> list[fx.Node]:
    """The topological order of ``span`` that issues, of the nodes ready at once, the one with
    the least ``key``."""
    missing = {n: len(preds[n]) for n in span}
    ready = [(key(n), n) for n in span if missing[n] == 0]
    heapq.heapify(ready)
    out: list[fx.Node] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for u in succs[n]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (key(u), u))
    assert len(out) == len(span), "the dependencies of a span form a cycle"
    return out


def _order_for_collectives(graph: fx.Graph) -> None:
    """Reschedules the program order: collectives as early as possible, their waits as late.

    Between barriers (:func:`_is_barrier`), nodes are issued in a topological order of
    their data edges, storage-effect edges and the order of the collectives among
    themselves, choosing among the ready nodes: a collective first; then a node some
    later collective needs; then any other node that is not a wait; then a wait. Ties go
    to program order, so a graph is rescheduled the same way on every rank.
    """
    _reorder(graph, _ordered_span)


def _order_by_critical_path(graph: fx.Graph) -> None:
    """Reschedules the program order for lanes: among the nodes ready at once, the one with the
    longest estimated path to the end of its span first.

    The list scheduler walks the program in order and a lane runs its kernels in that order, so
    a branch written after a short one (a MoE block's experts after its router) starts behind
    it on whatever lane it gets. Issuing the ready node that heads the longest remaining path
    first (HLFET list scheduling) starts the critical path at once and leaves the short
    branches to fill the other lanes. Between barriers (:func:`_is_barrier`) only; data edges
    and storage-effect edges are kept; ties go to program order.
    """
    _reorder(graph, _critical_first)


def _order_by_lane(graph: fx.Graph, lanes: dict[fx.Node, LaneId]) -> None:
    """Reorders the program so that each lane's kernels run in long stretches: from the nodes
    ready at once, one of the lane issued last, else the earliest in program order.

    Each lane keeps its own order, and the order across lanes is only the program's: the
    waits order the lanes on the device. But the compiled code switches lanes where the program
    does, and each switch is a sync point that Inductor cannot fuse across (the values computed
    before it that are read after it are buffers of their own). Between barriers only; data
    edges and storage-effect edges are kept.
    """
    _reorder(graph, lambda span, deps: _lane_stretches(span, deps, lanes))


def _lane_stretches(span: list[fx.Node], deps: dict[fx.Node, list[effects.Dep]],
                    lanes: dict[fx.Node, LaneId]) -> list[fx.Node]:
    index = {n: i for i, n in enumerate(span)}
    preds = _span_preds(span, deps)

    def lane(n: fx.Node) -> int | None:
        # A node with no kernel (a constant's attribute, host arithmetic) runs on no lane.
        return lanes.get(n, MAIN_LANE).index if meta.effect_of(n) is meta.Effect.COMPUTE else None

    # Each lane's nodes in their program order, which stays theirs; the others go as soon as
    # what they read is out. The program order is topological for every edge, so the lane
    # whose next node comes first in it can always go on.
    queues: dict[int | None, list[fx.Node]] = {}
    for n in span:
        queues.setdefault(lane(n), []).append(n)
    heads = {k: 0 for k in queues}
    done: set[fx.Node] = set()
    out: list[fx.Node] = []

    def go(k: int | None) -> bool:
        q, i = queues[k], heads[k]
        if i == len(q) or not preds[q[i]] <= done:
            return False
        out.append(q[i])
        done.add(q[i])
        heads[k] = i + 1
        return True

    current: int | None = None
    while len(out) < len(span):
        while None in queues and go(None):
            pass
        if current is not None and go(current):
            continue
        waiting = [(index[queues[k][heads[k]]], k) for k in queues if k is not None and heads[k] < len(queues[k])]
        if not waiting:
            continue
        for _, k in sorted(waiting):
            if go(k):
                current = k
                break
        else:
            raise AssertionError("the dependencies of a span form a cycle")
    return out


def _critical_first(span: list[fx.Node], deps: dict[fx.Node, list[effects.Dep]]) -> list[fx.Node]:
    index = {n: i for i, n in enumerate(span)}
    preds = _span_preds(span, deps)
    succs = _span_succs(span, preds)
    level: dict[fx.Node, float] = {}
    for n in reversed(span):  # program order is topological, for both kinds of edge
        c = meta.info(n).cost if meta.has_info(n) else None
        level[n] = cost.node_time(c) + max((level[u] for u in succs[n]), default=0.0)
    return _heap_order(span, preds, succs, lambda n: (-level[n], index[n]))


def _ordered_span(span: list[fx.Node], deps: dict[fx.Node, list[effects.Dep]]) -> list[fx.Node]:
    index = {n: i for i, n in enumerate(span)}
    preds = _span_preds(span, deps)
    previous: fx.Node | None = None
    for node in span:
        if _is_collective(node):
            if previous is not None:
                preds[node].add(previous)  # every rank must issue the collectives in one order
            previous = node
    feeds: set[fx.Node] = set()
    stack = [n for n in span if _is_collective(n)]
    while stack:
        for p in preds[stack.pop()]:
            if p not in feeds:
                feeds.add(p)
                stack.append(p)

    def rank(n: fx.Node) -> tuple[int, int]:
        if _is_collective(n):
            return 0, index[n]
        if collectives.is_wait(n):
            return 3, index[n]
        return (1 if n in feeds else 2), index[n]

    return _heap_order(span, preds, _span_succs(span, preds), rank)
