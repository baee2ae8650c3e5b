"""Owner-bound resource pools: engine state that must follow graph ownership.

An inference engine owns more device state than the model graph shows:
communication channels, all-to-all staging buffers, IPC signal buffers. A
captured kernel bakes the addresses of that state into the graph, so two graph
owners (a target model and its speculative draft, a profiling capture, eager
execution) that share one channel corrupt each other as soon as their replays
interleave (seed 002). A :class:`ResourcePool` makes the sharing impossible:
the engine registers how to make one channel, and every request resolves to
the channel of the *executing owner and lane*::

    comm = capturepass.resource_pool("oneshot_allreduce", make=lambda key: Channel(nbytes))

    @torch.library.custom_op("engine::allreduce", mutates_args=())
    def allreduce(x):
        channel = comm.channel()        # this owner's, this lane's channel
        ...

Outside any compiled graph the channel belongs to the owner ``"eager"``.
A channel lives as long as its owner: closing an owner (``GraphOwner.close``,
garbage collection, the end of a profiling capture) releases its channels
through the pool's ``release`` callback.

A pool can checkpoint its state and roll it back (:meth:`ResourcePool.checkpoint`,
:meth:`ResourcePool.rollback`): channels made after the checkpoint are released,
and the engine's own ``snapshot``/``restore`` callbacks, when given, restore
whatever else the pool tracks (a bump pointer in an IPC buffer, sequence
numbers). :func:`capturepass.profiling_capture` does this for every registered
pool around captures that are thrown away.

When capturepass captures a graph it *enters* every registered pool for the
capturing owner (the pool's ``on_capture`` callback, a context manager factory
given the channel key of lane 0 and the capture stream), so that an engine can
bind process-global state to the capturing owner for the duration of the
capture, as vLLM binds its all-to-all pools to the enclosing graph capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from capturepass.errors import ResourceError
from capturepass.runtime import context

EAGER_OWNER = "eager"


@dataclasses.dataclass(frozen=True, order=True)
class ChannelKey:
    """Who a channel belongs to: an owner's name and a lane of that owner.

    Attributes:
        owner: the owner's name (``"g3.m0.c0"``), or ``"eager"`` outside any graph.
        lane: the lane index (0 is the owner's main lane).
    """

    owner: str
    lane: int = 0

    def __str__(self) -> str:
        return f"{self.owner}/s{self.lane}"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The state of one pool at :meth:`ResourcePool.checkpoint`.

    Attributes:
        pool: the pool's name.
        keys: the channels that existed.
        user: what the pool's ``snapshot`` callback returned, if it has one.
    """

    pool: str
    keys: frozenset[ChannelKey]
    user: Any = None


def _current_key(lane: int | None) -> ChannelKey:
    owner = context.current_owner()
    if owner is None:
        return ChannelKey(EAGER_OWNER, 0 if lane is None else lane)
    if lane is None:
        lane = 0
        if owner.device is not None:
            lane = owner.lane_of_stream(torch.cuda.current_stream(owner.device))
    elif not 0 <= lane < owner.num_lanes:
        raise ResourceError(
            f"lane s{lane} does not exist in owner {owner.name}: its lanes are s0..s{owner.num_lanes - 1}"
        )
    return ChannelKey(owner.name, lane)


class ResourcePool:
    """Device resources of an engine or kernel library, one channel per owner and lane.

    Args:
        name: the pool's name (unique among registered pools).
        make: makes the channel of a :class:`ChannelKey`; called once per key.
        release: releases a channel when its owner closes or a rollback drops it.
        snapshot / restore: optional; ``snapshot()`` returns the engine's own state
            at a checkpoint and ``restore(state)`` brings it back on rollback.
        on_capture: optional; ``on_capture(key, stream)`` returns a context manager
            that capturepass enters around each capture of the owner in ``key``.

    Attributes:
        counters: ``made``, ``released``, ``rolled_back``, ``captures_entered``.
    """

    def __init__(
        self,
        name: str,
        make: Callable[[ChannelKey], Any],
        *,
        release: Callable[[Any], None] | None = None,
        snapshot: Callable[[], Any] | None = None,
        restore: Callable[[Any], None] | None = None,
        on_capture: Callable[[ChannelKey, Any], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ResourceError(f"a resource pool needs a non-empty name, got {name!r}")
        if not callable(make):
            raise ResourceError(f"resource pool {name!r}: make must be callable, got {make!r}")
        if (snapshot is None) != (restore is None):
            raise ResourceError(f"resource pool {name!r}: give both snapshot and restore, or neither")
        self.name = name
        self._make = make
        self._release = release
        self._snapshot = snapshot
        self._restore = restore
        self._on_capture = on_capture
        self._channels: dict[ChannelKey, Any] = {}
        self._lock = threading.RLock()
        self.counters: Counter = Counter()

    # -- channels ---------------------------------------------------------------------------
    def channel(self, *, lane: int | None = None, owner: str | None = None) -> Any:
        """The channel of the executing owner (or ``owner``) on the current stream's lane (or ``lane``).

        Raises:
            ResourceError: ``lane`` is not a lane of the executing owner.
        """
        key = ChannelKey(owner, 0 if lane is None else lane) if owner is not None else _current_key(lane)
        with self._lock:
            ch = self._channels.get(key)
            if ch is None:
                ch = self._make(key)
                self._channels[key] = ch
                self.counters["made"] += 1
        return ch

    def channels(self) -> dict[ChannelKey, Any]:
        """Every live channel by key (a copy)."""
        with self._lock:
            return dict(self._channels)

    def release_owner(self, owner: str) -> int:
        """Releases every channel of ``owner``; returns how many."""
        with self._lock:
            keys = [k for k in self._channels if k.owner == owner]
            for k in keys:
                self._drop(k)
        return len(keys)

    def _drop(self, key: ChannelKey) -> None:
        ch = self._channels.pop(key)
        self.counters["released"] += 1
        if self._release is not None:
            self._release(ch)

    # -- checkpoint and rollback ---------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """The pool's state now, for :meth:`rollback`."""
        with self._lock:
            user = self._snapshot() if self._snapshot is not None else None
            return Checkpoint(self.name, frozenset(self._channels), user)

    def rollback(self, checkpoint: Checkpoint) -> list[ChannelKey]:
        """Releases the channels made since ``checkpoint`` and restores the engine's state.

        Returns:
            The keys of the released channels, sorted.

        Raises:
            ResourceError: ``checkpoint`` was taken of another pool.
        """
        if checkpoint.pool != self.name:
            raise ResourceError(f"resource pool {self.name!r} cannot roll back to a checkpoint of {checkpoint.pool!r}")
        with self._lock:
            dropped = sorted(k for k in self._channels if k not in checkpoint.keys)
            for k in dropped:
                self._drop(k)
            if self._restore is not None:
                self._restore(checkpoint.user)
            self.counters["rolled_back"] += len(dropped)
        return dropped

    # -- capture -----------------------------------------------------------------------------
    def capturing(self, owner: str, stream: Any) -> contextlib.AbstractContextManager:
        """The context capturepass enters around a capture of ``owner`` on ``stream``."""
        self.counters["captures_entered"] += 1
        if self._on_capture is None:
            return contextlib.nullcontext()
        return self._on_capture(ChannelKey(owner, 0), stream)

    def __repr__(self) -> str:
        return f"<ResourcePool {self.name!r}: {len(self._channels)} channel(s)>"


_pools: dict[str, ResourcePool] = {}
_pools_lock = threading.RLock()  # owners release channels from __del__, which GC may run anywhere


def resource_pool(name: str, make: Callable[[ChannelKey], Any], **kwargs: Any) -> ResourcePool:
    """Makes and registers a :class:`ResourcePool` (same arguments).

    Raises:
        ResourceError: a pool of that name is already registered.
    """
    pool = ResourcePool(name, make, **kwargs)
    register_pool(pool)
    return pool


def register_pool(pool: ResourcePool) -> None:
    """Registers ``pool`` so that captures enter it, closed owners release their channels in it,
    and profiling captures roll it back.

    Raises:
        ResourceError: another pool of that name is registered.
    """
    with _pools_lock:
        other = _pools.get(pool.name)
        if other is not None and other is not pool:
            raise ResourceError(
                f"a resource pool named {pool.name!r} is already registered; unregister_pool it first"
            )
        _pools[pool.name] = pool


def unregister_pool(name: str) -> None:
    """Forgets the pool ``name`` (its channels stay with the caller)."""
    with _pools_lock:
        _pools.pop(name, None)


def registered_pools() -> list[ResourcePool]:
    """Every registered pool, by name."""
    with _pools_lock:
        return [_pools[k] for k in sorted(_pools)]


def release_owner(owner: str) -> int:
    """Releases ``owner``'s channels in every registered pool; returns how many."""
    return sum(pool.release_owner(owner) for pool in registered_pools())


@contextlib.contextmanager
def entered_for_capture(owner: str, stream: Any) -> Iterator[None]:
    """Enters every registered pool for a capture of ``owner`` on ``stream``."""
    with contextlib.ExitStack() as stack:
        for pool in registered_pools():
            stack.enter_context(pool.capturing(owner, stream))
        yield
