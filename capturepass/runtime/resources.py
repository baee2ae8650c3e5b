"""Retention, workspaces and weak references for custom-op authors.

One resource model serves ops and engines (docs/resources.md): everything a
captured kernel reads or writes outside its graph's own pool belongs to a
graph owner and lives as long as it.

``retain(obj)``: called while capturepass captures a graph, keeps ``obj`` alive
exactly as long as that graph (its owner): an object whose device storage a
captured kernel bakes in (a binding, a plan, a scratch buffer) can no longer be
collected while the graph may replay (seed 003). It returns whether it retained
anything: ``False`` when nothing is capturing, or inside
:func:`suspend_retention`. Inside a capture that capturepass did not start (an
engine capturing around the model), the object is tied to the compiled graph's
own owner, since torch offers no handle to the outer graph.

``suspend_retention()``: a scope in which ``retain`` pins nothing, for code that
runs during a capture but whose objects must not outlive their own use (a
temporary the kernel does not bake in, an engine's bookkeeping).

``workspace(name, shape, dtype)``: scratch storage from the executing owner's
:class:`~capturepass.runtime.workspaces.Workspaces`, in the slot of the lane
(stream) it is called on. Two owners (a target model and its draft) or two
lanes never share one. It grows outside captures; during a capture the owner's
workspaces are locked and a request that would grow them raises.

``weak_ref(tensor)``: a tensor on the same storage that does not keep it alive,
for non-capturable ops that must hold on to an argument (a cache, a deferred
check) without pinning graph activations.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from capturepass.errors import ResourceError
from capturepass.runtime import context
from capturepass.runtime.owner import GraphOwner

_unowned: dict[str, GraphOwner] = {}
_suspended = threading.local()


def retain(obj: Any) -> bool:
    """Keeps ``obj`` alive as long as the graph being captured; returns whether it did.

    Args:
        obj: any Python object (typically the owner of device storage a captured
            kernel reads or writes).

    Returns:
        ``True`` when ``obj`` is now tied to a capture; ``False`` when nothing is
        capturing or retention is suspended.
    """
    if getattr(_suspended, "depth", 0):
        return False
    owner = context.current_owner()
    if owner is None or owner.capturing is None:
        return False
    owner.keep(owner.capturing, [obj])
    return True


@contextlib.contextmanager
def suspend_retention() -> Iterator[None]:
    """Inside the block :func:`retain` pins nothing (and returns ``False``); blocks nest.

    The runtime's own retention of a segment's storage owners is not affected:
    that is what keeps a graph's inputs and constants valid.
    """
    _suspended.depth = getattr(_suspended, "depth", 0) + 1
    try:
        yield
    finally:
        _suspended.depth -= 1


def workspace(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype = torch.uint8,
    device: Any = None,
    *,
    microbatch: int = 0,
) -> torch.Tensor:
    """Scratch storage of at least ``shape`` bound to the executing owner and lane.

    Args:
        name: the workspace's name (one buffer per owner, lane, micro-batch and name).
        shape: the shape of the returned view.
        dtype: its dtype.
        device: its device (default: the current CUDA device, else the CPU).
        microbatch: the micro-batch slot (owners have one unless an engine says otherwise).

    Raises:
        ResourceError: a bad name, shape or slot, or growth during a capture.
    """
    if not isinstance(name, str) or not name:
        raise ResourceError(f"workspace name must be a non-empty string, got {name!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    owner = context.current_owner()
    if owner is None:
        key = str(device)
        owner = _unowned.get(key)
        if owner is None:
            owner = _unowned[key] = GraphOwner(f"unowned:{key}", 1, device, captured=False)
    lane = owner.lane_of_stream(torch.cuda.current_stream(device)) if device.type == "cuda" else 0
    ws = owner.workspaces
    if ws.device != device:
        raise ResourceError(
            f"workspace {name!r} on {device}, but owner {owner.name} keeps its workspaces on {ws.device}"
        )
    return ws.get(name, shape, dtype, lane=lane, microbatch=microbatch)


def weak_ref(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``tensor``'s storage without keeping it alive.

    Reading it after the storage was freed reads whatever the allocator put
    there since: hold it only as long as the storage's owner (a captured graph's
    pool, a static buffer) is known to live.

    Raises:
        ResourceError: ``tensor`` is not a tensor, or this torch cannot make a
            non-owning storage.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ResourceError(f"weak_ref takes a tensor, got {type(tensor).__name__}")
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise ResourceError("this torch has no torch._C._construct_storage_from_data_pointer; weak_ref is unavailable")
    storage = tensor.untyped_storage()
    weak = make(storage.data_ptr(), tensor.device, storage.nbytes())
    out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    out.set_(weak, tensor.storage_offset(), tensor.size(), tensor.stride())
    return out
