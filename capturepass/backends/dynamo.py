"""The ``capturepass`` torch.compile backend.

Registered through the ``torch_dynamo_backends`` entry-point group, so that
``torch.compile(model, backend="capturepass", options={...})`` works without
importing capturepass. The backend

1. runs the Dynamo-stage passes on Dynamo's graph (stream regions become lane
   hints and are stripped),
2. hands the graph to AOT autograd, so that the remaining passes see functional
   ATen graphs with fake-tensor metadata,
3. runs the ATen-stage pipeline on each graph AOT autograd produces
   (inference, or forward and backward) through the compile driver
   (``capturepass.backends.compile``): the passes, ``emit``'s plan, the regions
   compiled by the inner compiler, and the outer program that runs them, which
   an :class:`~capturepass.runtime.executor.Executor` runs and captures (its
   owners named after the graph owner the dump prints, listed in the dump
   folder's ``owners.json``).

The backward graph runs on one lane and is not captured (``policy="off"``,
``cudagraphs="none"``); it is verified and dumped like the forward.

Before the ATen-stage passes run, the backend keeps a copy of the graph as AOT
autograd produced it, and gives the :class:`~capturepass.runtime.executor.Executor`
a ``rebuild`` callback: when a capture fails on an op that no capability
declared non-capturable, the executor names the node, and the callback re-runs
the pipeline on a fresh copy with that node a break (in the tracing context of
the original compile, so that Inductor sees the same shape environment), dumps
it again, and returns the new program.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch._inductor.decomposition  # noqa: F401  (the table _decompositions reads)
import torch.fx as fx

from capturepass.backends import candidates
from capturepass.backends import compile as driver
from capturepass.backends import inner as inner_compilers
from capturepass.backends.compile import CompiledGraph
from capturepass.errors import OptionError, is_dynamo_control_flow
from capturepass.ir import collectives, cost, meta
from capturepass.ir.meta import Break, BreakSource, CaptureMode
from capturepass.ir.options import Options
from capturepass.runtime import calibration, choices, files
from capturepass.runtime.calibration import CalibrationStore
from capturepass.runtime.executor import Executor
from capturepass.runtime.choices import PickRecord, ScheduleCache, append_record, default_cache_dir
from capturepass.runtime.pick import Picker

log = logging.getLogger("capturepass")

_compile_ids = itertools.count()
_seen_breaks: dict[str, int] = {}
_lock = threading.Lock()


def _dynamo_breaks(gm: fx.GraphModule) -> list[str]:
    """Why Dynamo cut its graph ``gm`` short, if it did.

    Dynamo attaches the reason it compiled each graph to the graph itself; a
    graph break is that graph's own, never one counted while another frame (or
    another backend) compiled.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None:  # pragma: no cover - older torch: fall back to the global counters
        return _new_dynamo_breaks()
    return [str(reason.reason)] if getattr(reason, "graph_break", False) else []


