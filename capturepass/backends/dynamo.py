"""The ``capturepass`` torch.compile backend.

Registered through the ``torch_dynamo_backends`` entry-point group, so that
``torch.compile(model, backend="capturepass", options={...})`` works without
importing capturepass. The backend

1. runs the Dynamo-stage passes on Dynamo's graph (stream regions become lane
   hints and are stripped),
2. hands the graph to AOT autograd, so that the remaining passes see functional
   ATen graphs with fake-tensor metadata,
3. runs the ATen-stage pipeline on each graph AOT autograd produces
   (inference, or forward and backward), which ends with ``emit``: the regions
   compiled by the inner compiler and the outer program that runs them.

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

import collections
import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from capturepass.backends import inner as inner_compilers
from capturepass.capabilities import REGISTRY
from capturepass.errors import OptionError
from capturepass.ir import meta
from capturepass.ir.meta import Break, BreakSource, CaptureMode, GraphInfo, OwnerId
from capturepass.options import Options
from capturepass.passes.base import PassContext
from capturepass.passes.observer import Observer
from capturepass.passes.pipeline import default_pipeline
from capturepass.runtime.executor import Executor

log = logging.getLogger("capturepass")

_compile_ids = itertools.count()
_owner_ids = itertools.count()
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


def _tracing_context() -> Any:
    try:
        from torch._guards import TracingContext

        return TracingContext.try_get()
    except ImportError:  # pragma: no cover
        return None


def _on_cuda(example_inputs: list[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


@dataclasses.dataclass
class CompiledGraph:
    """What capturepass produced for one ATen graph (kept for inspection and tests).

    Attributes:
        name: ``"inference"``, ``"forward"`` or ``"backward"``.
        graph: the annotated ATen graph after the last pass.
        program: the emitted outer program.
        counters: per-pass counters.
        timings: seconds per pass.
        dump_dir: where its dumps were written, if anywhere.
    """

    name: str
    graph: fx.GraphModule
    program: Any
    counters: dict
    timings: dict
    dump_dir: str | None
    _executor: Any = None

    @property
    def executor(self) -> Any:
        """The compiled callable's executor while it is alive (held weakly), else ``None``."""
        return None if self._executor is None else self._executor()


_last_compiled: collections.deque[CompiledGraph] = collections.deque(maxlen=32)


def last_compiled() -> list[CompiledGraph]:
    """The graphs of recent ``capturepass`` compiles in this process, oldest first (at most 32)."""
    return list(_last_compiled)


def _aten_compiler(
    kind: str, opts: Options, front_dumps: list[tuple[str, str]], compile_id: int, upstream: list[str]
) -> Callable:
    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        graph_opts = opts
        if kind == "backward":
            graph_opts = dataclasses.replace(opts, policy="off", cudagraphs=CaptureMode.NONE)
        on_cuda = _on_cuda(example_inputs)
        with _lock:
            owner = OwnerId(next(_owner_ids))
        meta.set_graph_info(
            gm,
            GraphInfo(
                name=kind,
                owner=owner,
                cudagraphs=graph_opts.resolved_cudagraphs(on_cuda),
                on_cuda=on_cuda,
                static_inputs=_static_input_indices() if kind != "backward" else frozenset(),
                breaks=tuple(Break(node="", reason=r, source=BreakSource.DYNAMO) for r in upstream),
                external=graph_opts.external_streams,
            ),
        )
        dump_dir = None
        if opts.dump_dir is not None:
            dump_dir = os.path.join(os.fspath(opts.dump_dir), f"{compile_id:03d}_{kind}")
        # Kept for rebuilds after a capture failed on one op (never needed when nothing is captured).
        pristine = _pristine_copy(gm) if graph_opts.resolved_cudagraphs(on_cuda) != CaptureMode.NONE else None
        examples = list(example_inputs)

        def run_passes(graph: fx.GraphModule, not_capturable: dict[str, str]) -> tuple[Any, PassContext, Observer]:
            passes = [p for p in default_pipeline(REGISTRY.key()) if p.stage == "aten"]
            ctx = PassContext(options=graph_opts, registry=REGISTRY, example_inputs=examples,
                              not_capturable=dict(not_capturable))
            observer = Observer(dump_dir=dump_dir, verify_each=opts.verify)
            dumps = observer.run(passes, graph, ctx)
            observer.write(list(front_dumps) + dumps, graph)
            return ctx.artifacts["program"], ctx, observer

        program, ctx, observer = run_passes(gm, {})
        record = CompiledGraph(kind, gm, program, ctx.counters, observer.timings, dump_dir)
        _last_compiled.append(record)
        gi = meta.graph_info(gm)
        log.info(
            "capturepass: compiled %s graph: %d lane(s), %d segment(s), %d region(s)",
            kind, len(gi.lanes), len(gi.segments), len(program.regions),
        )
        rebuild = None
        if pristine is not None:
            tc = _tracing_context()

            def rebuild(not_capturable: dict[str, str]) -> Any:
                graph = _pristine_copy(pristine)
                with _tracing(tc):
                    new, new_ctx, new_observer = run_passes(graph, not_capturable)
                record.graph, record.program = graph, new
                record.counters, record.timings = new_ctx.counters, new_observer.timings
                return new

        executor = Executor(
            program,
            max_captures=opts.max_captures,
            static_outputs=opts.static_outputs,
            capture_sizes=opts.capture_sizes if kind != "backward" else (),
            check_replay=opts.check_replay,
            rebuild=rebuild,
        )
        # Weakly: this record must not keep captured graphs and their pools alive.
        _last_compiled[-1]._executor = weakref.ref(executor)

        def run(args: list[Any]) -> Any:
            return executor(args)

        # AOT autograd calls boxed functions with one list, which it may clear to free inputs.
        run._boxed_call = True  # type: ignore[attr-defined]
        run.executor = executor  # type: ignore[attr-defined]
        return run

    return compile_graph


def capturepass_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable:
    """The torch.compile backend entry point.

    Args:
        gm: Dynamo's graph.
        example_inputs: its example inputs.
        options: capturepass options (see :class:`~capturepass.options.Options`).
        mode: not supported; capture is chosen with ``options={"cudagraphs": ...}``.

    Raises:
        OptionError: invalid options, or a ``mode``.
    """
    from torch._dynamo.backends.common import aot_autograd

    if mode is not None:
        raise OptionError(
            f"backend='capturepass' takes no mode (got mode={mode!r}); choose capture with "
            "options={'cudagraphs': 'monolithic' | 'breakable' | 'none'}"
        )
    opts = Options.from_mapping(options)
    inner_compilers.check_available(opts.inner)
    compile_id = next(_compile_ids)
    upstream = _dynamo_breaks(gm)
    front = [p for p in default_pipeline(REGISTRY.key()) if p.stage == "dynamo"]
    ctx = PassContext(options=opts, registry=REGISTRY, example_inputs=list(example_inputs))
    observer = Observer(dump_dir=opts.dump_dir, verify_each=False)
    front_dumps = observer.run(front, gm, ctx)
    return aot_autograd(
        fw_compiler=_aten_compiler("forward", opts, front_dumps, compile_id, upstream),
        bw_compiler=_aten_compiler("backward", opts, front_dumps, compile_id, upstream),
        inference_compiler=_aten_compiler("inference", opts, front_dumps, compile_id, upstream),
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
