"""Copies that undo what capturepass's own runs write into a caller's tensors.

Warm-ups that are not the call (the measured choice's other candidates, a chosen candidate
captured again, ``capture_sizes``) and the measured choice's timed replays write the inputs
the graph updates in place: a KV cache, a running sum, a counter. The caller must see none of
it, so the warm-ups run on copies and the replays are undone from copies. A cache may have
been sized to the memory the GPU had left, where a copy beside it cannot be made: copies that
would take more than :data:`ASIDE_SHARE` of what the device can still allocate are made on
the host instead (the warm-up then runs on the caller's tensor, put back from the host after
it), slower but within memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from capturepass.runtime import files

ASIDE_SHARE = 0.5
"""The share of a device's spare memory (:func:`spare_bytes`) that copies may take on it."""


def spare_bytes(device: torch.device) -> int | None:
    """What a CUDA device can still allocate: its free memory and the caching allocator's blocks
    that hold nothing; ``None`` elsewhere (the host: no limit taken), and where the driver does not
    say (logged once: copies are then made beside their tensors, as before this check)."""
    if device.type != "cuda":
        return None
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except RuntimeError as e:
        files.warn_once(f"mem_get_info:{device}", "capturepass: cannot read the free memory of %s (%s); copies of "
                        "the inputs a graph writes are made on it", device, e)
        return None
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def on_host(tensors: Sequence[torch.Tensor]) -> dict[torch.device, tuple[int, int]]:
    """The devices of ``tensors`` whose copies go to the host: ``{device: (bytes to copy,
    bytes it has to spare)}`` where the copies would take more than :data:`ASIDE_SHARE` of it."""
    need: dict[torch.device, int] = {}
    for t in tensors:
        need[t.device] = need.get(t.device, 0) + t.nbytes
    host = {}
    for device, nbytes in need.items():
        left = spare_bytes(device)
        if left is not None and nbytes > ASIDE_SHARE * left:
            host[device] = (nbytes, left)
    return host


def copy_aside(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A copy of ``t``: on the host, or beside it."""
    return t.to("cpu", copy=True) if host else t.clone()


def describe(host: dict[torch.device, tuple[int, int]]) -> str:
    """``"12.0 MiB (cuda:0 has 20.0 MiB to spare)"`` for each device of :func:`on_host`'s answer."""
    return ", ".join(f"{nbytes / 2**20:.1f} MiB ({device} has {left / 2**20:.1f} MiB to spare)"
                     for device, (nbytes, left) in host.items())
