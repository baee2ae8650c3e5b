"""Lane runtimes: how a lane runs a region and how events order lanes.

A lane runtime is bound to one graph owner and one event scope. The integer
handles in the IR (lanes, leases) resolve here to that owner's objects only:

- :class:`HostLanes`: tensors on the host; program order already orders every
  lane, so records and waits only count.
- :class:`CudaLanes`: lane 0 is the current stream of the call (inside a
  capture, the capture stream); every other lane is a stream the owner owns.
  Leases become events from the :class:`~capturepass.runtime.events.EventPool`
  under the owner's name and this runtime's scope.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from capturepass.errors import ResourceError
from capturepass.ir.meta import EventRole, LeaseId
from capturepass.runtime import external
from capturepass.runtime.events import POOL, EventPool

Runner = Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]


def run_here(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
    """Runs a region on the current stream (the runner of the main lane, and of every lane on the host)."""
    return fn(*args)


class Lanes(abc.ABC):
    """Base of lane runtimes: lease handles and counters; subclasses say how lanes run."""

    def __init__(self) -> None:
        self.counters: Counter = Counter()
        self._handles: dict[LeaseId, int] = {}

    def lease_handle(self, lease: LeaseId | None) -> int:
        """The integer handle of ``lease`` in this runtime (its event made on first use)."""
        if lease is None:
            raise ResourceError("an event without a lease cannot run (lease_events did not run)")
        handle = self._handles.get(lease)
        if handle is None:
            handle = self._handles[lease] = self.new_event(lease.role)
        return handle

    @property
    def num_events(self) -> int:
        """How many events this runtime holds."""
        return len(self._handles)

    @abc.abstractmethod
    def region_runner(self, lane: int) -> Runner:
        """A function ``run(fn, args)`` that runs a region on ``lane``."""

    @abc.abstractmethod
    def new_event(self, role: str) -> int:
        """Allocates an event of ``role`` and returns its handle."""

    @abc.abstractmethod
    def record(self, event: int, lane: int) -> None:
        """Records ``event`` on ``lane``."""

    @abc.abstractmethod
    def wait(self, event: int, lane: int) -> None:
        """Makes ``lane`` wait for ``event``."""

    def release(self, *values: Any) -> None:
        """The point where ``values`` may be freed: the caller drops them right after."""

    @abc.abstractmethod
    def join_external(self, name: str, into: bool) -> None:
        """Joins external stream ``name`` into the main lane (``into``), or the main lane into it."""

    def synchronize(self) -> None:
        """Waits for all work on every lane."""

    def close(self) -> None:
        """Forgets the runtime's events."""
        self._handles.clear()


class HostLanes(Lanes):
    """Lanes of a host graph: program order is the only order; events are counted."""

    def __init__(self, num_lanes: int) -> None:
        super().__init__()
        self.num_lanes = num_lanes
        self._roles: list[str] = []

    def region_runner(self, lane: int) -> Runner:
        return run_here

    def new_event(self, role: str) -> int:
        self._roles.append(role)
        self.counters[f"events_{role}"] += 1
        return len(self._roles) - 1

    def record(self, event: int, lane: int) -> None:
        self.counters["records"] += 1

    def wait(self, event: int, lane: int) -> None:
        self.counters["waits"] += 1

    def join_external(self, name: str, into: bool) -> None:
        self.counters[f"external_{'in' if into else 'out'}:{name}"] += 1


class CudaLanes(Lanes):
    """Lanes on CUDA streams, with events leased from the pool for one owner and scope.

    Args:
        streams: the owner's auxiliary streams (index ``i - 1`` is lane ``i``; ``None``: a lane
            merged onto the caller's stream, whose records and waits are made there).
        owner: the owner's name (the pool's lease key).
        scope: ``"eager"`` or ``"capture:<n>"``.
        pool: the event pool.
    """

    def __init__(self, streams: list[torch.cuda.Stream | None], owner: str, scope: str,
                 pool: EventPool = POOL) -> None:
        super().__init__()
        self.streams = streams
        self.owner = owner
        self.scope = scope
        self.pool = pool
        self._events: list[torch.cuda.Event] = []
        self._external: dict[tuple[str, bool], torch.cuda.Event] = {}
        self._code: dict[int, torch.cuda.Event] = {}

    def _stream(self, lane: int) -> torch.cuda.Stream:
        # The outer program and the sync points run with lane 0's stream current.
        stream = self.streams[lane - 1] if lane else None
        return torch.cuda.current_stream() if stream is None else stream

    def region_runner(self, lane: int) -> Runner:
        stream = self.streams[lane - 1] if lane else None
        if stream is None:
            return run_here

        def run(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
            with torch.cuda.stream(stream):
                return fn(*args)

        return run

    def new_event(self, role: str) -> int:
        self._events.append(self.pool.acquire(self.owner, self.scope, role))
        return len(self._events) - 1

    def code_event(self, slot: int) -> torch.cuda.Event:
        """The event of slot ``slot`` of code compiled with lanes after fusion
        (``runtime.code_lanes``), leased for this owner and scope at its first use."""
        event = self._code.get(slot)
        if event is None:
            event = self._code[slot] = self.pool.acquire(self.owner, self.scope, EventRole.JOIN)
        return event

    def record(self, event: int, lane: int) -> None:
        self._events[event].record(self._stream(lane))

    def wait(self, event: int, lane: int) -> None:
        self._stream(lane).wait_event(self._events[event])

    def join_external(self, name: str, into: bool) -> None:
        ext = external.bound_stream(name)
        main = torch.cuda.current_stream()
        if torch.cuda.is_current_stream_capturing() and not external.is_capturing(ext):
            raise ResourceError(
                f"{self.owner}: external stream {name!r} is not part of the capture in progress: a captured "
                "graph cannot wait for a stream outside its capture (fork the stream from the capturing "
                "stream before calling the model, so that the capture includes it)"
            )
        event = self._external.get((name, into))
        if event is None:
            event = self._external[(name, into)] = self.pool.acquire(self.owner, self.scope, EventRole.EXTERNAL)
        if into:
            event.record(ext)
            main.wait_event(event)
        else:
            event.record(main)
            ext.wait_event(event)
        self.counters[f"external_{'in' if into else 'out'}:{name}"] += 1

    def release(self, *values: Any) -> None:
        # The allocator frees on the allocating stream when the last reference dies,
        # which the generated code does right after this call; insert_syncs placed the
        # call where that stream already runs after every reader.
        return None

    def synchronize(self) -> None:
        for s in self.streams:
            if s is not None:
                s.synchronize()
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        super().close()
        self._events.clear()
        self._external.clear()
        self._code.clear()
