"""Profiling captures: capture a sample of graphs to measure them, then throw them away.

An engine sizes its KV cache from the memory left after the model's CUDA graphs
exist, so it must know what the graphs take before it captures them for real.
Inside ``with capturepass.profiling_capture() as prof:`` every capture that
capturepass makes goes to a throwaway owner (its own private pool, leases,
channels and workspaces). On leaving the block:

- the memory the captures took is measured (:attr:`ProfilingCapture.peak_bytes`,
  :attr:`ProfilingCapture.pool_bytes`);
- every throwaway owner is closed: its graphs, pool, event leases, retained
  objects, workspaces and channels are released;
- every registered resource pool is rolled back to its state at entry
  (channels made meanwhile are released, the engine's own state restored);
- the compiled callables forget those captures and capture again, for real,
  on their next call.

On a machine without CUDA nothing is captured; the block still gives each
compiled graph a throwaway owner (whose first run stands for its capture, as
everywhere on the host), releases it and rolls the pools back, so that the
bookkeeping can be tested; the memory figures are then 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from capturepass.errors import ResourceError
from capturepass.runtime import pools

if TYPE_CHECKING:
    from capturepass.runtime.owner import GraphOwner

log = logging.getLogger("capturepass")

_active: "ProfilingCapture | None" = None
_lock = threading.Lock()


@dataclasses.dataclass
class ProfilingCapture:
    """What a profiling capture measured and released.

    Attributes:
        device: the CUDA device measured (``None`` on a host).
        owners: names of the throwaway owners (in order of capture).
        graphs: CUDA graphs captured.
        retained: objects the captures retained (released with them).
        peak_bytes: peak allocated bytes above the baseline during the block.
        pool_bytes: reserved bytes the captures added (private pools), measured
            before they were released.
        leaked_bytes: allocated bytes above the baseline after release (0 when
            everything was given back; the rest belongs to the caller).
        rolled_back: per pool name, the channels released by the rollback.
    """

    device: torch.device | None = None
    owners: list[str] = dataclasses.field(default_factory=list)
    graphs: int = 0
    retained: int = 0
    peak_bytes: int = 0
    pool_bytes: int = 0
    leaked_bytes: int = 0
    rolled_back: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    _owners: list["GraphOwner"] = dataclasses.field(default_factory=list, repr=False)
    _forget: list[Callable[[], None]] = dataclasses.field(default_factory=list, repr=False)
    _closed: bool = dataclasses.field(default=False, repr=False)

    def adopt(self, owner: "GraphOwner", forget: Callable[[], None]) -> None:
        """Makes ``owner`` a throwaway owner of this block; ``forget`` drops it from its callable."""
        if self._closed:
            raise ResourceError(f"profiling capture already ended; cannot adopt {owner.name}")
        owner.profiling = True
        self._owners.append(owner)
        self._forget.append(forget)
        self.owners.append(owner.name)

    def _release(self) -> None:
        self._closed = True
        for owner in self._owners:
            owner.synchronize()
            self.graphs += len(owner.graphs)
            self.retained += owner.num_retained
        if self.device is not None:
            self.pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - self._reserved0)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._allocated0)
        for forget in self._forget:
            forget()
        for owner in self._owners:
            owner.close()
        self._owners.clear()
        self._forget.clear()


def active() -> ProfilingCapture | None:
    """The profiling capture in progress, if any."""
    return _active


@contextlib.contextmanager
def profiling_capture(device: Any = None) -> Iterator[ProfilingCapture]:
    """Captures inside the block are measured, then released, and every resource pool rolled back.

    Args:
        device: the CUDA device to measure (default: the current one, if CUDA is there).

    Raises:
        ResourceError: a profiling capture is already in progress, or a capture
            is in progress around the block.

    Note:
        The block resets the device's peak-memory statistics (``torch.cuda.reset_peak_memory_stats``).
    """
    global _active
    with _lock:
        if _active is not None:
            raise ResourceError("a profiling capture is already in progress; they do not nest")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ResourceError("profiling_capture inside a CUDA graph capture: start it before capturing")
        prof = ProfilingCapture()
        _active = prof
    checkpoints: list = []
    try:
        if torch.cuda.is_available():
            prof.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            torch.cuda.synchronize(prof.device)
            prof._allocated0 = torch.cuda.memory_allocated(prof.device)
            prof._reserved0 = torch.cuda.memory_reserved(prof.device)
            torch.cuda.reset_peak_memory_stats(prof.device)
        checkpoints = [(p, p.checkpoint()) for p in pools.registered_pools()]
        yield prof
    finally:
        with _lock:
            _active = None
        try:
            prof._release()
        finally:
            # A pool first made inside the block (capturepass's communicators are made at a
            # model's first call) had no channel before it: every channel it holds is the block's.
            # Its engine state is left as it is, having none from before the block.
            before = {id(pool) for pool, _ in checkpoints}
            checkpoints += [(pool, pools.Checkpoint(pool.name, frozenset(), pool.checkpoint().user))
                            for pool in pools.registered_pools() if id(pool) not in before]
            for pool, cp in checkpoints:
                dropped = pool.rollback(cp)
                if dropped:
                    prof.rolled_back[pool.name] = [str(k) for k in dropped]
            if prof.device is not None:
                torch.cuda.synchronize(prof.device)
                prof.leaked_bytes = max(0, torch.cuda.memory_allocated(prof.device) - prof._allocated0)
        log.info(
            "capturepass: profiling capture released %d owner(s), %d graph(s), %d retained object(s); "
            "peak %d bytes, pools %d bytes",
            len(prof.owners), prof.graphs, prof.retained, prof.peak_bytes, prof.pool_bytes,
        )
