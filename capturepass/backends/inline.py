"""One Inductor compile per capture segment, its lanes kept inline.

``emit`` cuts a graph into one region per lane between sync points; compiled one
by one, the regions cost a compile each, cannot fuse across their seams, and
pay an outer-program call each. :func:`fuse` turns each run of a capture
segment's lane regions and syncs into a single region instead: one graph of
all their nodes in the plan's order, where each point that syncs or changes
lane becomes a call of ``capturepass::inline_step`` (see
``capturepass.runtime.inline``, which runs the plan's steps there and makes the
next lane current; Inductor's generated code launches each kernel on the
stream current at its launch).

Inductor moves and fuses nodes that nothing orders, so the graph gives each
node an edge to both of its sync points:

- a point *reads* what the code since the previous point computed last (the
  values no later node of it reads), so those nodes run before it;
- a point *guards* the storages the next region reads from outside itself: the
  op declares them written, so every node that reads them after it is ordered
  after it (functionalization hands those readers the written version), and no
  reader of the old version moves past it. Nothing is copied: Inductor
  re-inplaces the declared write (the compile is checked for it in the tests);
- nodes that read no device data (``full``, ``arange``) have no such edge: they
  move to the start of the run, on the main lane, where every side lane is
  ordered after them by the plan's first wait (checked; otherwise the run keeps
  its lane regions, with the reason logged). Two equal constants on two lanes
  would otherwise be merged into one that the other lane reads unordered.

Inductor's planned reuse of a buffer (``buf5 = buf2  # reuse``, in-place
outputs) and its reordering passes do not know lanes: a fused graph of more
than one lane is compiled with them off, and frees are the allocator's (a
block goes back to the stream that allocated it, where ``insert_syncs`` placed
a ``release`` read when another lane still reads it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from capturepass.ir import analysis, hops, meta
from capturepass.ir.plan import Inline, Plan, RegionPlan, Step, StepKind, SyncPoint
from capturepass.passes.emit import RegionBuilder, symbol_providers
from capturepass.runtime import inline as _registers_inline_step  # noqa: F401  (the op)

log = logging.getLogger("capturepass")

_keys = itertools.count()
_SYNC_STEPS = (StepKind.RECORD, StepKind.WAIT, StepKind.RELEASE, StepKind.RETAIN)
# Inductor options that place work by buffer identity or move nodes, blind to lanes.
_LANE_BLIND = ("allow_buffer_reuse", "inplace_buffers", "reorder_for_peak_memory", "reorder_for_locality")


class _KeepRegions(Exception):
    """A run that must keep its lane regions (the message says why)."""


@dataclasses.dataclass
class Fused:
    """A plan with fused segments, and what each fused region replaced.

    Attributes:
        plan: the new plan.
        replaced: by fused region index, the steps it stands for (to fall back to).
        kept: why runs that could have been fused were not (logged).
    """

    plan: Plan
    replaced: dict[int, list[Step]]
    kept: list[str]


def _fusable(step: Step) -> bool:
    if step.kind in _SYNC_STEPS:
        return True
    if step.kind != StepKind.REGION:
        return False
    r: RegionPlan = step.payload
    if r.eager or r.groups:
        return False
    return r.compiler == "inductor" or (r.compiler == "eager" and not r.kernels)


def _segment(step: Step) -> int | None:
    if step.kind == StepKind.REGION:
        return step.payload.segment
    seg = meta.info(step.payload).segment
    return seg.index if seg is not None else None


def _runs(steps: list[Step]) -> Iterator[tuple[bool, list[Step]]]:
    """Maximal runs of fusable steps of one segment (``True``), and the steps between them."""
    run: list[Step] = []
    for step in steps:
        if _fusable(step) and (not run or _segment(run[0]) == _segment(step)):
            run.append(step)
            continue
        if run:
            yield True, run
            run = []
        if _fusable(step):
            run.append(step)
        else:
            yield False, [step]
    if run:
        yield True, run


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def fuse(plan: Plan) -> Fused:
    """Replaces each run of two or more lane regions of one capture segment by one region."""
    steps: list[Step] = []
    replaced: dict[int, list[Step]] = {}
    kept: list[str] = []
    providers = symbol_providers(plan.graph)
    for fusable, run in _runs(plan.steps):
        regions = [s.payload for s in run if s.kind == StepKind.REGION]
        if not fusable or len(regions) < 2:
            steps.extend(run)
            continue
        try:
            region = _fused_region(plan, run, regions, providers)
        except _KeepRegions as why:
            kept.append(f"regions {regions[0].index}-{regions[-1].index}: {why}")
            steps.extend(run)
            continue
        replaced[region.index] = run
        steps.append(Step(StepKind.REGION, lane=meta.MAIN_LANE, payload=region))
    return Fused(Plan(plan.graph, steps), replaced, kept)


def _hoisted(regions: list[RegionPlan], members: set[fx.Node]) -> list[fx.Node]:
    """The nodes that read no device data, to run first on the main lane (see the module doc)."""
    out: list[fx.Node] = []
    placed: set[fx.Node] = set()
    for region in regions:
        for node in region.nodes:
            if node.op != "call_function" or not _is_tensor(node) or analysis.is_getitem(node):
                continue
            inputs = node.all_input_nodes
            if any(analysis.carries_tensor(a) for a in inputs):
                continue
            if any(a in members and a not in placed for a in inputs):
                raise _KeepRegions(f"%{node.name} reads no device data but a size computed in the segment")
            if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
                raise _KeepRegions(f"%{node.name} ({node.target}) draws random numbers: it cannot move")
            out.append(node)
            placed.add(node)
    return out


def _check_hoist_ordered(run: list[Step], hoisted: set[fx.Node]) -> None:
    """Every lane that reads a hoisted value must wait, before it, for the main lane after the run began."""
    after_start: set = set()
    ordered = {0}
    for step in run:
        if step.kind == StepKind.RECORD and step.lane.index in ordered:
            after_start.add(meta.info(step.payload).event)
        elif step.kind == StepKind.WAIT and meta.info(step.payload).event in after_start:
            ordered.add(step.lane.index)
        elif step.kind == StepKind.REGION and step.payload.lane not in ordered:
            for node in step.payload.nodes:
                for a in node.all_input_nodes:
                    if a in hoisted:
                        raise _KeepRegions(
                            f"%{a.name} (no device input) would move to the main lane, which lane "
                            f"s{step.payload.lane} does not wait for before %{node.name} reads it")


class _Roots:
    """The node that allocated the storage a value lives in, by the storages of the graph's fake
    values (through every view, ``_unsafe_view`` and the outputs of ``split`` alike, as
    Inductor's re-inplacing judges them). A guard on a view would make functionalization
    regenerate the base from it, which Inductor may recompute in a kernel on another lane.
    A graph input is its own root: two inputs that share storage stay two guards."""

    def __init__(self, graph: fx.Graph) -> None:
        self._first: dict[object, fx.Node] = {}
        for node in graph.nodes:
            key = self._storage(node)
            if key is not None:
                self._first.setdefault(key, node)

    @staticmethod
    def _storage(node: fx.Node) -> object | None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            return None
        try:
            return StorageWeakRef(val.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def __call__(self, node: fx.Node) -> fx.Node:
        if node.op in ("placeholder", "get_attr"):
            return node
        key = self._storage(node)
        return self._first.get(key, node) if key is not None else analysis.storage_root(node)


def _fused_region(plan: Plan, run: list[Step], regions: list[RegionPlan], providers: dict) -> RegionPlan:
    members = {n for r in regions for n in r.nodes}
    sync_nodes = {s.payload for s in run if s.kind != StepKind.REGION}
    lanes = {r.lane for r in regions}
    hoisted = _hoisted(regions, members) if len(lanes) > 1 else []
    moved = set(hoisted)
    _check_hoist_ordered(run, moved)
    key = next(_keys)

    b = RegionBuilder(members, lambda n: _KeepRegions(f"%{n.name} is read before it is computed"))
    graph, env, arg = b.graph, b.env, b.arg
    split: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}

    def copy(node: fx.Node) -> None:
        # NOTE: Inductor lowers var_mean to one Welford reduction with two outputs; declaring
        # its mean written made a buffer that depends on itself (KeyError 'opN' in the
        # scheduler's compute_ancestors, torch 2.13: every layer norm of GPT-2, Phi, ViT...).
        # With lanes, it is computed as var and mean, two reductions Inductor fuses into one
        # kernel, each with its own output.
        if node.target is torch.ops.aten.var_mean.correction and len(lanes) > 1:
            x = arg(node.args[0])
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if dims is None:
                dims = list(range(node.args[0].meta["val"].dim()))
            keepdim = node.kwargs.get("keepdim", False)
            var = graph.call_function(torch.ops.aten.var.correction, (x, dims),
                                      {"correction": node.kwargs.get("correction"), "keepdim": keepdim})
            mean = graph.call_function(torch.ops.aten.mean.dim, (x, dims, keepdim))
            for new, val in zip((var, mean), node.meta.get("val", (None, None))):
                if val is not None:
                    new.meta["val"] = val
            split[node] = (var, mean)
            env[node] = var
            return
        if analysis.is_getitem(node) and node.args[0] in split:
            env[node] = split[node.args[0]][node.args[1]]
            return
        b.copy(node)
    all_nodes = [n for r in regions for n in r.nodes]
    b.bind_sizes(all_nodes, providers)
    for node in hoisted:
        copy(node)
    # Every point writes this token: the points keep their order among themselves, and a point
    # that guards nothing else is still a write (functionalization drops an op that writes nothing).
    device = next(v.device for n in all_nodes if isinstance(v := n.meta.get("val"), torch.Tensor))
    token = graph.call_function(torch.ops.aten.empty.memory_format, ([0],), {"dtype": torch.uint8, "device": device})

    points: list[SyncPoint] = []
    pending: list[Step] = []
    since: list[fx.Node] = []
    first: list[fx.Node] = list(hoisted)  # guarded by the first point, which they run before
    lane = 0

    _root = _Roots(plan.graph.graph)
    lane_of = {n: (0 if n in moved else r.lane) for r in regions for n in r.nodes}
    # NOTE: Inductor re-inplaces a functional write (scatter, index_put) into its input's
    # buffer when nothing reads that input later in program order; a region compiled alone
    # never writes its inputs so. Here the input may be a value another lane still reads,
    # unordered with the write: every value read on another lane than its own is read by the
    # last point, so nothing is written into it before the run ends.
    crossed: list[fx.Node] = []
    for r in regions:
        for node in r.nodes:
            for a in node.all_input_nodes:
                root = _root(a)
                if root in lane_of and lane_of[root] != r.lane and _is_tensor(root) and root not in crossed:
                    crossed.append(root)

    def point(next_lane: int, region: RegionPlan | None, hold: Sequence[fx.Node] = ()) -> None:
        # Guarded (declared written), by storage: what the code since the last point computed
        # last (values none of it reads again), and what the next region reads from outside.
        # Two guards of one storage could not be re-inplaced, nor a value both read and guarded.
        wanted: list[fx.Node] = first[:]
        first.clear()
        done = set(since)
        wanted += [n for n in since if _is_tensor(n) and n.users and not any(u in done for u in n.users)]
        needed: set[fx.Node] = set()
        if region is not None:
            inside = set(region.nodes) - moved
            for node in region.nodes:
                for a in node.all_input_nodes:
                    if a not in inside and _is_tensor(a) and hops.module_attr(a) is None:
                        wanted.append(a)
                        needed.add(_root(a))
        guards: list[fx.Node] = []
        for n in wanted:
            root = _root(n)
            if _is_tensor(root) and root not in guards:
                guards.append(root)
        # Read: what a release or a retention takes, and what is held.
        # NOTE: a release or retention of a storage the next region reads keeps the lane
        # regions: read by one call and guarded by it, a value is copied; left to the guard
        # alone (the release not read), Gemma2's segment compiled to wrong results on the host.
        reads: list[fx.Node] = []
        takes: list[int] = []
        for st in pending:
            values = [a for a in st.payload.all_input_nodes if analysis.carries_tensor(a)] \
                if st.kind in (StepKind.RELEASE, StepKind.RETAIN) else []
            clash = next((v for v in values if _root(v) in needed), None)
            if clash is not None:
                raise _KeepRegions(f"%{clash.name} is both released or retained and read by the next region")
            reads.extend(values)
            takes.append(len(values))
        reads.extend(n for n in hold if n not in reads)
        read_roots = {_root(r) for r in reads}
        guards = [g for g in guards if g not in read_roots]
        graph.call_function(torch.ops.capturepass.inline_step.default,
                            (key, len(points), [arg(n) for n in reads], [token] + [arg(g) for g in guards]))
        points.append(SyncPoint(tuple(pending), next_lane, tuple(takes)))
        pending.clear()
        since.clear()

    for step in run:
        if step.kind != StepKind.REGION:
            pending.append(step)
            continue
        region = step.payload
        if all(node in env for node in region.nodes):
            continue  # every node of it moved to the start
        if pending or region.lane != lane:
            point(region.lane, region)
            lane = region.lane
        for node in region.nodes:
            if node not in env:
                copy(node)
                since.append(node)
    if pending or lane != 0 or crossed:
        point(0, None, crossed)

    outputs = [n for n in all_nodes
               if any(u not in members and u not in sync_nodes for u in n.users)]
    gm = b.finish(outputs)
    first = regions[0]
    return RegionPlan(
        index=first.index, lane=0, segment=first.segment, eager=False, nodes=all_nodes,
        inputs=b.inputs, outputs=outputs, graph=gm, compiler="inductor",
        kernels=any(r.kernels for r in regions), groups=(),
        inline=Inline(key, tuple(points)) if len(lanes) > 1 or points else None,
    )


@contextlib.contextmanager
def lane_safe_inductor(region: RegionPlan) -> Iterator[None]:
    """Inductor's options for compiling ``region``: its lane-blind reuse and reordering off
    when the region holds more than one lane."""
    lanes = {p.lane for p in region.inline.points} if region.inline is not None else set()
    if len(lanes | {0}) < 2:
        yield
        return
    config = torch._inductor.config
    with config.patch({k: False for k in _LANE_BLIND if hasattr(config, k)}):
        yield
