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

import logging
from collections.abc import Mapping, Sequence

import torch

from capturepass.runtime import files

log = logging.getLogger("capturepass")

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


def kept(tensors: Sequence[torch.Tensor], what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tensor, copy)`` for each of ``tensors``: what they hold now, to put back after ``what``
    runs (:func:`put_back`); on the host where their device cannot spare the copies (logged)."""
    host = on_host(tensors)
    if host:
        log.info("capturepass: %s: the inputs the graph writes are kept on the host until put back: %s",
                 what, describe(host))
    return [(t, copy_aside(t, t.device in host)) for t in tensors]


def scratch(tensors: Mapping[int, torch.Tensor], before: Mapping[int, torch.Tensor],
            what: str) -> tuple[dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """What a run that must leave the caller's ``tensors`` (by position) as they are runs on:
    a copy of ``before[i]`` where given (what the call read), else a copy of the tensor beside
    it, or, where its device cannot spare the copies, the tensor itself, with a copy on the host
    in ``undo`` to put back after the run (:func:`put_back`; logged, naming ``what``). Returns
    ``(run, undo)``."""
    host = on_host([t for i, t in tensors.items() if i not in before])
    if host:
        log.info("capturepass: %s runs on the caller's inputs the graph writes, put back from the host "
                 "after it: %s", what, describe(host))
    run: dict[int, torch.Tensor] = {}
    undo: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, t in tensors.items():
        if i in before:
            run[i] = before[i].clone()
        elif t.device in host:
            run[i] = t
            undo.append((t, copy_aside(t, True)))
        else:
            run[i] = t.clone()
    return run, undo


def put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each ``(tensor, copy)`` of ``saved`` (:func:`kept`, :func:`scratch`) back into its
    tensor, then empties it: the copies, of a whole cache perhaps, are not held past this."""
    for t, copy in saved:
        t.copy_(copy)
    saved.clear()
