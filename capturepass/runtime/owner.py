"""GraphOwner: one per compiled graph (and capture shape); owns what its captures reference.

An owner holds the event leases of its graph, the storage owners its captured
segments retain, and the owner-bound resources bound to it; ``close()`` (or
garbage collection) synchronizes its lanes and releases everything. Owners are
numbered per process; a lease or a resource handle is never valid for another
owner.

On a machine without CUDA nothing is captured, but the bookkeeping runs as it
does on a GPU: when the graph's mode is a capturing one, a segment's first run
stands for its capture and retains the segment's storage owners until
``close()``, which tests observe with weak references.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

from capturepass.ir.meta import GraphInfo, LeaseId, ResourceBinding
from capturepass.runtime.lanes import HostLanes, Lanes

_ids = itertools.count()
_live: "weakref.WeakSet[GraphOwner]" = weakref.WeakSet()
_lock = threading.Lock()


class GraphOwner:
    """Owns one compiled graph's leases, retained objects and resources.

    Attributes:
        name: a process-unique name (``"g<N>:<graph>"``).
        lanes: the lane runtime (streams and events, or host no-ops).
        retained: per segment, the objects its capture keeps alive.
    """

    def __init__(self, graph_name: str, captured: bool, lanes: Lanes) -> None:
        with _lock:
            self.id = next(_ids)
            _live.add(self)
        self.name = f"g{self.id}:{graph_name}"
        self.captured = captured
        self.lanes = lanes
        self.retained: dict[int, list[Any]] = {}
        self._leases: dict[LeaseId, int] = {}
        self._resources: dict[ResourceBinding, int] = {}
        self.closed = False

    @classmethod
    def for_graph(cls, gi: GraphInfo) -> "GraphOwner":
        """The owner of a graph that runs on the host (no CUDA streams)."""
        return cls(gi.name, gi.captured, HostLanes(len(gi.lanes)))

    def lease_handle(self, lease: LeaseId | None) -> int:
        """The integer handle of ``lease`` in this owner (allocated on first use)."""
        if lease is None:
            raise ValueError(f"{self.name}: an event without a lease cannot run")
        handle = self._leases.get(lease)
        if handle is None:
            handle = self._leases[lease] = self.lanes.new_event(lease.role)
        return handle

    def resource_handle(self, binding: ResourceBinding) -> int:
        """The integer handle of an owner-bound resource."""
        return self._resources.setdefault(binding, len(self._resources))

    def retain(self, segment: int, resources: tuple[int, ...], *objs: Any) -> None:
        """Keeps ``objs`` alive for the life of ``segment``'s capture (first run only)."""
        if not self.captured or segment in self.retained:
            return
        self.retained[segment] = list(objs) + [("resource", h) for h in resources]

    @property
    def num_leases(self) -> int:
        """How many event leases this owner holds."""
        return len(self._leases)

    @property
    def num_retained(self) -> int:
        """How many objects this owner's captures retain."""
        return sum(len(v) for v in self.retained.values())

    def close(self) -> None:
        """Synchronizes the lanes and releases leases, retained objects and resources."""
        if self.closed:
            return
        self.lanes.synchronize()
        self.retained.clear()
        self._leases.clear()
        self._resources.clear()
        self.lanes.close()
        self.closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def live_owners() -> list[GraphOwner]:
    """Every owner not yet collected (open or closed)."""
    return list(_live)
