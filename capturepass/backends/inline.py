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

- a point *guards* (the op declares written, by storage) every value the code
  since the previous point computed that anything after the point reads, and
  every storage the next region reads from outside itself. A write needs its
  buffer, so the value is computed before the point (Inductor would otherwise
  inline it into its readers and compute its buffer wherever a later reader
  needs it), and every node that reads it after the point is ordered after the
  point (functionalization hands those readers the written version). Nothing
  is copied: Inductor re-inplaces the declared write, and the op takes any
  layout (``flexible_layout``), so no guard is held to other strides. The
  driver checks the generated code for both (``backends/inline_check.py``);
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
import operator
from collections.abc import Callable, Iterator, Sequence

import sympy
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
LANE_BLIND = ("allow_buffer_reuse", "inplace_buffers", "reorder_for_peak_memory", "reorder_for_locality")


class KeepRegions(Exception):
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


def _is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a view op's value (or an item of one, as ``split``'s)."""
    if analysis.is_getitem(node):
        node = node.args[0]
    return node.op == "call_function" and analysis.aliases_input(node) is not None


def fuse(plan: Plan, unguarded: frozenset[fx.Node] = frozenset()) -> Fused:
    """Replaces each run of two or more lane regions of one capture segment by one region.

    ``unguarded``: graph inputs no point may declare written (a compile that captures the
    graph with PyTorch's cudagraph trees records no graph whose non-static inputs are
    mutated). What reads only them cannot be held after a point by a guard: it moves to the
    start, on the main lane, as a constant does.
    """
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
            region = _fused_region(plan, run, regions, providers, unguarded)
        except KeepRegions as why:
            kept.append(f"regions {regions[0].index}-{regions[-1].index}: {why}")
            steps.extend(run)
            continue
        replaced[region.index] = run
        steps.append(Step(StepKind.REGION, lane=meta.MAIN_LANE, payload=region))
    return Fused(Plan(plan.graph, steps), replaced, kept)


def _size_source(expr: object, providers: dict, members: set[fx.Node]) -> bool:
    """Whether the fused graph can compute the size ``expr`` from the inputs that bind its symbols."""
    if not isinstance(expr, sympy.Expr) or not all(
            s in providers and providers[s] not in members for s in expr.free_symbols):
        return False
    return all(a.is_Integer or a.is_Symbol or isinstance(a, (sympy.Add, sympy.Mul))
               or (isinstance(a, sympy.Pow) and a.exp.is_Integer and a.exp > 0)
               for a in sympy.preorder_traversal(expr))


def _size_node(graph: fx.Graph, expr: sympy.Expr, leaf: Callable[[sympy.Symbol], fx.Node]) -> object:
    """Nodes of ``graph`` computing the size ``expr`` (checked by :func:`_size_source`)."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return leaf(expr)
    if isinstance(expr, sympy.Pow):
        parts = [expr.base] * int(expr.exp)
        op = operator.mul
    else:
        parts = list(expr.args)
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
    out = _size_node(graph, parts[0], leaf)
    for part in parts[1:]:
        out = graph.call_function(op, (out, _size_node(graph, part, leaf)))
    return out


