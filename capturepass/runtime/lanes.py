"""Lane runtimes: how a lane runs a region and how events order lanes.

:class:`HostLanes` is the runtime of a graph whose tensors live on the host:
there is one host thread, the program order already orders every lane, and
records and waits only count. The CUDA runtime maps lanes to streams and leases
to events with the same interface.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any


class Lanes:
    """Interface of a lane runtime."""

    def region_runner(self, lane: int) -> Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]:
        """A function ``run(fn, args)`` that runs a region on ``lane``."""
        raise NotImplementedError

    def new_event(self, role: str) -> int:
        """Allocates an event of ``role`` and returns its handle."""
        raise NotImplementedError

    def record(self, event: int, lane: int) -> None:
        """Records ``event`` on ``lane``."""
        raise NotImplementedError

    def wait(self, event: int, lane: int) -> None:
        """Makes ``lane`` wait for ``event``."""
        raise NotImplementedError

    def release(self, *values: Any) -> None:
        """The point where ``values`` may be freed (their last reference is the caller's)."""

    def synchronize(self) -> None:
        """Waits for all work on every lane."""

    def close(self) -> None:
        """Releases the runtime's events and streams."""


def _call(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
    return fn(*args)


class HostLanes(Lanes):
    """Lanes of a host graph: program order is the only order; events are counted."""

    def __init__(self, num_lanes: int) -> None:
        self.num_lanes = num_lanes
        self.counters: Counter = Counter()
        self._events: list[str] = []

    def region_runner(self, lane: int) -> Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]:
        return _call

    def new_event(self, role: str) -> int:
        self._events.append(role)
        self.counters[f"events_{role}"] += 1
        return len(self._events) - 1

    def record(self, event: int, lane: int) -> None:
        self.counters["records"] += 1

    def wait(self, event: int, lane: int) -> None:
        self.counters["waits"] += 1

    def close(self) -> None:
        self._events.clear()
