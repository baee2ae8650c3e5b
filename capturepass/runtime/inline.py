"""Segments compiled once with their lanes inline: the ops their generated code calls.

With ``regions="segments"`` a capture segment's lane regions are not compiled one
by one: the backend (``capturepass.backends.inline``) builds one graph of the
whole segment, in the plan's order, with a ``capturepass::inline_step`` call
wherever the plan syncs or changes lane, and Inductor compiles it once. At run
time each call runs the plan's steps of its :class:`~capturepass.ir.plan.SyncPoint`
(records, waits, releases, retentions) on the bound owner's lanes, and then
makes the next region's lane the current stream.

That is enough to put the kernels on their lanes because Inductor's generated
code reads the current stream at every kernel launch (``stream0 =
get_raw_stream(0)`` before each launch, ``get_raw_stream`` being
``torch._C._cuda_getCurrentRawStream``), and an extern kernel (a matmul) runs
on the current stream; the buffers a lane's kernels allocate come from that
lane's stream, as in a region run under ``torch.cuda.stream``. The op's
arguments give Inductor the edges that keep each node between its two sync
points (see the backend module); which value it takes is decided there.

The op finds what to run through this thread's running segment: the runner
of a bound fused region sets it around the compiled call, and restores the
stream current at the call's start when the call ends, also on an error.

The pass route writes the same kind of graph into a compile that is not capturepass's
(``capturepass.backends.post_grad``); its calls are ``capturepass::lane_step``, which carry
their records and waits and need no runner (below).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.node import has_side_effect

from capturepass.errors import ResourceError
from capturepass.ir import meta
from capturepass.ir.plan import StepKind, SyncPoint

if TYPE_CHECKING:
    from capturepass.runtime.lanes import Lanes
    from capturepass.runtime.owner import GraphOwner
    from capturepass.runtime.program import RegionSpec


class _State(threading.local):
    call: "_Call | None" = None  # a class-level default: a missing attribute costs a caught exception


_state = _State()


# NOTE: the op reads no data, so any layout does. Without ``flexible_layout`` Inductor holds
# each guard to its fake value's exact strides, and a guard whose buffer it had already laid
# out otherwise (a ``clone`` of a permuted tensor, read earlier as contiguous) was written in
# one layout and read in the other: wrong values on the host (Gemma2's repeated keys), copies
# on the GPU. Releases that predate the tag hold every custom op to the fake strides anyway.
_TAGS = tuple(t for t in (getattr(torch.Tag, "flexible_layout", None),) if t is not None)


@torch.library.custom_op("capturepass::inline_step", mutates_args=("guards",), tags=_TAGS)
def inline_step(key: int, index: int, reads: list[torch.Tensor], guards: list[torch.Tensor]) -> None:
    """Runs sync point ``index`` of the fused segment ``key`` on this thread's bound lanes.

    ``reads`` are the values the point releases or retains (the last point also reads every
    value read on another lane than its own, so that Inductor writes none in place before);
    ``guards`` are declared written (and never are): what the code before it computed last and
    what the code after it reads, so that both stay on their side of it.
    """
    call = _state.call
    if call is None or call.key != key:
        raise ResourceError(
            f"capturepass::inline_step of fused segment {key} ran outside its runner: a segment compiled "
            "with its lanes inline runs only through the outer program that bound it to an owner")
    call.step(index, reads)


@inline_step.register_fake
def _(key: int, index: int, reads: list[torch.Tensor], guards: list[torch.Tensor]) -> None:
    return None


# A point that guards nothing is no write to functionalization: without this mark, dead-code
# elimination would drop it, and with it the lane switch it makes.
has_side_effect(torch.ops.capturepass.inline_step.default)


class _Call:
    """One running call of a fused segment (the thread's, while its compiled code runs)."""

    __slots__ = ("key", "points", "entry", "streams", "prev")

    def __init__(self, key: int, points: list[list[Callable[[Sequence[torch.Tensor]], None]]],
                 streams: list[Any] | None) -> None:
        self.key = key
        self.points = points
        self.streams = streams
        self.entry = torch.cuda.current_stream() if streams is not None else None

    def step(self, index: int, reads: Sequence[torch.Tensor]) -> None:
        if self.streams is None:
            for op in self.points[index]:
                op(reads)
            return
        # Lane 0 is the stream current at the call (the capture stream under capture): the
        # plan's records and waits on it are made with it current, as in the region route.
        torch.cuda.set_stream(self.entry)
        for op in self.points[index]:
            op(reads)


def runner(spec: "RegionSpec", owner: "GraphOwner", lanes: "Lanes") -> Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]:
    """The runner of fused region ``spec`` on ``owner``'s ``lanes``: ``run(fn, args)``."""
    from capturepass.runtime.lanes import CudaLanes

    streams = lanes.streams if isinstance(lanes, CudaLanes) else None
    points = [_bind_point(p, owner, lanes, streams) for p in spec.inline.points]
    key = spec.inline.key

    def run(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
        call = _Call(key, points, streams)
        call.prev = _state.call
        _state.call = call
        try:
            return fn(*args)
        finally:
            _state.call = call.prev
            if call.entry is not None:
                torch.cuda.set_stream(call.entry)

    return run


def _bind_point(point: SyncPoint, owner: "GraphOwner", lanes: "Lanes",
                streams: list[Any] | None) -> list[Callable[[Sequence[torch.Tensor]], None]]:
    """The calls of one sync point against ``lanes``: its steps, then the lane switch."""
    ops: list[Callable[[Sequence[torch.Tensor]], None]] = []
    start = 0
    for step, take in zip(point.steps, point.takes):
        node = step.payload
        rec = meta.info(node)
        lane = step.lane.index
        if step.kind in (StepKind.RECORD, StepKind.WAIT):
            handle = lanes.lease_handle(rec.lease)
            act = lanes.record if step.kind == StepKind.RECORD else lanes.wait
            ops.append(lambda reads, act=act, handle=handle, lane=lane: act(handle, lane))
        elif step.kind == StepKind.RELEASE:
            # The allocator frees a value when its last reference dies: Inductor drops it right
            # after its last use, which this call is; nothing to run.
            pass
        elif step.kind == StepKind.RETAIN:
            seg = rec.segment.index if rec.segment is not None else -1
            handles = tuple(owner.resource_handle(r) for r in rec.resources)
            lo, hi = start, start + take
            ops.append(lambda reads, seg=seg, handles=handles, lo=lo, hi=hi: owner.retain(seg, handles, *reads[lo:hi]))
        else:
            raise ResourceError(f"a sync point of a fused segment cannot run a {step.kind} step")
        start += take
    if streams is not None and point.lane != 0 and streams[point.lane - 1] is not None:
        # A lane merged onto the caller's stream stays there (the point began with it current).
        stream = streams[point.lane - 1]
        ops.append(lambda reads, stream=stream: torch.cuda.set_stream(stream))
    return ops


# The pass route (``capturepass.post_grad_pass``) writes the lanes into a graph that Inductor
# compiles for someone else: vLLM's piecewise CUDA graphs, PyTorch's cudagraph trees, a cache
# that loads the code in another process. No runner binds it, so its calls carry their steps
# themselves and take their streams and events from this thread's pool.
RECORD, WAIT = 0, 1

_pool = threading.local()


class _LanePool:
    """This thread's side streams (by device and lane) and events (by device, slot and capture
    state). Graphs share them: a graph issues every wait of its records before its last point
    returns, so the next graph's record of a slot cannot overtake a wait of this one's."""

    def __init__(self) -> None:
        self.streams: dict[tuple[int, int], Any] = {}
        self.events: dict[tuple[int, int, bool], Any] = {}
        self.entry: Any = None
        self.open = False

    def stream(self, device: int, lane: int) -> Any:
        if lane == 0:
            return self.entry
        key = (device, lane)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device)
        return self.streams[key]

    def event(self, device: int, slot: int) -> Any:
        # NOTE: an event recorded in a capture is one of its dependency edges; one recorded
        # eagerly in the meantime must not alias it (as seed 000's did): captured and eager
        # calls use separate events.
        key = (device, slot, torch.cuda.is_current_stream_capturing())
        if key not in self.events:
            self.events[key] = torch.cuda.Event()
        return self.events[key]