def _new_dynamo_breaks() -> list[str]:
    """Dynamo graph-break reasons counted since the previous compile."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return []
    new = []
    with _lock:
        for reason, n in counters.get("graph_break", {}).items():
            if n > _seen_breaks.get(reason, 0):
                new.append(str(reason))
                _seen_breaks[reason] = n
    return sorted(new)


def _static_input_indices() -> frozenset[int]:
    try:
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        fw_meta = getattr(tc, "fw_metadata", None) if tc is not None else None
        indices = getattr(fw_meta, "static_input_indices", None)
        return frozenset(indices or ())
    except Exception:  # the location of this metadata differs between torch versions
        return frozenset()


def _pristine_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that the passes run on leaves as it is: its own nodes, and node
    metadata copied one level deep (passes replace capturepass's records and pop hint tags
    out of ``meta["custom"]``; fake values are shared, never changed)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, env.__getitem__)
        new.meta = {k: (copy.deepcopy(v) if k == "custom" else v) for k, v in node.meta.items()}
        env[node] = new
    out = fx.GraphModule(gm, graph)
    meta.set_graph_info(out, meta.graph_info(gm))
    return out


def _tracing(tc: Any) -> contextlib.AbstractContextManager:
    """The tracing context of the original compile, re-entered for a rebuild (Inductor reads its shape environment)."""
    if tc is None:
        return contextlib.nullcontext()
    from torch._guards import tracing

    return tracing(tc)


@contextlib.contextmanager
def _recompiling(tc: Any) -> Iterator[None]:
    """Where a compile after the original one runs (a rebuild after a capture failed, a schedule
    candidate compiled at a capture): in the original compile's tracing context (Inductor reads
    its shape environment), outside the dispatch modes of the call it happens in.

    NOTE: AOT autograd runs a compiled graph's first call under a dispatch mode of its own
    (``_AnalyzeCustomOpInputOutputMode``, which checks custom ops for aliasing and declines
    every tensor subclass). An Inductor compile under it fails on the first op it traces
    ("Attempting to use FunctionalTensor on its own": the mode declines functionalization's
    tensors), so every region of a graph rebuilt during its first call ran eagerly.
    """
    if tc is not None and _tracing_context() is tc:
        yield  # inside the original compile: its own state
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), _tracing(tc):
        yield


def _tracing_context() -> Any:
    try:
        from torch._guards import TracingContext

        return TracingContext.try_get()
    except ImportError:  # pragma: no cover
        return None


def _dynamo_frame() -> int | None:
    """The id Dynamo gives the frame it compiles (one per code object; its recompilations for
    other shapes keep it), or ``None`` outside a Dynamo compile or where torch has none."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - an older or newer torch: graphs then keep their own memory
        return None
    frame = getattr(compile_id, "frame_id", None)
    return frame if isinstance(frame, int) else None


