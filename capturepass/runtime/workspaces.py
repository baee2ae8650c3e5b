"""Workspaces: scratch storage in slots, reserved ahead of capture and locked during it.

A captured kernel bakes in the address of its scratch buffer. If the buffer is
reallocated afterwards (a larger request grows it), the graph keeps writing to
the freed block, which the allocator hands to someone else: silent corruption
on replay. A :class:`Workspaces` manager therefore separates three phases:

1. **reserve** (before capture): ``reserve(name, nbytes, lane=, microbatch=)``
   or a first eager call sizes each workspace;
2. **lock** (during capture): a request that fits returns the reserved storage;
   one that would grow it raises :class:`~capturepass.errors.ResourceError`
   and never reallocates;
3. **unlock** (after capture): requests may grow again.

Storage is split into *slots*: one per lane (a stream of one owner, or an
engine's execution context such as target and draft) and per micro-batch, so
that two lanes, or two micro-batches in flight at once, never share scratch.
A manager either allocates its own buffers (one per slot and name), or carves
every slot out of a buffer the caller preallocated (split evenly over the
slots; a request beyond a slot's share raises instead of allocating).

Every :class:`~capturepass.runtime.owner.GraphOwner` has one (its lanes are the
graph's lanes; :func:`capturepass.workspace` reads it), locked while the owner
captures. An engine may make its own; with ``lock_on_capture=True`` capturepass
locks it around each of its captures as well.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from capturepass.errors import ResourceError

ALIGN = 256  # bytes; what the CUDA caching allocator guarantees, so carved slots are as aligned as fresh ones

_capture_locked: "weakref.WeakSet[Workspaces]" = weakref.WeakSet()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = math.prod(shape)
    return numel * torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Workspaces:
    """Named scratch buffers per slot (lane x micro-batch).

    Args:
        name: the manager's name (in messages).
        lanes: how many lanes, or their names (a lane is then given by index or name).
        microbatches: slots per lane.
        device: the device of the storage (default: the buffer's, else the CPU).
        buffer: a preallocated buffer to carve every slot from (any dtype; its
            bytes are split evenly over ``lanes x microbatches`` slots).
        lock_on_capture: capturepass locks this manager around each of its captures.

    Raises:
        ResourceError: a bad lane count, micro-batch count or buffer.
    """

    def __init__(
        self,
        name: str,
        lanes: int | Sequence[str] = 1,
        microbatches: int = 1,
        *,
        device: Any = None,
        buffer: torch.Tensor | None = None,
        lock_on_capture: bool = False,
    ) -> None:
        if isinstance(lanes, int) and not isinstance(lanes, bool):
            if lanes < 1:
                raise ResourceError(f"workspaces {name!r}: lanes must be at least 1, got {lanes}")
            self.lane_names: tuple[str, ...] = tuple(f"s{i}" for i in range(lanes))
        else:
            self.lane_names = tuple(lanes)
            if not self.lane_names or not all(isinstance(n, str) and n for n in self.lane_names):
                raise ResourceError(f"workspaces {name!r}: lanes must be a positive int or non-empty names, got {lanes!r}")
            if len(set(self.lane_names)) != len(self.lane_names):
                raise ResourceError(f"workspaces {name!r}: lane names repeat: {lanes!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ResourceError(f"workspaces {name!r}: microbatches must be a positive int, got {microbatches!r}")
        self.name = name
        self.microbatches = microbatches
        self._lock = threading.RLock()
        self._locked_by: list[str] = []
        # (lane, microbatch, name) -> the workspace's bytes
        self._buffers: dict[tuple[int, int, str], torch.Tensor] = {}
        self._slot_bytes: int | None = None
        self._used: dict[tuple[int, int], int] = {}
        self._base: torch.Tensor | None = None
        if buffer is not None:
            if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
                raise ResourceError(f"workspaces {name!r}: buffer must be a contiguous tensor, got {type(buffer).__name__}")
            raw = buffer.view(-1).view(torch.uint8) if buffer.dim() else buffer.reshape(1).view(torch.uint8)
            slots = len(self.lane_names) * microbatches
            slot = raw.numel() // slots // ALIGN * ALIGN
            if slot == 0:
                raise ResourceError(
                    f"workspaces {name!r}: a buffer of {raw.numel()} bytes cannot hold {slots} slot(s) of "
                    f"at least {ALIGN} bytes"
                )
            self._base = raw
            self._slot_bytes = slot
            device = raw.device
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if lock_on_capture:
            _capture_locked.add(self)

    # -- slots ---------------------------------------------------------------------------------
    @property
    def num_lanes(self) -> int:
        return len(self.lane_names)

    def _lane(self, lane: int | str) -> int:
        if isinstance(lane, str):
            if lane not in self.lane_names:
                raise ResourceError(
                    f"workspaces {self.name!r}: no lane {lane!r}; its lanes are {', '.join(self.lane_names)}"
                )
            return self.lane_names.index(lane)
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.num_lanes:
            raise ResourceError(
                f"workspaces {self.name!r}: no lane {lane!r}; valid lanes are 0..{self.num_lanes - 1} "
                f"({', '.join(self.lane_names)})"
            )
        return lane

    def _microbatch(self, microbatch: int) -> int:
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or not 0 <= microbatch < self.microbatches:
            raise ResourceError(
                f"workspaces {self.name!r}: no micro-batch slot {microbatch!r}; valid slots are 0..{self.microbatches - 1}"
            )
        return microbatch

    def _where(self, name: str, lane: int, microbatch: int) -> str:
        return f"workspace {name!r} of {self.name!r} (lane {self.lane_names[lane]}, micro-batch {microbatch})"

    # -- phases --------------------------------------------------------------------------------
    @property
    def is_locked(self) -> bool:
        return bool(self._locked_by)

    def lock(self, reason: str = "locked") -> None:
        """Forbids growth until :meth:`unlock` (locks nest)."""
        with self._lock:
            self._locked_by.append(reason)

    def unlock(self) -> None:
        """Undoes one :meth:`lock`.

        Raises:
            ResourceError: the manager is not locked.
        """
        with self._lock:
            if not self._locked_by:
                raise ResourceError(f"workspaces {self.name!r}: unlock without a lock")
            self._locked_by.pop()

    @contextlib.contextmanager
    def locked(self, reason: str = "locked") -> Iterator["Workspaces"]:
        """Locked for the duration of the block."""
        self.lock(reason)
        try:
            yield self
        finally:
            self.unlock()

    def reserve(self, name: str, nbytes: int, *, lane: int | str = 0, microbatch: int = 0) -> None:
        """Makes sure ``name`` holds at least ``nbytes`` in the slot (allocating if needed).

        Raises:
            ResourceError: a bad name, size, lane or slot; growth while locked; a
                preallocated slot too small.
        """
        self._storage(name, nbytes, self._lane(lane), self._microbatch(microbatch))

    def get(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.uint8,
        *,
        lane: int | str = 0,
        microbatch: int = 0,
    ) -> torch.Tensor:
        """A view of ``shape`` and ``dtype`` on workspace ``name`` of the slot, grown if unlocked.

        Raises:
            ResourceError: as :meth:`reserve`.
        """
        shape = tuple(shape)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            raise ResourceError(f"workspace {name!r}: shape must be ints, got {shape!r}")
        if any(s < 0 for s in shape):
            raise ResourceError(f"workspace {name!r}: negative size in shape {shape}")
        nbytes = _nbytes(shape, dtype)
        buf = self._storage(name, nbytes, self._lane(lane), self._microbatch(microbatch))
        return buf[:nbytes].view(dtype).view(shape)

    def _storage(self, name: str, nbytes: int, lane: int, mb: int) -> torch.Tensor:
        if not isinstance(name, str) or not name:
            raise ResourceError(f"workspaces {self.name!r}: a workspace name must be a non-empty string, got {name!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ResourceError(f"{self._where(name, lane, mb)}: size must be a non-negative int of bytes, got {nbytes!r}")
        key = (lane, mb, name)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is not None and buf.numel() >= nbytes:
                return buf
            have = 0 if buf is None else buf.numel()
            if self._locked_by:
                raise ResourceError(
                    f"{self._where(name, lane, mb)} would grow from {have} to {nbytes} bytes while locked "
                    f"({self._locked_by[-1]}): reallocating under a captured graph would leave it writing freed "
                    "memory; reserve it before capturing (or call the op once eagerly)"
                )
            if self._base is not None:
                used = self._used.get((lane, mb), 0)
                size = _align(max(nbytes, 1))
                if used + size > self._slot_bytes:
                    raise ResourceError(
                        f"{self._where(name, lane, mb)}: {nbytes} bytes do not fit in the preallocated slot "
                        f"({self._slot_bytes - used} of {self._slot_bytes} bytes free)"
                    )
                start = (lane * self.microbatches + mb) * self._slot_bytes + used
                buf = self._base[start:start + nbytes]
                self._used[(lane, mb)] = used + size
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[key] = buf
            return buf

    # -- queries ---------------------------------------------------------------------------------
    def capacity(self, name: str | None = None, *, lane: int | str = 0, microbatch: int = 0) -> float:
        """Bytes a request can get without failing.

        With ``name``: what :meth:`get` of that workspace returns without growing (its
        reserved size; once locked, nothing more). Without: the bytes a new workspace of
        the slot can still take: the preallocated slot's free bytes, ``inf`` for a
        manager that allocates, 0 for a locked one.
        """
        lane, mb = self._lane(lane), self._microbatch(microbatch)
        with self._lock:
            if name is not None:
                buf = self._buffers.get((lane, mb, name))
                if buf is not None:
                    return buf.numel()
                if self._locked_by:
                    return 0
            elif self._locked_by:
                return 0
            if self._base is not None:
                return self._slot_bytes - self._used.get((lane, mb), 0)
            return math.inf

    def buffers(self) -> dict[tuple[str, int, str], torch.Tensor]:
        """Every workspace's storage by ``(lane name, micro-batch, name)``."""
        with self._lock:
            return {(self.lane_names[l], m, n): b for (l, m, n), b in self._buffers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held over every slot."""
        with self._lock:
            return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Drops every workspace (and the preallocated buffer's carving).

        Raises:
            ResourceError: the manager is locked.
        """
        with self._lock:
            if self._locked_by:
                raise ResourceError(f"workspaces {self.name!r} cannot be cleared while locked ({self._locked_by[-1]})")
            self._buffers.clear()
            self._used.clear()

    def release(self) -> None:
        """Drops every workspace, the preallocated buffer and any lock (the owner is closing)."""
        with self._lock:
            self._locked_by.clear()
            self._buffers.clear()
            self._used.clear()
            self._base = None
            self._slot_bytes = 0

    def __repr__(self) -> str:
        state = "locked" if self._locked_by else "unlocked"
        return f"<Workspaces {self.name!r}: {len(self._buffers)} workspace(s), {self.nbytes} bytes, {state}>"


@contextlib.contextmanager
def locked_for_capture(reason: str) -> Iterator[None]:
    """Locks every manager made with ``lock_on_capture=True`` for the block."""
    managers = list(_capture_locked)
    for m in managers:
        m.lock(reason)
    try:
        yield
    finally:
        for m in managers:
            m.unlock()
