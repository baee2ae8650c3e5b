"""The compile driver: the one way a graph goes through capturepass's passes.

:func:`compile_graph` takes an ATen graph (from AOT autograd, from vLLM's
post-grad pass manager, from a test or a benchmark), resolves the options once
for it (:meth:`Options.for_graph`), seeds its graph record, runs a named
sub-pipeline through the pass manager with the instruments the options ask for
(timing and decision logs always; verify-each with ``verify``; dumps with
``dump_dir``), compiles the regions of the plan ``emit`` handed over with the
inner compiler, and returns a :class:`CompiledGraph`: the annotated graph, the
plan, the runtime's :class:`~capturepass.runtime.program.Program`, counters,
timings and the resolved options. :func:`run_front` does the same for the
Dynamo-stage passes.

This module (with the rest of ``capturepass.backends``) is the only place where
passes and runtime meet: ``emit`` produces a plan as IR data, the driver
compiles its regions, and the runtime binds the result to graph owners.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.backends import fused_inductor
from capturepass.backends import inline as inline_segments
from capturepass.backends import inner as inner_compilers
from capturepass.backends.inline_check import CodeCapture, findings
from capturepass.errors import EmitError, is_dynamo_control_flow, is_dynamo_signal
from capturepass.ir import analysis, meta
from capturepass.ir.capabilities import REGISTRY, CapabilityRegistry
from capturepass.ir.meta import Break, CaptureMode, GraphInfo, OwnerId
from capturepass.ir.options import Options
from capturepass.ir.plan import Plan, RegionPlan, StepKind
from capturepass.passes import instruments as inst
from capturepass.passes.base import PassContext
from capturepass.passes.pipeline import ATEN, FRONT, default_pipeline, position, run_pipeline
from capturepass.runtime.layouts import ExactLayouts
from capturepass.runtime.program import Program, describe

log = logging.getLogger("capturepass")

_owner_ids = itertools.count()
_lock = threading.Lock()


def new_owner() -> OwnerId:
    """A fresh graph owner id (one per compiled graph)."""
    with _lock:
        return OwnerId(next(_owner_ids))


@dataclasses.dataclass
class CompiledGraph:
    """What capturepass produced for one ATen graph (kept for inspection and tests).

    Attributes:
        name: ``"inference"``, ``"forward"``, ``"backward"`` (or a route's own name).
        graph: the annotated ATen graph after the last pass.
        plan: what ``emit`` planned (``None`` when the pipeline stopped before it).
        program: the compiled outer program (``None`` without a plan, or when regions
            were not compiled).
        counters: per-pass counters.
        timings: seconds per pass.
        dump_dir: where its dumps were written, if anywhere.
        options: the graph's resolved options.
        context: the pass context the pipeline ran with.
    """

    name: str
    graph: fx.GraphModule
    plan: Plan | None
    program: Program | None
    counters: dict
    timings: dict
    dump_dir: str | None
    options: Options
    context: PassContext
    _executor: Any = None

    @property
    def executor(self) -> Any:
        """The compiled callable's executor while it is alive (held weakly), else ``None``."""
        return None if self._executor is None else self._executor()

    def attach(self, executor: Any) -> None:
        """Records the executor that runs this graph (weakly: the record must not keep
        captured graphs and their pools alive)."""
        self._executor = weakref.ref(executor)


_last_compiled: collections.deque[CompiledGraph] = collections.deque(maxlen=32)


def last_compiled() -> list[CompiledGraph]:
    """The graphs of recent compiles in this process, oldest first (at most 32)."""
    return list(_last_compiled)


def on_cuda(example_inputs: Iterable[Any]) -> bool:
    """Whether any example input is a CUDA tensor."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


def resolve(options: Options | Mapping[str, Any] | None) -> Options:
    """Validated options from a mapping (environment defaults filled in), or options as given."""
    if isinstance(options, Options):
        return options
    return Options.from_mapping(options)


def inline_route(opts: Options, plan: Plan) -> bool:
    """Whether ``plan``'s capture segments compile once each, their lanes inline:
    ``regions="segments"``, or ``"auto"`` on CUDA (on the host, ``"auto"`` already plans one
    region per segment)."""
    return opts.regions == "segments" or (opts.regions in ("auto", "fused") and meta.graph_info(plan.graph).on_cuda)


def fused_route(opts: Options, plan: Plan) -> str | None:
    """Why ``plan``'s lanes are not written into one lane's compile after fusion
    (``backends.fused_lanes``), or ``None``: they are. That route is taken by
    ``regions="fused"`` (on the host too, where the lanes run in program order: to read and run
    the code a GPU would), and by ``"auto"`` on CUDA, for a graph of more than one lane whose
    regions Inductor compiles; a reason is worth logging only where it says ``unavailable``."""
    info = meta.graph_info(plan.graph)
    asked = opts.regions == "fused" or (opts.regions == "auto" and info.on_cuda)
    if not asked or len(info.lanes) < 2:
        return "not asked for"
    if any(r.compiler != "inductor" for r in plan.regions if r.kernels and not r.eager):
        return "not asked for"
    why = fused_inductor.unavailable()
    return f"unavailable: {why}" if why is not None else None


def votes_for_lane(node: fx.Node) -> bool:
    """Whether ``node``'s lane counts toward the lane of a fused kernel it is an origin of (lanes
    after fusion): a compute node that is not a view. A view launches nothing, and Inductor counts
    one among the origins of the kernel that reads it: the MoE block's plan reads the experts' up
    projection through a ``split`` on the main lane, whose vote moved the experts' activation and
    down projection there."""
    return meta.has_info(node) and meta.effect_of(node) is meta.Effect.COMPUTE and analysis.aliases_input(node) is None


def compile_fused(model: Plan, one_lane: Plan, opts: Options, eager_fallback: bool = False) -> Program:
    """One lane's program, its kernels put on ``model``'s lanes after fusion.

    ``one_lane`` is the plan of the same graph with one lane (``policy="off"``); its regions are
    compiled once, each with its generated ``call`` rewritten (``backends.fused_lanes``): every
    fused kernel takes the lane the cost model gave its FX nodes in ``model``, where they agree,
    else the main lane. The program runs one lane's code on an owner without side streams and
    the lanes' code on one with them, so every schedule candidate of the graph is this one
    compile (``backends.candidates``).
    """
    graph = model.graph
    lane_by_name = {n.name: meta.lane_of(n).index for n in graph.graph.nodes if votes_for_lane(n)}
    lanes = len(meta.graph_info(graph).lanes)
    with fused_inductor.Compiling(lane_by_name, host=not meta.graph_info(graph).on_cuda) as rewrites:
        program = compile_regions(one_lane, eager_fallback=eager_fallback, inline=inline_route(opts, one_lane))
    done = rewrites.summaries
    launches = sum(r.launches for r in done)
    side = sum(r.side for r in done)
    title = meta.graph_info(graph).title
    program.fused = True
    if rewrites.findings:
        log.warning("capturepass: %s: lanes after fusion left out of a compile whose rewrite the order check "
                    "faults or that it cannot read (%s); that code runs on one lane", title, rewrites.findings[0])
    if side == 0:
        log.info("capturepass: %s: no fused kernel of one lane's compile lies on a side lane alone (%d launches); "
                 "it runs on one lane", title, launches)
        return program
    program.code_lanes = lanes
    program.lanes_code = list(rewrites.codes)
    # Owners, dumps and measurements see the lanes the code runs on: the cost model's.
    program.info = meta.graph_info(graph)
    what = (f"one Inductor compile with lanes after fusion: {side} of {launches} launches on side lanes, "
            f"{sum(r.switches for r in done)} lane switches, {sum(r.records for r in done)} events, "
            f"{sum(r.held for r in done)} frees held to the join, {sum(r.moved for r in done)} moved to a later wait")
    log.info("capturepass: %s: %s", title, what)
    meta.add_decision(graph, what)
    return program


def compile_regions(plan: Plan, eager_fallback: bool = False, inline: bool = False) -> Program:
    """Compiles every region of ``plan`` with its inner compiler; the runtime's program.

    Args:
        plan: what ``emit`` planned.
        eager_fallback: every region the inner compiler fails on runs its FX graph eagerly
            instead, with a logged warning (for a rebuild at run time, where a compile error
            would end the call). Without it, a region of a plan of several regions falls back
            too: a piece cut out of the graph can meet an inner-compiler error the whole graph
            does not (Inductor's tiling refused the first segment of Inkling2's loop model, a
            graph it compiles whole); the only region of a plan, the graph the inner compiler
            would be given without capturepass, reports the error.
        inline: compile each run of a capture segment's lane regions once, its lanes inline
            (``capturepass.backends.inline``); a run that cannot be, or whose compile fails,
            keeps its lane regions, with the reason logged.

    Raises:
        EmitError: an inner compiler failed on a region (Dynamo's own signals pass through).
    """
    info = meta.graph_info(plan.graph)
    title = info.title
    replaced: dict[int, list] = {}
    if inline:
        fused = inline_segments.fuse(plan)
        for why in fused.kept:
            log.info("capturepass: %s: %s; compiled as lane regions", title, why)
        plan, replaced = fused.plan, fused.replaced
    fns: dict[int, Callable[..., Sequence[Any]]] = {}
    steps = []
    for step in plan.steps:
        if step.kind != StepKind.REGION or step.payload.index not in replaced:
            steps.append(step)
            continue
        region = step.payload
        try:
            with inline_segments.lane_safe_inductor(region), CodeCapture() as code:
                fn = _compile_region(region, title, eager_fallback=False)
            found = findings(code.codes, region.inline.points) if region.inline is not None else []
            why = f"fails its lane checks ({found[0]})" if found else None
        except Exception as exc:
            if is_dynamo_control_flow(exc):
                raise
            # Inductor's own errors come as Dynamo's formatted errors: a failure of this
            # compile, which the lane regions may not share.
            why = f"failed ({str(exc).splitlines()[0]})"
        if why is None:
            fns[region.index] = fn
            steps.append(step)
            continue
        kept = sum(s.kind == StepKind.REGION for s in replaced[region.index])
        log.warning("capturepass: %s: one compile of %d lane regions %s; compiled as lane regions instead",
                    title, kept, why)
        steps.extend(replaced[region.index])
    fallback = eager_fallback or sum(step.kind == StepKind.REGION for step in steps) > 1
    for step in steps:
        if step.kind == StepKind.REGION and step.payload.index not in fns:
            fns[step.payload.index] = _compile_region(step.payload, title, fallback, plan.graph)
    return Program(Plan(plan.graph, steps), fns)


def _compile_region(region: RegionPlan, title: str, eager_fallback: bool,
                    graph: fx.GraphModule | None = None) -> Callable[..., Sequence[Any]]:
    """``region`` compiled with its inner compiler; where that fails and ``eager_fallback``
    allows, its FX graph run eagerly, logged and (with ``graph``, the annotated graph) written
    among ``graph``'s decisions, which its dump and ``show`` list."""
    example = [analysis.fake_value(n) for n in region.inputs]
    compiler = region.compiler
    try:
        fn = inner_compilers.compile_region(region.graph, example, compiler)
    except Exception as exc:
        if is_dynamo_control_flow(exc):
            raise  # Dynamo's own control flow (a restart, a skipped frame): not a failure
        names = ", ".join(f"%{n.name}" for n in region.nodes[:4])
        what = (f"the {compiler} compiler failed on region {region.index} (lane s{region.lane}: "
                f"{names}...): {type(exc).__name__}: {exc}")
        if not eager_fallback or compiler == "eager":
            if is_dynamo_signal(exc):
                raise  # Dynamo formats its own errors (Inductor's InductorError is one)
            raise EmitError(what) from exc
        log.warning("capturepass: %s: %s; the region runs its graph eagerly instead", title, what.splitlines()[0])
        if graph is not None:
            meta.add_decision(graph, f"{what.splitlines()[0][:300]}; the region runs its graph eagerly",
                              logging.WARNING)
        compiler = "eager"
        fn = inner_compilers.compile_region(region.graph, example, compiler)
    if compiler != "eager":
        # NOTE: a compiled region may return another layout than its fake values say, and
        # each consumer region is compiled for (and asserts) those: keep them exact.
        exact = ExactLayouts(fn, example, [analysis.fake_value(n) for n in region.outputs],
                             f"region {region.index} of the {title}")
        if exact.needed:
            fn = exact
    return fn


def _instruments(
    dumps: bool, dump_dir: str | None, verify: bool, log_decisions: bool = True
) -> tuple[list[inst.PassInstrument], inst.Timing, inst.Dump | None]:
    timing = inst.Timing()
    out: list[inst.PassInstrument] = [timing]
    if log_decisions:
        out.append(inst.LogDecisions())
    if verify:
        out.append(inst.VerifyEach())
    trace = log_decisions and inst.structured_trace_on()
    dump = inst.Dump(dump_dir, position, trace=trace) if dumps or trace else None
    if dump is not None:
        out.append(dump)
    return out, timing, dump


def run_front(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options | Mapping[str, Any] | None = None,
    registry: CapabilityRegistry = REGISTRY, dump: bool = True,
) -> list[tuple[str, str]]:
    """Runs the Dynamo-stage passes (``FRONT``) on Dynamo's graph; returns their dumps
    (``(file name, text)``, written later into each ATen graph's dump folder)."""
    opts = resolve(options)
    passes = default_pipeline(registry.key(), opts.disable, passes=FRONT)
    ctx = PassContext(options=opts, registry=registry, example_inputs=list(example_inputs))
    instruments, _, dumper = _instruments(dump and opts.dump_dir is not None, None, False)
    run_pipeline(passes, gm, ctx, instruments)
    # Each ATen graph writes these into its own folder (and the trace) beside its own dumps.
    return list(dumper.dumps) if dumper is not None else []


def seed(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options | Mapping[str, Any] | None,
    name: str,
    *,
    owner: OwnerId | None = None,
    static_inputs: Iterable[int] = (),
    breaks: Sequence[Break] = (),
) -> Options:
    """Resolves the options of graph ``gm`` and gives it a graph record, unless it has one
    (a test's, or a copy kept for a rebuild); returns the resolved options."""
    cuda = on_cuda(example_inputs)
    opts = resolve(options).for_graph(name, cuda)
    if meta.META_KEY not in gm.meta:
        if not cuda and opts.cudagraphs != CaptureMode.NONE:
            log.info("capturepass: %s graph: cudagraphs=%r asks for CUDA graphs, but its tensors are not on a "
                     "CUDA device: it runs uncaptured", name, opts.cudagraphs.value)
        meta.set_graph_info(
            gm,
            GraphInfo(
                name=name,
                owner=owner if owner is not None else new_owner(),
                cudagraphs=opts.cudagraphs,
                on_cuda=cuda,
                static_inputs=frozenset(static_inputs),
                breaks=tuple(breaks),
                external=opts.external_streams,
            ),
        )
    return opts


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options | Mapping[str, Any] | None = None,
    *,
    name: str = "inference",
    owner: OwnerId | None = None,
    static_inputs: Iterable[int] = (),
    breaks: Sequence[Break] = (),
    passes: Sequence[type] = ATEN,
    upto: str | None = None,
    dump_dir: str | None = None,
    front_dumps: Sequence[tuple[str, str]] = (),
    verify: bool | None = None,
    registry: CapabilityRegistry = REGISTRY,
    not_capturable: Mapping[str, str] | None = None,
    regions: bool = True,
    record: bool = True,
    log_decisions: bool = True,
    one_lane: Callable[[], Plan] | None = None,
) -> CompiledGraph:
    """Runs capturepass on one ATen graph.

    Args:
        gm: the graph (changed in place: the annotated graph). A graph that has a graph record
            already (a test's, a rebuild's copy) keeps it; otherwise one is seeded from the
            resolved options.
        example_inputs: its example inputs (fake tensors).
        options: capturepass options, or a mapping of them (environment defaults filled in).
        name: the graph's kind: ``"inference"``, ``"forward"``, ``"backward"``, or a route's name.
        owner: its graph owner (a fresh one by default).
        static_inputs: placeholder positions whose storage the caller keeps fixed.
        breaks: breaks that happened before capturepass (Dynamo's).
        passes: the named sub-pipeline to run (``ATEN``, ``ANALYSIS``, ...).
        upto: stop after the pass of this name.
        dump_dir: this graph's dump folder (by default none).
        front_dumps: the Dynamo-stage dumps to write beside this graph's.
        verify: run the verifier after every pass (default: the ``verify`` option).
        registry: the capability registry the passes ask.
        not_capturable: nodes to make breaks (node name -> reason), from a failed capture; the
            rebuild this asks for compiles each region eagerly where the inner compiler fails.
        regions: compile the plan's regions (off: stop at the plan).
        record: keep the result in :func:`last_compiled`.
        log_decisions: log the passes' decisions and write the dumps into the structured
            trace (off for a schedule candidate: the log and the trace tell of the graph
            that runs; a candidate's choice is logged when it is measured).
        one_lane: the plan of the same graph with one lane, made on demand: where
            :func:`fused_route` allows, the program is that plan's compile with this plan's
            lanes written in after fusion (:func:`compile_fused`).

    Raises:
        PipelineError, PassError, VerificationError, EmitError, CapturePassError: as the passes
            and the inner compiler raise them, naming the pass, node or region.
    """
    vals = list(example_inputs)
    opts = seed(gm, vals, options, name, owner=owner, static_inputs=static_inputs, breaks=breaks)
    pipeline = default_pipeline(
        registry.key(), opts.disable, passes=passes, upto=upto, established=meta.graph_info(gm).properties
    )
    ctx = PassContext(
        options=opts, registry=registry, example_inputs=vals, not_capturable=dict(not_capturable or {})
    )
    instruments, timing, dumper = _instruments(
        dump_dir is not None, dump_dir, opts.verify if verify is None else verify, log_decisions
    )
    run_pipeline(pipeline, gm, ctx, instruments)
    plan: Plan | None = ctx.artifacts.get("plan")
    program = None
    if plan is not None and regions:
        why = fused_route(opts, plan)
        if why is None and one_lane is None:
            why = "unavailable: the graph's one-lane plan cannot be made here"
        if why is None:
            program = compile_fused(plan, one_lane(), opts, eager_fallback=bool(not_capturable))
        else:
            if why.startswith("unavailable"):
                log.info("capturepass: %s: lanes after fusion %s; each capture segment is compiled with its lanes "
                         "inline", meta.graph_info(gm).title, why)
            program = compile_regions(plan, eager_fallback=bool(not_capturable), inline=inline_route(opts, plan))
        ctx.artifacts["program"] = program
        if dumper is not None:
            dumper.append("emit", "\n# outer program\n" + describe(program) + "\n")
            for k, code in enumerate(program.lanes_code):
                dumper.append("emit", f"\n# lanes after fusion: compiled region {k}'s code while its owner binds side "
                                      f"streams\n{code}")
    if dumper is not None:
        dumper.write(gm, front_dumps)
    compiled = CompiledGraph(name, gm, plan, program, ctx.counters, timing.timings, dump_dir, opts, ctx)
    if record:
        _last_compiled.append(compiled)
    return compiled


