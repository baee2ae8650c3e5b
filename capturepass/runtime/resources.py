"""Retention and workspaces for custom-op authors.

``retain(obj)``: called while capturepass captures a graph, keeps ``obj`` alive
exactly as long as that graph (its owner): an object whose device storage a
captured kernel bakes in (a binding, a plan, a scratch buffer) can no longer be
collected while the graph may replay (seed 003). When nothing is capturing it
does nothing and returns ``False``. Inside a capture that capturepass did not
start (an engine capturing around the model), the object is tied to the
compiled graph's own owner, since torch offers no handle to the outer graph.

``workspace(name, shape, dtype)``: scratch storage bound to the executing owner
and to the lane (stream) it is called on. Two owners (a target model and its
draft) or two lanes never share one. A workspace grows outside captures; a
request that would grow it during a capture raises, because reallocating under
a captured graph would leave the graph pointing at freed memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from capturepass.errors import CapturePassError
from capturepass.runtime import context
from capturepass.runtime.owner import GraphOwner

_unowned: dict[str, GraphOwner] = {}


def retain(obj: Any) -> bool:
    """Keeps ``obj`` alive as long as the graph being captured; returns whether it did.

    Args:
        obj: any Python object (typically the owner of device storage a captured
            kernel reads or writes).
    """
    owner = context.current_owner()
    if owner is None or owner.capturing is None:
        return False
    owner.keep(owner.capturing, [obj])
    return True


def workspace(name: str, shape: Sequence[int], dtype: torch.dtype = torch.uint8, device: Any = None) -> torch.Tensor:
    """Scratch storage of at least ``shape`` bound to the executing owner and lane.

    Args:
        name: the workspace's name (one buffer per owner, lane and name).
        shape: the shape of the returned view.
        dtype: its dtype.
        device: its device (default: the current CUDA device, else the CPU).

    Raises:
        CapturePassError: a bad name or shape, or growth during a capture.
    """
    if not isinstance(name, str) or not name:
        raise CapturePassError(f"workspace name must be a non-empty string, got {name!r}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise CapturePassError(f"workspace {name!r}: negative size in shape {shape}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    owner = context.current_owner()
    if owner is None:
        key = str(device)
        owner = _unowned.get(key)
        if owner is None:
            owner = _unowned[key] = GraphOwner("unowned", 1, device, captured=False)
    lane = owner.lane_of_stream(torch.cuda.current_stream(device)) if device.type == "cuda" else 0
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = owner.workspaces.get((lane, name))
    if buf is None or buf.numel() < nbytes or buf.device != device:
        if owner.capturing is not None:
            have = 0 if buf is None else buf.numel()
            raise CapturePassError(
                f"workspace {name!r} of owner {owner.name} on lane s{lane} would grow from {have} to {nbytes} "
                "bytes during a capture; reserve it before capturing (call the op once eagerly)"
            )
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        owner.workspaces[(lane, name)] = buf
    return buf[:nbytes].view(dtype).view(shape)
