"""Measured runs: the kernels of capturepass's graphs on a GPU, timed by the profiler, lane by lane.

``capturepass.trace(fn, *args)`` calls ``fn`` (a ``torch.compile(..., backend="capturepass")``
callable, or any function that calls some) under :mod:`torch.profiler` with CUDA activity
(CUPTI), and returns a :class:`MeasuredTrace`: a Chrome trace with one process per compiled
graph (named with its owner, ``g3``, as the dump names it), one row per lane (named as in the
dump: ``s0 main``, ``s1 aux0``, ...; one row per runtime owner and lane where several owners ran
the graph, ``s0 main · g3.m1.c0``: two models of one class), each kernel at its measured start
and duration, and a row with each run's measured span; plus a per-lane summary (kernels, busy
time, overlap between lanes) and each runtime owner's kernels. With ``dump=True`` (the default) each
graph compiled with a ``dump_dir`` also gets a ``measured.json`` next to its ``graph.json``;
``capturepass show DIR --trace out.json`` then writes the measured times instead of the
cost-model estimates (and says which it wrote).

How kernels find their lane and node:

- every call of a compiled graph, every run of one of its owners inside it, and every region
  call of an uncaptured run, is wrapped in a ``record_function`` range while the trace is
  recorded (``capturepass.trace/graph:N``, ``capturepass.trace/owner:g3.m0.c0``,
  ``capturepass.trace/region:I``); a kernel belongs to the ranges that enclose its launch (the
  CUDA runtime or driver call with the kernel's correlation id), and so to the graph, the
  runtime owner (the model instance and capture shape, named after the graph owner the dump
  prints: ``runtime.naming``) and the region;
- after the runs, a one-element fill is launched on every lane's stream, each inside its own
  range: the profiler's stream id of that fill names the lane of every kernel on that stream.
  Lane 0 is the caller's current stream; lane ``i`` is the owner's ``streams[i - 1]``;
- kernels a CUDA graph replay ran (their correlation id is a ``cudaGraphLaunch``'s) run on
  streams the graph executor picks, not on the lanes' streams. Their lanes come from one
  uncaptured run of the same program recorded in the same session: on each lane the kernels
  keep program order, so the replay's kernels, in start order, are an interleaving of the
  uncaptured run's per-lane kernel sequences; :func:`match_lanes` finds that interleaving
  (preferring one where no two kernels of a lane overlap in time). When it finds none (a
  replay that ran other kernels than the uncaptured run), those kernels stay on rows of their
  own ("lane not matched") and the trace says so; ``uncaptured=True`` measures the uncaptured
  program instead (the lanes' own streams, as with ``cudagraphs="none"``);
- a kernel launched inside a region gets the region's graph nodes; with ``inner="eager"`` an
  ATen kernel gets the one node of its op (the k-th ``aten::mm`` of the region is its k-th
  ``aten.mm`` node); an Inductor kernel keeps its name and lists the region's nodes.

Measured times include the profiler's own cost: kernel durations are the GPU's, but gaps between
kernels are wider than without profiling (CUPTI slows CUDA graph launches; in an uncaptured run
the host records every operator, so lanes mostly wait for launches). A lane's busy time (the
union of its kernels) is not inflated by that; spans are, and the overlap between lanes can only
be smaller than without the profiler.

On a machine without CUDA :func:`trace` raises :class:`TraceError`: lanes run in program order
on the host, so a host-time "measurement" would show no overlap that a GPU would have; the
cost-model schedule (``capturepass show DIR --trace``) is the honest picture there.

The parts that do not need a GPU are plain functions over plain records
(:func:`records_from_chrome_trace`, :func:`build_measurements`, :func:`match_lanes`,
:func:`measurement_events`, :func:`summarize_measurement`), so that they are tested on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import inspect
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from capturepass.errors import TraceError
from capturepass.measure.records import (  # the plain-record half, part of this package's API
    FORMAT,
    PREFIX,
    Activity,
    GraphSpec,
    HostRange,
    RegionInfo,
    _count,
    interval_length,
    interval_union,
    build_measurements,
    format_measurement,
    match_lanes,
    records_from_chrome_trace,
    summarize_measurement,
)
from capturepass.measure.report import (
    MEASURED_FILE,
    SPAN_TID,
    graph_digest,
    load_measurement,
    measurement_events,
    save_measurement,
    trace_document,
)

__all__ = [
    "FORMAT", "MEASURED_FILE", "PREFIX", "SPAN_TID", "Activity", "GraphSpec", "HostRange", "MeasuredTrace",
    "RegionInfo", "TraceError", "build_measurements", "format_measurement", "graph_digest", "load_measurement",
    "match_lanes", "measurement_events", "records_from_chrome_trace", "save_measurement", "summarize_measurement",
    "trace", "trace_document",
]


# -- recording ----------------------------------------------------------------------------------


@dataclasses.dataclass
class MeasuredTrace:
    """A measured run of compiled graphs: the Chrome trace and a measurement per graph.

    Attributes:
        document: the Chrome trace (``json.dump`` it, or :meth:`write`; Perfetto opens it).
        measurements: one :data:`FORMAT` document per compiled graph that ran.
        session: the session: runs, device, torch version, notes, work outside the graphs.
        saved: the ``measured.json`` files written into dump folders.
        path: where the trace was written, if anywhere.
    """

    document: dict[str, Any]
    measurements: list[dict[str, Any]]
    session: dict[str, Any]
    saved: list[str] = dataclasses.field(default_factory=list)
    path: str | None = None

    def write(self, path: str) -> None:
        """Writes the Chrome trace to ``path`` (strict JSON)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.document, f, indent=None, sort_keys=True, allow_nan=False)
            f.write("\n")
        self.path = path

    def summary(self) -> str:
        """Per graph and lane: kernels and busy time per run, the overlap between lanes, the span."""
        s = self.session
        head = f"measured {s.get('runs', 0)} run(s) on {s.get('device', '?')} (torch {s.get('torch', '?')})"
        lines = [head] + [format_measurement(m) for m in self.measurements]
        outside = s.get("outside") or []
        if outside:
            runs = max(1, s.get("runs", 1))
            busy = interval_length(interval_union((k["start"], k["start"] + k["dur"]) for k in outside)) / runs
            lines.append(f"outside capturepass graphs: {_count(len(outside) / runs)} kernel(s), busy {busy:.1f} us per run")
        lines.extend(f"note: {n}" for n in s.get("notes", []))
        return "\n".join(lines)