def _hoisted(regions: list[RegionPlan], members: set[fx.Node], providers: dict,
             unguarded: frozenset[fx.Node] = frozenset()) -> tuple[list[fx.Node], dict[fx.Node, sympy.Expr]]:
    """The nodes that read no device data but ``unguarded`` inputs and what reads only them, to
    run first on the main lane (see the module doc), and the sizes among them that are read
    from a tensor of the segment, by their expressions (computed again from the inputs that
    bind their symbols)."""
    out: list[fx.Node] = []
    placed: set[fx.Node] = set()
    free = set(unguarded)  # tensors a hoisted node may read
    recomputed: dict[fx.Node, sympy.Expr] = {}

    def place_size(a: fx.Node) -> bool:
        # Host arithmetic on sizes (``2 * s0 * s1``) moves along with what reads it; a size read
        # from a tensor of the segment (``sym_size``) is computed from the graph's size inputs.
        if a not in members or a in placed:
            return True
        if a.op != "call_function" or analysis.carries_tensor(a):
            return False
        if any(analysis.carries_tensor(b) for b in a.all_input_nodes):
            val = a.meta.get("val")
            expr = val.node.expr if isinstance(val, torch.SymInt) else None
            if not _size_source(expr, providers, members):
                return False
            recomputed[a] = expr
        elif not all(place_size(b) for b in a.all_input_nodes):
            return False
        out.append(a)
        placed.add(a)
        return True

    for region in regions:
        for node in region.nodes:
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if analysis.is_getitem(node) or not _is_tensor(node):
                if free and inputs and all(a in free for a in inputs if analysis.carries_tensor(a)) \
                        and any(analysis.carries_tensor(a) for a in inputs):
                    out.append(node)  # an item of a hoisted node's tuple goes with it
                    placed.add(node)
                    free.add(node)
                continue
            if any(analysis.carries_tensor(a) and a not in free for a in inputs):
                continue
            if not all(place_size(a) for a in inputs):
                raise KeepRegions(f"%{node.name} reads no device data but a size computed in the segment")
            if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
                raise KeepRegions(f"%{node.name} ({node.target}) draws random numbers: it cannot move")
            out.append(node)
            placed.add(node)
            if unguarded:
                free.add(node)
    return out, recomputed


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
                        raise KeepRegions(
                            f"%{a.name} (no device input) would move to the main lane, which lane "
                            f"s{step.payload.lane} does not wait for before %{node.name} reads it")


