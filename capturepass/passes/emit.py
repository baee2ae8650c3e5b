"""emit: cuts the annotated graph into regions and steps, and hands over the plan.

The annotated graph is cut into *regions*: maximal runs of one lane's nodes
between that lane's sync points (a record after a producer, a wait before a
consumer), segment boundaries and breaks. Each region becomes a standalone FX
graph, stripped of every capturepass and hint tag, to be compiled by the inner
compiler (Inductor, eager, or Torch-TensorRT); regions without a kernel (only
views and tuple selections), and breaks, which run eagerly between segments, are
marked for the eager compiler. A collective is a region of its own, run by
the eager compiler: the runtime redirects it to the communicator of the owner
that runs it (it names its process group by a string the inner compiler would
bake in). The plan (``capturepass.ir.plan``) lists the
regions in the order the outer program calls them (each at the point where its
lane closes it), with the ``capturepass::`` ops in between: records, waits,
releases, retentions and external joins. The backend compiles the regions; the
runtime binds the plan to one graph owner's lanes.

Before (annotated ATen graph)::

    %mm   = aten.mm(%x, %w)     {lane=s1}
    %record = capturepass.record(0, 1) {lane=s1, record=e0, lease=l0}
    %wait = capturepass.wait(0, 0)     {lane=s0, wait=e0, lease=l0}
    %add  = aten.add(%mm, %y)   {lane=s0}

After (the outer program the plan describes)::

    %r0 = region_0(%x, %w)       {lane=s1}
    %mm = getitem(%r0, 0)
    %record = capturepass.record(0, 1)
    %wait = capturepass.wait(0, 0)
    %r1 = region_1(%mm, %y)      {lane=s0}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx

from capturepass.errors import EmitError
from capturepass.ir import analysis, collectives, hops, meta
from capturepass.ir.meta import MAIN_LANE, Effect, LaneId
from capturepass.ir.plan import Plan, RegionPlan, Step, StepKind
from capturepass.passes.base import EMITTED, VERIFIED, Pass, PassContext


@dataclasses.dataclass
class _Region:
    lane: LaneId
    segment: int | None
    eager_break: bool
    nodes: list[fx.Node] = dataclasses.field(default_factory=list)


def _has_kernel(region: _Region) -> bool:
    for node in region.nodes:
        if analysis.is_getitem(node) or analysis.aliases_input(node) is not None:
            continue
        if not analysis.carries_tensor(node) and meta.info(node).brk is None:
            continue
        return True
    return False


def _allocating_lanes(region: _Region) -> list[LaneId]:
    """Other lanes that allocated storage this region reads from outside itself."""
    members = set(region.nodes)
    lanes: set[LaneId] = set()
    for node in region.nodes:
        for arg in node.all_input_nodes:
            if arg in members:
                continue
            root = analysis.storage_root(arg)
            if meta.effect_of(root) is Effect.COMPUTE and meta.lane_of(root) != region.lane:
                lanes.add(meta.lane_of(root))
    return sorted(lanes)


def _plan(gm: fx.GraphModule, merge_lanes: bool = False) -> list[Step]:
    """Cuts the program order into regions and sync steps.

    With ``merge_lanes`` (a host graph, whose lanes run in program order) a region is a whole
    segment: every lane's nodes in program order, one compile; records, waits and releases
    order nothing there and are left out. A collective is a region of its own either way.
    """
    steps: list[Step] = []
    open_regions: dict[LaneId, _Region] = {}
    region_of: dict[fx.Node, _Region] = {}

    deferred: dict[LaneId, list[Step]] = {}

    def close(lane: LaneId) -> None:
        region = open_regions.pop(lane, None)
        if region is not None and region.nodes:
            # NOTE: the caller frees a value right after its last use in the outer program.
            # insert_syncs and the verifier judged each free in program order, where every
            # node of the allocating lane that precedes the read is already issued. That
            # lane's open region holds such nodes; issue it first, or they would allocate
            # after the free and could reuse the block while this region still reads it.
            for other in _allocating_lanes(region):
                if other in open_regions:
                    close(other)
            steps.append(Step(StepKind.REGION, lane=lane, payload=region))
        steps.extend(deferred.pop(lane, ()))

    def close_all() -> None:
        for lane in sorted(open_regions):
            close(lane)

    for node in gm.graph.nodes:
        eff = meta.effect_of(node)
        rec = meta.info(node)
        if eff in (Effect.INPUT, Effect.CONSTANT):
            continue
        if eff is Effect.OUTPUT:
            close_all()
            continue
        lane = MAIN_LANE if merge_lanes else meta.lane_of(node)
        if merge_lanes and eff in (Effect.RECORD, Effect.WAIT, Effect.RELEASE):
            continue
        if eff in (Effect.RECORD, Effect.WAIT):
            close(lane)
            steps.append(Step(StepKind(eff.value), lane=lane, payload=node))
            continue
        if eff in (Effect.RETAIN, Effect.EXTERNAL):
            # Retention belongs to the capture of its segment: after every region of it. An
            # external join is a segment boundary: before or after every region of it.
            close_all()
            steps.append(Step(StepKind(eff.value), lane=lane, payload=node))
            continue
        if eff is Effect.RELEASE:
            # A release only extends a lifetime; FX frees at the later of it and the last use,
            # and a later free is always safe, so it needs no region boundary. NOTE: it must not
            # run earlier than its place, though: the open region of its lane holds nodes that
            # precede it and is issued only when it closes; freeing before them would let them
            # reuse the block while another lane still reads it. So it waits for that region.
            step = Step(StepKind(eff.value), lane=lane, payload=node)
            if lane in open_regions:
                deferred.setdefault(lane, []).append(step)
            else:
                steps.append(step)
            continue
        if rec.brk is not None:
            close_all()
            region = _Region(lane, None, eager_break=True, nodes=[node])
            region_of[node] = region
            steps.append(Step(StepKind.REGION, lane=lane, payload=region))
            continue
        if analysis.is_getitem(node) and node.args[0] in region_of:
            # Tuple selection is metadata: keep it with its producer, even across a sync.
            parent_region = region_of[node.args[0]]
            parent_region.nodes.append(node)
            region_of[node] = parent_region
            continue
        for a in node.all_input_nodes:
            src = region_of.get(a)
            if src is not None and src.lane != lane and open_regions.get(src.lane) is src:
                # NOTE: a host value (a scalar from .item(), a size) crosses lanes without an
                # event, so no sync step closed its producer's region: close it now, or the
                # reader's region would be emitted first and read a value not yet computed.
                close(src.lane)
        seg = rec.segment.index if rec.segment is not None else None
        if collectives.is_collective(node):
            # Alone in its region: the runtime binds it to each owner's communicator. It keeps
            # its own lane with merged lanes too: the communicator is the owner's for that lane
            # (the dump's comm:<group>@<owner>/<lane>), whichever way the host runs it.
            close(lane)
            region = _Region(meta.lane_of(node), seg, eager_break=False, nodes=[node])
            region_of[node] = region
            steps.append(Step(StepKind.REGION, lane=region.lane, payload=region))
            continue
        region = open_regions.get(lane)
        if region is None or region.segment != seg:
            close(lane)
            region = open_regions[lane] = _Region(lane, seg, eager_break=False)
        region.nodes.append(node)
        region_of[node] = region
    close_all()
    return steps


_SYNC = (Effect.RECORD, Effect.WAIT, Effect.RELEASE)


def _sym_exprs(val: object) -> list:
    """The sympy expressions of a value's symbolic sizes and strides (of a SymInt: itself)."""
    if isinstance(val, torch.SymInt):
        return [val.node.expr]
    if isinstance(val, torch.Tensor):
        return [d.node.expr for d in (*val.size(), *val.stride()) if isinstance(d, torch.SymInt)]
    if isinstance(val, (tuple, list)):
        return [e for v in val for e in _sym_exprs(v)]
    return []