def _aten_compiler(
    kind: str, opts: Options, front_dumps: list[tuple[str, str]], compile_id: int, upstream: list[str],
    frame: int | None = None,
) -> Callable:
    def compile_aten(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        examples = list(example_inputs)
        graph_opts = driver.seed(
            gm, examples, opts, kind,
            static_inputs=_static_input_indices() if kind != "backward" else (),
            breaks=[Break(node="", reason=r, source=BreakSource.DYNAMO) for r in upstream],
        )
        dump_dir = driver.dump_folder(opts.dump_dir, compile_id, kind)
        # Kept for rebuilds after a capture failed on one op (never needed when nothing is captured).
        pristine = _pristine_copy(gm) if graph_opts.cudagraphs != CaptureMode.NONE else None
        # What the one-lane plan of lanes after fusion is made from (uncaptured graphs too).
        fused = driver.on_cuda(examples) or graph_opts.regions == "fused"
        source = pristine if pristine is not None or not fused else _pristine_copy(gm)

        # The cost model calibrated on this device by earlier measured choices (or the nominal one).
        device_model = _device_model(graph_opts, examples)
        if device_model is not None:
            log.info("capturepass: %s graph: %s", kind, device_model.describe())

        def run_passes(graph: fx.GraphModule, not_capturable: dict[str, str], record: bool) -> CompiledGraph:
            with cost.device_model(device_model):
                compiled = driver.compile_graph(
                    graph, examples, compile_opts, name=kind, dump_dir=dump_dir, front_dumps=front_dumps,
                    not_capturable=not_capturable, record=record,
                    one_lane=(lambda: plan_with(candidates.ONE_LANE_OVERRIDES)[1]) if source is not None else None,
                )
            if device_model is not None:
                meta.add_decision(compiled.graph, device_model.describe())
            return compiled

        # The nodes the last rebuild made breaks: schedule candidates derived later have them too.
        breaks: dict[str, str] = {}

        def plan_with(overrides: dict[str, Any]) -> tuple[fx.GraphModule, Any]:
            graph = _pristine_copy(source)
            new = driver.compile_graph(
                graph, examples, dataclasses.replace(opts, **overrides), name=kind, regions=False, record=False,
                log_decisions=False, not_capturable=breaks,
            )
            return new.graph, new.plan

        # What earlier processes measured of this graph, or what this device's measurements
        # predict of its lanes: one lane alone needs one Inductor compile instead of two.
        hint_key, hinted = _cached_choice(kind, pristine, graph_opts, examples)
        one_lane_why = None
        if hinted == ONE_LANE:
            one_lane_why = ("schedule one_lane from the schedule cache (what earlier processes measured of this "
                            "graph): compiled with one lane")
        elif hinted is None and hint_key is not None:
            one_lane_why = _lanes_predicted_slower(kind, plan_with, graph_opts, examples)
        compile_opts = opts
        if one_lane_why is not None:
            compile_opts = dataclasses.replace(opts, **candidates.ONE_LANE_OVERRIDES)

        compiled = run_passes(gm, {}, True)
        if one_lane_why is not None:
            meta.add_decision(compiled.graph, one_lane_why)
        gi = meta.graph_info(gm)
        log.info(
            "capturepass: compiled %s: %d lane(s), %d segment(s), %d region(s)",
            gi.title, len(gi.lanes), len(gi.segments), len(compiled.program.regions),
        )
        rebuild: Callable[[dict[str, str]], Any] | None = None
        picker = None
        if pristine is not None:
            tc = _tracing_context()

            def rebuild_program(not_capturable: dict[str, str]) -> Any:
                breaks.clear()
                breaks.update(not_capturable)
                graph = _pristine_copy(pristine)
                with _recompiling(tc):
                    new = run_passes(graph, not_capturable, False)
                compiled.graph, compiled.plan, compiled.program = new.graph, new.plan, new.program
                compiled.counters, compiled.timings = new.counters, new.timings
                return new.program

            rebuild = rebuild_program

            def make_picker() -> Picker | None:
                # After a rebuild this runs at a call, outside the compile.
                with _recompiling(tc), cost.device_model(device_model):
                    new = _picker(kind, compiled, pristine, graph_opts, plan_with, tc, dump_dir, on_cuda=gi.on_cuda,
                                  breaks=breaks, hint_key=hint_key, hinted=hinted)
                if new is not None:
                    # A capture failure rebuilds the graph with a break: derive its candidates again.
                    new.renew = lambda program: make_picker() if program is compiled.program else None
                return new

            picker = make_picker()
        # Dynamo's graphs of one frame are its shapes (a graph per batch-size specialization):
        # run on the same parameters, their captures share one pool.
        scope = ("dynamo-frame", frame, kind) if frame is not None else None
        executor = Executor(compiled.program, graph_opts, rebuild=rebuild, record_dir=dump_dir, picker=picker,
                            memory_scope=scope, on_choice=_recorder(compiled, dump_dir))
        compiled.attach(executor)

        def run(args: list[Any]) -> Any:
            return executor(args)

        # AOT autograd calls boxed functions with one list, which it may clear to free inputs.
        run._boxed_call = True  # type: ignore[attr-defined]
        run.executor = executor  # type: ignore[attr-defined]
        return run

    return compile_aten


def _recorder(compiled: CompiledGraph, dump_dir: str | None) -> Callable[[PickRecord], None]:
    """Where a measured choice goes, captured or uncaptured: the graph's decisions (of the graph the
    compile holds now, rebuilt or not) and its dump folder."""

    def on_pick(record: PickRecord) -> None:
        meta.add_decision(compiled.graph, record.text())
        append_record(dump_dir, record)

    return on_pick


def _picker(
    kind: str, compiled: CompiledGraph, pristine: fx.GraphModule, opts: Options,
    plan_with: Callable[[dict[str, Any]], tuple[fx.GraphModule, Any]], tc: Any, dump_dir: str | None,
    *, on_cuda: bool, breaks: Mapping[str, str] | None = None, hint_key: str | None = None,
    hinted: str | None = None,
) -> Picker | None:
    """The measured lane choice of a captured CUDA graph, or ``None``: not captured on CUDA (nothing
    to measure), ``pick="model"``, or a cost model's schedule with no cheaper alternative (one lane).

    ``breaks``: the nodes a rebuild made breaks (after a capture failed on them), which the
    candidates (derived by ``plan_with``) have too; part of the cache key. ``hint_key``: the
    graph's hash before its schedule (:func:`_cached_choice`), under which each choice is added
    to the graph's summary; ``hinted``: the choice found there at compile time (the candidates
    with programs of their own other than that one are then compiled only if a capture needs them).
    """
    if not on_cuda or opts.pick != "measure" or opts.cudagraphs == CaptureMode.NONE:
        return None
    gi = meta.graph_info(compiled.graph)
    if gi.cudagraphs == CaptureMode.BREAKABLE:
        # NOTE: on the H200 a breakable graph that writes its inputs kept three captures of one
        # shape after the measured choice (its values right); until that is understood its
        # schedule is the cost model's, as with pick="model".
        log.info("capturepass: %s: captured breakable (%d segments); its schedule is the cost model's, not "
                 "measured", gi.title, len(gi.segments))
        return None
    if collectives.has_collectives(compiled.graph.graph):
        # Every rank would time the candidates for as many rounds as its own clock allows and
        # replay their collectives that many times: ranks out of step wait on each other forever
        # (and could keep different schedules).
        log.info("capturepass: %s: posts collectives; its schedule is the cost model's, not measured "
                 "(ranks measuring on their own would replay collectives out of step)", gi.title)
        return None
    rebuilt = bool(breaks)

    def compile_plan(plan: Any) -> Any:
        with _recompiling(tc):  # a candidate may be compiled after the compile (a rebuild, a capture)
            return driver.compile_regions(plan, eager_fallback=rebuilt, inline=driver.inline_route(opts, plan))

    cands = candidates.derive(compiled.graph, compiled.plan, compiled.program, opts, plan_with, compile_plan)
    if len(cands) > 1 and not rebuilt and hinted is None:
        # Compiled now, inside the compile: the first capture measures every candidate anyway, and
        # one that fails to compile is left out here, with the reason logged, rather than in the
        # middle of a call.
        kept = [cands[0]]
        for cand in cands[1:]:
            try:
                cand.program  # noqa: B018 - compiles its regions
            except Exception as e:  # noqa: BLE001 - EmitError, or Inductor's own error on a one-region plan
                if is_dynamo_control_flow(e):
                    raise
                log.warning("capturepass: %s graph: schedule candidate %s failed to compile (%s); not measured",
                            kind, cand.name, str(e).splitlines()[0][:300])
                continue
            kept.append(cand)
        cands = kept
    if len(cands) < 2:
        return None
    log.info("capturepass: %s graph: %d schedule candidates to measure at capture: %s", kind, len(cands),
             ", ".join(f"{c.name} ({c.lanes} lane(s), estimate {c.estimate_us:.1f} us)" for c in cands))

    cache = ScheduleCache(_cache_dir(opts))
    key = candidates.graph_key(pristine, opts, cands, breaks=sorted(breaks or ()))
    return Picker(kind, cands, key, opts.pick_budget_ms, cache, _recorder(compiled, dump_dir),
                  calibration=CalibrationStore(cache.directory), rooflines=calibration.rooflines(compiled.graph.graph),
                  hint_key=None if rebuilt else hint_key)


ONE_LANE = "one_lane"


def _cache_dir(opts: Options) -> Any:
    """Where measured choices and the devices' calibrations are kept (a path)."""
    return opts.pick_cache_dir or default_cache_dir()


def _cached_choice(kind: str, pristine: fx.GraphModule | None, opts: Options,
                   examples: list[Any]) -> tuple[str | None, str | None]:
    """The hash under which this graph's measured choices are summed up for its next compile
    (``Picker.hint_key``), and the choice the summary earlier processes left implies, if any.

    For a graph captured on CUDA with ``pick="measure"``. A graph of one shape (no symbolic size
    among ``examples``) captures only that shape, known at compile time: the choice made for it
    (a cached ``one_lane`` compiles the graph with one lane alone, one Inductor compile instead
    of the cost model's and one lane's; another choice leaves ``one_lane``'s compile to a capture
    that needs it). A graph with a symbolic size meets its shapes at run time: when every shape
    measured so far chose ``one_lane`` it is compiled with one lane alone, and shapes not met
    before are not measured (logged). Returns ``(None, None)`` when nothing is measured.
    """
    if pristine is None or opts.pick != "measure" or opts.cudagraphs == CaptureMode.NONE:
        return None, None
    device = cuda_device(examples)
    if device is None:
        return None, None
    hint_key = candidates.graph_key(pristine, opts, ())
    cache = ScheduleCache(_cache_dir(opts))
    shapes = cache.shapes(ScheduleCache.graph_summary_key(choices.device_name(device), hint_key))
    if not any(_symbolic(x) for x in examples):
        choice = shapes.get(choices.shape_text(examples))
        if choice is not None:
            log.info("capturepass: %s graph: schedule %s from the schedule cache (an earlier process measured this "
                     "graph and shape); %s", kind, choice,
                     "compiled with one lane alone" if choice == ONE_LANE else
                     "one_lane is compiled only if a capture needs it")
        return hint_key, choice
    if shapes and set(shapes.values()) == {ONE_LANE}:
        log.info("capturepass: %s graph: every shape earlier processes measured of it (%d) chose one_lane (schedule "
                 "cache); compiled with one lane alone, and shapes not met before are not measured", kind, len(shapes))
        return hint_key, ONE_LANE
    return hint_key, None


def lane_factor(opts: Options, device: torch.device | None) -> float | None:
    """The lane factor of CUDA ``device`` (``runtime.calibration``: how much slower than the cost
    model says its measured lanes ran against one lane), or ``None``: nothing measured there yet,
    no device, ``pick="model"`` or ``pick_predict`` off (the default)."""
    if opts.pick != "measure" or not opts.pick_predict or device is None:
        return None
    return CalibrationStore(_cache_dir(opts)).lane_factor(choices.device_name(device))


def _lanes_predicted_slower(kind: str, plan_with: Callable[[dict[str, Any]], tuple[fx.GraphModule, Any]],
                            opts: Options, examples: list[Any]) -> str | None:
    """Why the graph is compiled with one lane alone, or ``None``: its cost model's lanes, with this
    device's lane factor, are predicted to be no faster than one lane (the passes run once more,
    without the inner compiler, to estimate them). Nothing is predicted before the device has a
    measured lane sample."""
    factor = lane_factor(opts, cuda_device(examples))
    if factor is None:
        return None
    graph, _ = plan_with({})
    ratio = candidates.estimated_lane_ratio(graph)
    if ratio is None:
        return None
    predicted = calibration.lanes_predicted(ratio, factor)
    if predicted < 1.0:
        return None
    why = (f"lanes predicted no faster than one lane on this device (cost model {ratio:.3f} x lane factor "
           f"{factor:.3f} = {predicted:.3f}): compiled with one lane, not measured")
    log.info("capturepass: %s graph: %d lanes %s", kind, len(meta.graph_info(graph).lanes), why)
    return why


def _symbolic(x: Any) -> bool:
    if isinstance(x, torch.SymInt):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))


