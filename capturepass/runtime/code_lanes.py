"""The calls that code rewritten by ``capturepass.backends.fused_lanes`` makes.

A compile with lanes after fusion holds two bodies of Inductor's ``call``: one lane's, as
Inductor wrote it, and one whose launches run on lanes. The second runs while a caller has
bound side streams (:class:`bind`, which the owner's region runner does around the call:
its lane ``k`` runs on ``streams[k - 1]``, the caller's stream where that is ``None``), the
first otherwise. The lanes' body calls ``enter`` at its start (the stream current then is
the main lane: the capturing one under capture), ``switch`` before the launches of another
lane, ``record`` and ``wait`` on event slots, and ``leave`` at its end (the main lane waits
for every side lane it switched to and is current again).

Event slots are this thread's, per device and capture state: a call issues every wait of its
records before it returns, so the next call's record of a slot cannot overtake a wait of this
one's; an event recorded in a capture is one of its edges, and one recorded eagerly meanwhile
must not alias it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class _Thread(threading.local):
    frames: list["Frame"] | None = None
    events: dict[tuple[int, int, bool], Any] | None = None
    bound: Sequence[Any] | None = None
    event_of: Callable[[int], Any] | None = None


_local = _Thread()


class Frame:
    """One running call: its entry stream, its side lanes' streams, its device."""

    __slots__ = ("device", "entry", "streams", "used", "capturing", "event_of")

    def __init__(self, device: int, streams: Sequence[Any], event_of: Callable[[int], Any] | None) -> None:
        self.device = device
        # A host compile's code (device -1): its lanes run in program order, nothing to switch.
        self.entry = torch.cuda.current_stream(device) if device >= 0 else None
        self.streams = streams if device >= 0 else ()
        self.used: dict[int, Any] = {}
        self.capturing = device >= 0 and torch.cuda.is_current_stream_capturing()
        self.event_of = event_of

    def stream(self, lane: int) -> Any:
        if lane == 0 or lane > len(self.streams) or self.streams[lane - 1] is None:
            return self.entry
        stream = self.streams[lane - 1]
        self.used[lane] = stream
        return stream

    def event(self, slot: int) -> Any:
        if self.event_of is not None:
            return self.event_of(slot)
        pool = _local.events
        if pool is None:
            pool = _local.events = {}
        key = (self.device, slot, self.capturing)
        got = pool.get(key)
        if got is None:
            got = pool[key] = torch.cuda.Event()
        return got


def active() -> bool:
    """Whether lanes are bound (:class:`bind`): the lanes' body runs. Called by every call of
    the generated code; a lane bound to ``None`` runs on the caller's stream, so binding only
    ``None`` is correct too (the owner binds only where a side stream exists)."""
    return _local.bound is not None


def enter(device: int) -> None:
    """Starts a call on ``device``: the current stream is its main lane."""
    if _local.frames is None:
        _local.frames = []
    _local.frames.append(Frame(device, _local.bound or (), _local.event_of))


def switch(lane: int) -> None:
    """Makes ``lane``'s stream current."""
    f = _local.frames[-1]  # type: ignore[index]
    if f.entry is not None:
        torch.cuda.set_stream(f.stream(lane))


def record(slot: int) -> None:
    """Records event ``slot`` on the current stream."""
    f = _local.frames[-1]  # type: ignore[index]
    if f.entry is not None:
        f.event(slot).record(torch.cuda.current_stream(f.device))


def wait(slot: int) -> None:
    """Makes the current stream wait for event ``slot``."""
    f = _local.frames[-1]  # type: ignore[index]
    if f.entry is not None:
        torch.cuda.current_stream(f.device).wait_event(f.event(slot))


def leave() -> None:
    """Ends the call: the main lane waits for every side lane it used and is current again."""
    f = _local.frames.pop()  # type: ignore[union-attr]
    if f.entry is None:
        return
    for lane, stream in f.used.items():
        done = f.event(-lane)
        done.record(stream)
        f.entry.wait_event(done)
    torch.cuda.set_stream(f.entry)


class bind:
    """Within the block, the lanes' body runs, side lane ``k`` on ``streams[k - 1]``, with the
    event of each slot from ``event_of`` (an owner's leases; by default this thread's). A call
    that raised inside leaves the stream current at the block's start current again."""

    def __init__(self, streams: Sequence[Any], event_of: Callable[[int], Any] | None = None) -> None:
        self.streams = streams
        self.event_of = event_of

    def __enter__(self) -> "bind":
        self.prev = (_local.bound, _local.event_of)
        _local.bound, _local.event_of = self.streams, self.event_of
        self.depth = len(_local.frames or ())
        return self

    def __exit__(self, *exc: object) -> None:
        _local.bound, _local.event_of = self.prev
        frames = _local.frames
        if frames is not None and len(frames) > self.depth:
            entry = frames[self.depth].entry
            del frames[self.depth:]
            if entry is not None:
                torch.cuda.set_stream(entry)