def _binds(val: object) -> list:
    """The size symbols an input whose fake value is ``val`` binds in Inductor on its own.

    A tensor binds each symbol that is a whole size or stride of it. A SymInt binds the symbol
    it was created as, which Inductor reads before the shape environment's replacements: a
    SymInt created as ``s72`` and since found equal to ``s43`` (DeBERTa-v2's attention-mask
    batch, under the input ids' batch) prints as ``s43`` but binds ``s72``, so a region given
    it for ``s43`` failed Inductor's codegen ("expected [s43] to have been codegen-ed").
    """
    if isinstance(val, torch.SymInt):
        expr = val.node.expr
        created = getattr(val.node, "_expr", expr)
        return [expr] if created == expr and getattr(expr, "is_Symbol", False) else []
    return [e for e in _sym_exprs(val) if getattr(e, "is_Symbol", False)]


def symbol_providers(gm: fx.GraphModule) -> dict[object, fx.Node]:
    """Graph inputs that bind a size symbol on their own (:func:`_binds`): a SymInt input that
    is the symbol, else a tensor input with the symbol as a whole size or stride (first found
    wins)."""
    providers: dict[object, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for want_symint in (True, False):
        for n in placeholders:
            val = n.meta.get("val")
            if isinstance(val, torch.SymInt) != want_symint:
                continue
            for expr in _binds(val):
                providers.setdefault(expr, n)
    return providers


def unbound_symbols(nodes: list[fx.Node], members: set[fx.Node]) -> set:
    """Size symbols the values of ``nodes`` (a region, whose nodes are ``members``) use that
    none of its inputs binds by itself.

    Inductor binds a symbol from an input that is the symbol (a SymInt) or has it as a whole
    size or stride; a region that only sees ``s0*s1`` (a flattened activation cut from the
    graph that reshaped it) cannot recover ``s0`` and ``s1`` and fails to generate code.
    """
    used, bound = set(), set()
    for node in nodes:
        for expr in _sym_exprs(node.meta.get("val")):
            used |= expr.free_symbols
        for a in node.all_input_nodes:
            if a in members:
                continue
            for expr in _sym_exprs(a.meta.get("val")):
                used |= expr.free_symbols
            bound.update(_binds(a.meta.get("val")))
    return used - bound


def _region_graph(
    region: _Region, needed_outside: set[fx.Node], providers: dict[object, fx.Node] | None = None
) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A standalone graph for one region: external values become placeholders.

    Modules named by ``get_attr`` (subgraphs of higher-order ops) stay ``get_attr`` nodes, on a
    root that holds them; tensor constants are placeholders like any other outside value. Size
    symbols the region's inputs do not bind are passed in from the graph inputs that do
    (``providers``): host values, or a tensor read for its size only.
    """
    members = set(region.nodes)
    b = RegionBuilder(members, lambda n: EmitError(f"region on {region.lane}: %{n.name} is used before it is computed"))
    if providers:
        b.bind_sizes(region.nodes, providers)
    for node in region.nodes:
        b.copy(node)
    outputs = [n for n in region.nodes if n in needed_outside]
    return b.finish(outputs), b.inputs, outputs


class RegionBuilder:
    """Builds a standalone graph from nodes of the annotated graph: values from outside become
    placeholders (``inputs``, in order), modules named by ``get_attr`` stay on its root.

    Args:
        members: the nodes the graph computes.
        early: the error to raise when a member is read before it is copied.
    """

    _KEEP = ("val", "tensor_meta", "stack_trace", "nn_module_stack", "seq_nr")

    def __init__(self, members: set[fx.Node], early: "Callable[[fx.Node], Exception]") -> None:
        self.members = members
        self.early = early
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[fx.Node] = []
        self.modules: dict[str, torch.nn.Module] = {}

    def arg(self, n: fx.Node) -> fx.Node:
        """The new graph's node for ``n`` (a placeholder on first use of an outside value)."""
        if n in self.env:
            return self.env[n]
        if n in self.members:
            raise self.early(n)
        module = hops.module_attr(n)
        if module is not None:
            # A higher-order op (cond, while_loop, invoke_subgraph) names its subgraphs by
            # get_attr and Inductor lowers them from the graph's root module: the module
            # travels with the region, never as a runtime argument (which has no example value).
            self.modules[n.target] = module
            self.env[n] = self.graph.get_attr(n.target)
            return self.env[n]
        ph = self.graph.placeholder(n.name)
        ph.meta["val"] = analysis.fake_value(n)
        self.env[n] = ph
        self.inputs.append(n)
        return ph

    def bind_sizes(self, nodes: list[fx.Node], providers: dict[object, fx.Node]) -> None:
        """Passes in the graph inputs that bind the size symbols ``nodes`` use and their own
        inputs do not (see :func:`unbound_symbols`)."""
        for symbol in sorted(unbound_symbols(nodes, self.members), key=str):
            if symbol in providers and providers[symbol] not in self.members:
                self.arg(providers[symbol])

    def copy(self, node: fx.Node, arg: Callable[[fx.Node], fx.Node] | None = None) -> fx.Node:
        """Copies ``node`` into the graph as its copy (inputs mapped by ``arg``, :meth:`arg` by default)."""
        self.env[node] = self.duplicate(node, arg or self.arg)
        return self.env[node]

    def duplicate(self, node: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """A new node of the graph computing ``node`` (inputs mapped by ``arg``), not recorded as its copy."""
        for a in node.all_input_nodes:
            arg(a)  # placeholders in the order the inputs are first read
        new = self.graph.node_copy(node, arg)
        new.meta = {k: v for k, v in node.meta.items() if k in self._KEEP}
        return new

    def finish(self, outputs: list[fx.Node], arg: Callable[[fx.Node], fx.Node] | None = None) -> fx.GraphModule:
        """The graph module returning ``outputs`` (a tuple; mapped by ``arg``, the copies by default)."""
        self.graph.output(tuple(arg(n) if arg else self.env[n] for n in outputs))
        return fx.GraphModule(self.modules if self.modules else torch.nn.Module(), self.graph)


class Emit(Pass):
    """Cuts the annotated graph into regions and steps; the plan goes to ``ctx.artifacts["plan"]``."""

    name = "emit"
    requires = (VERIFIED,)
    ensures = (EMITTED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        # NOTE: on the host every lane runs in program order (there are no streams), so a
        # segment is one region and one compile: Inductor fuses across what would be lanes on a
        # GPU, and the outer program calls one function. Option regions="lanes" keeps the
        # per-lane regions a CUDA graph gets, to inspect or test them without a GPU.
        merge = ctx.options.regions in ("auto", "fused") and not meta.graph_info(gm).on_cuda
        if merge:
            ctx.count(self.name, "merged_lanes")
        steps = _plan(gm, merge_lanes=merge)
        regions = [s.payload for s in steps if s.kind == StepKind.REGION]
        owner_of = {n: r for r in regions for n in r.nodes}
        needed: dict[int, set[fx.Node]] = {id(r): set() for r in regions}
        kept = {id(s.payload) for s in steps if s.kind != StepKind.REGION}
        for node in gm.graph.nodes:
            mine = owner_of.get(node)
            if mine is None and meta.effect_of(node) in _SYNC and id(node) not in kept:
                # A sync op the plan left out (merged lanes order nothing): reading a value
                # there must not make its region return it, or every value a release or an
                # event names would leave the region as an output, never reused in it.
                continue
            for a in node.all_input_nodes:
                src = owner_of.get(a)
                if src is not None and src is not mine:
                    needed[id(src)].add(a)
        planned: dict[int, RegionPlan] = {}
        providers = symbol_providers(gm)
        for i, region in enumerate(regions):
            rgm, inputs, outputs = _region_graph(region, needed[id(region)], providers)
            kernels = _has_kernel(region)
            # NOTE: a break runs eagerly between captured segments, outside any graph: the inner
            # compiler would only wrap its one op in a fallback call, and tracing an opaque op
            # alone can fail (torch 2.11's Inductor raised "Attempting to use FunctionalTensor on
            # its own" on transformers' grouped_mm_fallback as a region of its own).
            groups = tuple(dict.fromkeys(g for n in region.nodes if (g := collectives.group_of(n)) is not None))
            talking = any(collectives.is_collective(n) or collectives.is_wait(n) for n in region.nodes) and all(
                collectives.is_collective(n) or collectives.is_wait(n) or analysis.is_getitem(n) for n in region.nodes)
            # NOTE: a region of collectives and waits only calls into the process group: nothing
            # for an inner compiler to generate.
            compiler = ctx.options.inner if kernels and not region.eager_break and not talking else "eager"
            planned[id(region)] = RegionPlan(
                index=i,
                lane=region.lane.index,
                segment=region.segment,
                eager=region.eager_break,
                nodes=list(region.nodes),
                inputs=inputs,
                outputs=outputs,
                graph=rgm,
                compiler=compiler,
                kernels=kernels,
                groups=groups,
            )
            ctx.count(self.name, f"regions_{compiler}")
        for step in steps:
            if step.kind == StepKind.REGION:
                step.payload = planned[id(step.payload)]
        ctx.artifacts["plan"] = Plan(gm, steps)
        ctx.count(self.name, "regions", len(regions))