_trace_lock = threading.Lock()


@dataclasses.dataclass
class _Session:
    thread: int
    executors: list[Any] = dataclasses.field(default_factory=list)
    keys: dict[int, int] = dataclasses.field(default_factory=dict)

    def key_of(self, executor: Any) -> int:
        key = self.keys.get(id(executor))
        if key is None:
            key = self.keys[id(executor)] = len(self.executors)
            self.executors.append(executor)
        return key


@contextlib.contextmanager
def _instrumented(session: _Session) -> Iterator[None]:
    """Wraps every compiled-graph call and region call of this thread in a profiler range."""
    import torch
    from capturepass.runtime import context

    def graph_range(executor: Any) -> Any:
        return torch.profiler.record_function(f"{PREFIX}graph:{session.key_of(executor)}")

    def region_range(spec: Any) -> Any:
        return torch.profiler.record_function(f"{PREFIX}region:{spec.index}")

    def owner_range(owner: Any) -> Any:
        return torch.profiler.record_function(f"{PREFIX}owner:{owner.name}")

    with context.instrumented(context.Instrumentation(graph=graph_range, region=region_range, owner=owner_range)):
        yield


@contextlib.contextmanager
def _uncaptured(executors: Iterable[Any]) -> Iterator[None]:
    """Runs captured graphs uncaptured (on their eager owner's lanes) inside the block."""
    with contextlib.ExitStack() as stack:
        for ex in executors:
            if getattr(ex, "captured", False):
                stack.enter_context(ex.uncaptured())
        yield