def dump_folder(dump_dir: str | os.PathLike | None, compile_id: int, name: str) -> str | None:
    """``<dump_dir>/NNN_<name>``: the dump folder of one compiled graph, or ``None``."""
    if dump_dir is None:
        return None
    return os.path.join(os.fspath(dump_dir), f"{compile_id:03d}_{name}")


_plans = itertools.count()  # owner ids of graphs planned on a copy (:func:`plan_lanes`)


def plan_lanes(graph: fx.Graph, options: Options | Mapping[str, Any] | None = None,
               ) -> tuple[dict[fx.Node, int], list[str]]:
    """The cost model's lane of each node of an Inductor post-grad graph that has a say in a fused
    kernel's lane (:func:`votes_for_lane`), planned by the passes on a copy (``graph`` is left as
    it is), and the lanes' names.

    What a pass that gives lanes to a compile it does not own reads: Inductor's own post-grad
    graph, whose nodes are the fused kernels' origins (``backends.fused_lanes``).
    """
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    inputs = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
    copy = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(graph, value_map))
    planned = compile_graph(fx.GraphModule(root, copy), inputs, resolve(options), name="post_grad",
                            owner=OwnerId(900_000 + next(_plans)), dump_dir=None, regions=False, record=False)
    lanes = {node: meta.lane_of(new).index for node, new in value_map.items() if votes_for_lane(new)}
    return lanes, list(meta.graph_info(planned.graph).lanes)