def _device_model(opts: Options, examples: list[Any]) -> cost.DeviceModel | None:
    """The cost model calibrated on the device of ``examples`` by earlier measured choices, for a
    graph whose schedule is not measured: compiled with ``cudagraphs="none"`` or ``"breakable"``
    (a monolithic graph switched to breakable by a non-capturable op keeps the nominal model).

    A captured graph's schedule is measured, and its cached choice names a candidate derived by
    the nominal model: deriving them from a model that changes with every measurement would make
    a cached name mean another schedule (or miss the cache).
    """
    if opts.cudagraphs not in (CaptureMode.NONE, CaptureMode.BREAKABLE):
        return None
    return calibrated_model(opts, cuda_device(examples))


def cuda_device(examples: list[Any]) -> torch.device | None:
    """The device of the first CUDA tensor among ``examples``."""
    return next((x.device for x in examples if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)


def calibrated_model(opts: Options, device: torch.device | None) -> cost.DeviceModel | None:
    """The cost model calibrated on CUDA ``device`` (``None`` when nothing was measured there yet,
    for no device, or with ``pick="model"``, which keeps the nominal model everywhere:
    reproducible schedules)."""
    if opts.pick != "measure" or device is None:
        return None
    return CalibrationStore(_cache_dir(opts)).model(choices.device_name(device))


def _decompositions(inner: str) -> dict | None:
    """The decompositions AOT autograd applies before the passes: Inductor's, when Inductor
    compiles the regions.

    NOTE: Inductor re-traces every region with its own decompositions. Where one changes a
    value's layout (``cat`` with an empty operand becomes a ``clone`` of the other, which keeps
    its strides), an op the first trace recorded for the old layout (a ``view``) no longer
    applies inside the region, and a region's output leaves at another layout than its fake
    value says. Decomposing up front gives the passes, the verifier and every region the
    graph Inductor lowers, with its layouts.
    """
    if inner != "inductor":
        return None
    # Some of the table's decompositions consult Inductor's lowerings while AOT autograd traces
    # (max_pool2d asks ``torch._inductor.lowering`` whether to fall back): a module only
    # Inductor's own compile imports, which has not run in a process that compiled nothing else.
    import torch._inductor.lowering  # noqa: F401

    select = getattr(getattr(torch._inductor, "decomposition", None), "select_decomp_table", None)
    if select is None:  # pragma: no cover - a torch without Inductor's table: AOT's defaults
        return None
    return select()


def capturepass_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable:
    """The torch.compile backend entry point.

    Args:
        gm: Dynamo's graph.
        example_inputs: its example inputs.
        options: capturepass options (see :class:`~capturepass.ir.options.Options`).
        mode: ``torch.compile``'s mode. ``"reduce-overhead"`` asks for what capturepass does by
            default (capture CUDA graphs; it captures them itself) and compiles with the default
            options: code written for Inductor's mode (Hugging Face's ``CompileConfig`` has it
            by default) runs unchanged. Inductor's other modes are refused: capture is chosen
            with ``options={"cudagraphs": ...}``, and the Inductor compiles inside capturepass
            follow the process's ``torch._inductor.config`` (``max_autotune`` among it).

    Raises:
        OptionError: invalid options, or a mode other than ``"reduce-overhead"``.
    """
    from torch._dynamo.backends.common import aot_autograd

    if mode == "reduce-overhead":
        files.warn_once("mode:reduce-overhead", "capturepass: mode='reduce-overhead' is capturepass's default: it "
                        "captures CUDA graphs itself (Inductor's CUDA graphs stay off); options={'cudagraphs': ...} "
                        "chooses how", level=logging.INFO)
    elif mode is not None:
        raise OptionError(
            f"backend='capturepass' takes no mode={mode!r}: choose capture with "
            "options={'cudagraphs': 'monolithic' | 'breakable' | 'none'}, and Inductor's autotuning with "
            "torch._inductor.config.max_autotune = True (capturepass's Inductor compiles follow it); "
            "mode='reduce-overhead' is accepted and means the default options"
        )
    opts = Options.from_mapping(options)
    inner_compilers.check_available(opts.inner)
    compile_id = next(_compile_ids)
    upstream = _dynamo_breaks(gm)
    frame = _dynamo_frame()
    front_dumps = driver.run_front(gm, example_inputs, opts)
    return aot_autograd(
        decompositions=_decompositions(opts.inner),
        fw_compiler=_aten_compiler("forward", opts, front_dumps, compile_id, upstream, frame),
        bw_compiler=_aten_compiler("backward", opts, front_dumps, compile_id, upstream, frame),
        inference_compiler=_aten_compiler("inference", opts, front_dumps, compile_id, upstream, frame),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def register() -> None:
    """Registers the backend under the name ``capturepass`` (idempotent; touches no device)."""
    from torch._dynamo.backends import registry

    if registry._COMPILER_FNS.get("capturepass") is capturepass_backend:
        return
    # The entry point may have announced the name without loading it; load ours.
    registry._COMPILER_FNS.pop("capturepass", None)
    registry.register_backend(compiler_fn=capturepass_backend, name="capturepass")