def _region_infos(program: Any) -> dict[int, RegionInfo]:
    import torch

    out = {}
    for spec in getattr(program, "regions", []):
        nodes, ops = [], []
        for n in spec.graph.graph.nodes:
            # Views launch no kernel: they are left out of the nodes kernels are labelled with.
            if (n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                    and not getattr(n.target, "is_view", False)):
                nodes.append(n.name)
                ops.append(str(n.target))
        out[spec.index] = RegionInfo(spec.index, spec.lane, bool(spec.eager), tuple(nodes), tuple(ops))
    return out


def _graph_spec(key: int, executor: Any, uncaptured: bool) -> GraphSpec:
    from capturepass.backends.compile import last_compiled

    info = executor.program.info
    record = next((g for g in reversed(last_compiled()) if g.executor is executor), None)
    dump_dir = record.dump_dir if record is not None else None
    if dump_dir and os.path.isfile(os.path.join(dump_dir, "graph.json")):
        name = os.path.basename(os.path.normpath(dump_dir))
        digest = graph_digest(os.path.join(dump_dir, "graph.json"))
    else:
        dump_dir, digest = None, None
        name = f"{info.name} {info.owner}"
    return GraphSpec(key=key, name=name, kind=info.name, lanes=list(info.lanes), regions=_region_infos(executor.program),
                     replayed=bool(executor.captured) and not uncaptured, dump_dir=dump_dir, graph_sha256=digest,
                     owner=str(info.owner))


def _mark_streams(executors: Sequence[Any]) -> None:
    """One tiny kernel per lane stream, each in a range naming its graph and lane."""
    import torch

    devices = set()
    for key, ex in enumerate(executors):
        for owner in ex.owners:
            if owner.device is None:
                continue
            devices.add(owner.device.index or 0)
            for i, stream in enumerate(owner.streams):
                if stream is None:
                    continue  # a lane merged onto the caller's stream
                with torch.profiler.record_function(f"{PREFIX}marker:{owner.device.index or 0}:{key}:{i + 1}"):
                    with torch.cuda.stream(stream):
                        torch.zeros(1, device=owner.device)
                stream.synchronize()
    for dev in sorted(devices):
        with torch.profiler.record_function(f"{PREFIX}marker:{dev}:*:0"):
            torch.zeros(1, device=torch.device("cuda", dev))
        torch.cuda.synchronize(dev)