def _lane_pool() -> _LanePool:
    pool = getattr(_pool, "lanes", None)
    if pool is None:
        pool = _pool.lanes = _LanePool()
    return pool


@torch.library.custom_op("capturepass::lane_step", mutates_args=("guards",), tags=_TAGS)
def lane_step(first: bool, last: bool, steps: list[int], lane: int, reads: list[torch.Tensor],
              guards: list[torch.Tensor]) -> None:
    """One sync point of a graph whose lanes the pass route wrote in (standalone).

    ``steps`` are ``(kind, lane, slot)`` triples (``RECORD`` or ``WAIT`` event ``slot`` on
    ``lane``), run in order; then ``lane`` becomes the current stream. Lane 0 is the stream
    current at the graph's ``first`` point (the capturing stream under capture; its ``last``
    point makes it current again), side lane ``k`` this thread's ``k``-th pooled stream of the
    device. ``guards[0]`` is the graph's
    token, on its device; ``reads`` and ``guards`` order Inductor's nodes around the call
    (see ``capturepass.backends.inline``) and are not read. On the host, lanes run in program
    order and the call does nothing.
    """
    device = guards[0].device
    if device.type != "cuda":
        return
    pool = _lane_pool()
    current = torch.cuda.current_stream(device)
    if first:
        if pool.open and any(current == s for s in pool.streams.values()):
            # A call that raised between its points left a side lane current: its entry is
            # still the one to come back to.
            current = pool.entry
        pool.entry = current
        pool.open = True
    index = device.index if device.index is not None else torch.cuda.current_device()
    for i in range(0, len(steps), 3):
        kind, on, slot = steps[i], steps[i + 1], steps[i + 2]
        stream = pool.stream(index, on)
        event = pool.event(index, slot)
        if kind == RECORD:
            event.record(stream)
        else:
            stream.wait_event(event)
    torch.cuda.set_stream(pool.stream(index, lane))
    if last:
        pool.open = False


@lane_step.register_fake
def _(first: bool, last: bool, steps: list[int], lane: int, reads: list[torch.Tensor],
      guards: list[torch.Tensor]) -> None:
    return None


has_side_effect(torch.ops.capturepass.lane_step.default)