class _Roots:
    """The node that allocated the storage a value lives in, among the nodes of one fused graph
    (its inputs and members), by the storages of the graph's fake values (through every view,
    ``_unsafe_view`` and the outputs of ``split`` alike, as Inductor's re-inplacing judges them).
    A guard on a view would make functionalization regenerate the base from it, which Inductor
    may recompute in a kernel on another lane.

    Storages that more than one input of the fused graph lives in are ``shared``: a write
    declared on any of them makes AOT autograd merge those inputs into one synthetic base, which
    it rebuilds at every call with ``as_strided`` copies that Inductor places on any lane (on the
    H200 a captured Mistral's segment after a break took such a base, and its first call failed
    on the base's shape).
    """

    def __init__(self, nodes: Sequence[fx.Node], inputs: set[fx.Node]) -> None:
        self._first: dict[object, fx.Node] = {}
        seen: dict[object, int] = {}
        for node in nodes:
            key = self.storage(node)
            if key is None:
                continue
            self._first.setdefault(key, node)
            if node in inputs:
                seen[key] = seen.get(key, 0) + 1
        self.shared = {key for key, count in seen.items() if count > 1}

    @staticmethod
    def storage(node: fx.Node) -> object | None:
        """The storage ``node``'s fake value lives in (``None`` when it has none)."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            return None
        try:
            return StorageWeakRef(val.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def __call__(self, node: fx.Node) -> fx.Node:
        key = self.storage(node)
        return self._first.get(key, node) if key is not None else analysis.storage_root(node)

    def is_shared(self, node: fx.Node) -> bool:
        """Whether ``node`` lives in a storage that several inputs of the fused graph live in."""
        return self.storage(node) in self.shared


def _fused_region(plan: Plan, run: list[Step], regions: list[RegionPlan], providers: dict,
                  unguarded: frozenset[fx.Node] = frozenset()) -> RegionPlan:
    members = {n for r in regions for n in r.nodes}
    sync_nodes = {s.payload for s in run if s.kind != StepKind.REGION}
    lanes = {r.lane for r in regions}
    hoisted, recomputed = _hoisted(regions, members, providers, unguarded) if len(lanes) > 1 else ([], {})
    moved = set(hoisted)
    _check_hoist_ordered(run, {n for n in moved if _is_tensor(n)})
    key = next(_keys)

    b = RegionBuilder(members, lambda n: KeepRegions(f"%{n.name} is read before it is computed"))
    graph, env = b.graph, b.env
    split: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    points: list[SyncPoint] = []
    # NOTE: a view taken before a point whose guard covers its storage, and read after it,
    # makes functionalization rebuild the view from the written base (an as_strided of it,
    # which Inductor may realise as a copy, on either lane). Views cost nothing: each read
    # after a point takes its view again, from the base as it is then.
    epoch: dict[fx.Node, int] = {}
    retaken: dict[tuple[fx.Node, int], fx.Node] = {}

    def arg(n: fx.Node) -> fx.Node:
        if n not in members or epoch.get(n, len(points)) == len(points) or not _is_view(n):
            return b.arg(n)
        k = (n, len(points))
        if k not in retaken:
            retaken[k] = b.duplicate(n, arg)
        return retaken[k]

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
            epoch[node] = len(points)
            return
        if analysis.is_getitem(node) and node.args[0] in split:
            env[node] = split[node.args[0]][node.args[1]]
            return
        b.copy(node, arg)
        epoch[node] = len(points)
    all_nodes = [n for r in regions for n in r.nodes]
    b.bind_sizes(all_nodes, providers)

    def size_input(symbol: sympy.Symbol) -> fx.Node:
        source = providers[symbol]
        if isinstance(source.meta.get("val"), torch.SymInt):
            return b.arg(source)
        dim = next(d for d, n in enumerate(source.meta["val"].shape)
                   if isinstance(n, torch.SymInt) and n.node.expr == symbol)
        return graph.call_function(torch.ops.aten.sym_size.int, (b.arg(source), dim))

    for node in hoisted:
        if node in recomputed:
            env[node] = _size_node(graph, recomputed[node], size_input)
        else:
            copy(node)
    # Every point writes this token: the points keep their order among themselves, and a point
    # that guards nothing else is still a write (functionalization drops an op that writes nothing).
    device = next(v.device for n in all_nodes if isinstance(v := n.meta.get("val"), torch.Tensor))
    token = graph.call_function(torch.ops.aten.empty.memory_format, ([0],), {"dtype": torch.uint8, "device": device})

    pending: list[Step] = []
    since: list[fx.Node] = []
    first: list[fx.Node] = list(hoisted)  # guarded by the first point, which they run before
    lane = 0

    inputs = {a for n in all_nodes for a in n.all_input_nodes
              if a not in members and _is_tensor(a) and hops.module_attr(a) is None}
    # A release or retention of the run reads its values as inputs of the fused graph too: a
    # view read by a region and its base released on another lane are two inputs of one storage
    # (DeBERTa-v2's keys on the H200, whose guarded view made AOT autograd build a synthetic base,
    # which failed under dynamic shapes).
    inputs |= {a for st in run if st.kind in (StepKind.RELEASE, StepKind.RETAIN)
               for a in st.payload.all_input_nodes if a not in members and _is_tensor(a)}
    _root = _Roots([n for n in plan.graph.graph.nodes if n in members or n in inputs], inputs)
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
        # NOTE: not only the values nothing after them in the block reads: Inductor inlines a
        # value into its readers and computes its buffer where a later reader needs it, so a
        # value read after the point is guarded too, which makes its buffer exist before the
        # point (Phi's layer norm: the normalised copy moved past the record its reader waits for).
        wanted += [n for n in since if _is_tensor(n) and any(u not in done for u in n.users)]
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
            if _is_tensor(root) and root not in guards and root not in unguarded:
                if _root.is_shared(root):
                    raise KeepRegions(f"%{n.name} shares its storage with another input of the run and "
                                       "cannot be guarded")
                guards.append(root)
        # Read: what a release or a retention takes, and what is held.
        # NOTE: a value both read and guarded by one call is copied. A release of a storage the
        # next region reads needs no read: that region's read holds the value past the point
        # anyway (the allocator frees at the last reference). A retention of one keeps the lane
        # regions.
        reads: list[fx.Node] = []
        takes: list[int] = []
        for st in pending:
            values = [a for a in st.payload.all_input_nodes if analysis.carries_tensor(a)] \
                if st.kind in (StepKind.RELEASE, StepKind.RETAIN) else []
            if st.kind == StepKind.RELEASE:
                values = [v for v in values if _root(v) not in needed]
            clash = next((v for v in values if _root(v) in needed), None)
            if clash is not None:
                raise KeepRegions(f"%{clash.name} is both retained and read by the next region")
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
    gm = b.finish(outputs, arg)
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
    with config.patch({k: False for k in LANE_BLIND if hasattr(config, k)}):
        yield