def trace(
    fn: Callable[..., Any],
    *args: Any,
    path: str | None = None,
    runs: int = 5,
    warmup: int = 2,
    uncaptured: bool = False,
    dump: bool = True,
    kwargs: dict[str, Any] | None = None,
    profiler_trace: str | None = None,
) -> MeasuredTrace:
    """Records a measured run of the capturepass graphs ``fn(*args, **kwargs)`` calls, on a GPU.

    ``fn`` runs ``warmup`` times (captures happen there), then, under ``torch.profiler``
    with CUDA activity, once uncaptured when its graphs replay CUDA graphs (to learn which
    lane each replayed kernel belongs to; see the module doc), then ``runs`` times, each
    followed by a device synchronization so that runs do not overlap. Runs the call as it is:
    use ``torch.no_grad()`` around it if ``fn`` should run without autograd.

    Args:
        fn: a compiled callable (``torch.compile(..., backend="capturepass")``), or a function
            calling some.
        args: its positional arguments.
        path: also write the Chrome trace there.
        runs: measured runs.
        warmup: unmeasured calls first.
        uncaptured: measure the graphs' uncaptured program (each lane on its own stream,
            as ``cudagraphs="none"`` runs it) instead of their CUDA graph replays.
        dump: write ``measured.json`` into the dump folder of each graph compiled with a
            ``dump_dir``, for ``capturepass show DIR --trace``.
        kwargs: its keyword arguments.
        profiler_trace: also write ``torch.profiler``'s own Chrome trace of the session there
            (``.gz`` compresses it).

    Returns:
        the :class:`MeasuredTrace`.

    Raises:
        TraceError: CUDA is not available, ``fn`` ran no capturepass graph, a graph runs on the
            host, or the profiler recorded no GPU activity.
    """
    import torch

    if runs < 1 or warmup < 0:
        raise TraceError(f"trace needs runs >= 1 and warmup >= 0 (got runs={runs}, warmup={warmup})")
    if not torch.cuda.is_available():
        raise TraceError(
            "capturepass.trace needs a CUDA device: on the host the lanes run one after another in program "
            "order, so measured host times would show no overlap. Without a GPU, `capturepass show DIR "
            "--trace out.json` writes the schedule timed by the cost model."
        )
    kwargs = dict(kwargs or {})
    with _trace_lock:
        session = _Session(threading.get_ident())
        with _instrumented(session):
            for _ in range(warmup):
                fn(*args, **kwargs)
            torch.cuda.synchronize()
            if not session.executors:
                # Compiled before warmup=0: run once unmeasured to find the graphs.
                fn(*args, **kwargs)
                torch.cuda.synchronize()
            if not session.executors:
                raise TraceError("fn ran no graph compiled by capturepass (torch.compile(..., backend='capturepass'))")
            host = [ex for ex in session.executors if not ex.program.info.on_cuda]
            if host:
                raise TraceError(
                    f"the {host[0].program.info.title} runs on the host (its tensors are not on a CUDA device); "
                    "capturepass.trace measures GPU kernels"
                )
            replaying = [ex for ex in session.executors if ex.captured] if not uncaptured else []
            if replaying or uncaptured:
                with _uncaptured(session.executors):  # the eager owners' streams exist from here on
                    fn(*args, **kwargs)
                torch.cuda.synchronize()
            specs_before = len(session.executors)
            activities = torch.profiler.ProfilerActivity
            extra = {"acc_events": True} if "acc_events" in inspect.signature(torch.profiler.profile).parameters else {}
            with torch.profiler.profile(activities=[activities.CPU, activities.CUDA], **extra) as prof:
                with torch.profiler.record_function(PREFIX + "session"):
                    if replaying:
                        with _uncaptured(replaying), torch.profiler.record_function(PREFIX + "reference"):
                            fn(*args, **kwargs)
                        torch.cuda.synchronize()
                    for r in range(runs):
                        with contextlib.ExitStack() as stack:
                            if uncaptured:
                                stack.enter_context(_uncaptured(session.executors))
                            stack.enter_context(torch.profiler.record_function(f"{PREFIX}run:{r}"))
                            fn(*args, **kwargs)
                        torch.cuda.synchronize()
                    _mark_streams(session.executors)
        if len(session.executors) != specs_before:
            raise TraceError("fn compiled a new graph while it was measured; give it more warmup calls")
        specs = [_graph_spec(key, ex, uncaptured) for key, ex in enumerate(session.executors)]
        session.executors.clear()
    tmp = tempfile.mkdtemp(prefix="capturepass-trace-")
    try:
        raw = os.path.join(tmp, "profiler.json")
        prof.export_chrome_trace(raw)
        with open(raw, encoding="utf-8") as f:
            doc = json.load(f)
        if profiler_trace:
            if profiler_trace.endswith(".gz"):
                with open(raw, "rb") as src, gzip.open(profiler_trace, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            else:
                shutil.copyfile(raw, profiler_trace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    acts, ranges = records_from_chrome_trace(doc)
    if not acts:
        raise TraceError("the profiler recorded no GPU activity (is CUPTI available to torch.profiler here?)")
    dev = torch.cuda.current_device()
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda}
    measurements, sess = build_measurements(acts, ranges, specs, info)
    result = MeasuredTrace(trace_document(measurements, sess), measurements, sess)
    if dump:
        for spec, m in zip(specs, measurements):
            if spec.dump_dir:
                result.saved.append(save_measurement(m, spec.dump_dir))
    if path:
        result.write(path)
    return result
