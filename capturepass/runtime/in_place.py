"""Inputs captured in place: the inputs a capture reads and writes at the caller's own address.

Parameters and buffers (static inputs) are always read in place and key the model instance.
Of the other inputs, the capture of a shape reads and writes in place, with no copy in or
back, those the graph *writes* (a KV cache) and those that are a slice of a larger buffer (an
engine's input buffers, :func:`is_slice`): the addresses they had at capture join the
capture's key (:func:`capture_key`), so a replay only ever touches the tensor of the call at
hand.

The rule, per model instance and shapes (a *base*), kept by :class:`InPlacePlans`: the
first capture is made in place; when a later call brings one of those inputs at another
address (a caller that allocates a new tensor per call, or a new cache per generation), that
input is copied into a static buffer (:meth:`InPlacePlans.moved`), the executor releases the
captures made on the old address, and the input is watched as a whole read-only input is
(below): if it then stays put, it is captured in place again at its new address. So a caller
whose tensors stay put pays no copy, one whose tensors move at every call pays one extra
capture per shape (at most one per input that moves, as they are found) and a copy per call,
one whose cache moves once in a while pays two captures per move (one copying, one in place)
instead of a copy of the cache per call, and captures never multiply per address. A slice that
keeps moving soon after each capture in place (a caller taking turns between two buffers) is
copied for good after :data:`SLICE_TURNS` such turns.

A whole tensor the graph only reads (an input made for the call, or a buffer a caller keeps
and refills: a benchmark's input, a decoder's token buffer) starts copied, since most callers
make one per call. The plan watches where it comes (:meth:`InPlacePlans.observe`): once
:data:`STEADY_CALLS` call(s) in a row found it where the call before had it, the capture is made
again on it in place (:meth:`InPlacePlans.promote`), and from then on it costs no copy. One call
suffices: the next call is still early in any warm-up, and a wrong guess costs one capture. If it moves after
that, it is copied for good (``moved``): at most two more captures per shape, and none for a
caller whose tensors never stay put. A written input too large for its device to spare a buffer
of its size (``runtime.aside``: a KV cache sized to the memory left) is never copied: it stays
in place at each new address, a capture per address.

Memory a replay hands out (an output over a non-owning alias of a graph's pool, ``runtime.
outputs``) is never captured in place (:func:`owns_memory`): the replay that reads it may
first copy it out of the pool, or write the pool under it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from capturepass.runtime import aside

# (positions captured in place, their addresses at the base's first capture)
Plan = tuple[tuple[int, ...], tuple[int, ...]]

# Calls in a row that must find a whole read-only input where the call before had it before
# it is captured in place (the call that finds it the last time captures instead of replaying).
STEADY_CALLS = 1
# Addresses a whole read-only input may take before the plan stops watching it (copied for good).
MAX_MOVES = 4
# A slice of a caller's buffer that moves is captured in place again where it then stays (an
# engine that reallocated its buffers), unless its capture in place served fewer than
# SLICE_REPLAYS calls before it moved, SLICE_TURNS times: a caller alternating two buffers every few
# calls would otherwise pay two captures at every turn (a copy of a read-only slice per call costs
# microseconds; a capture, a warm-up and a capture). From then on it is copied for good.
SLICE_REPLAYS = 256
SLICE_TURNS = 2
# What becomes of inputs captured in place that came at another address (:meth:`InPlacePlans.moved`),
# in the log's words.
STAYS = "captured in place there, as the device cannot spare a buffer of their size"
WATCHED = ("copied into buffers while they move (captured in place again once one stays put; a capture per "
           "address would spend max_captures)")
MADE_PER_CALL = ("in place only while they stayed put, they are made per call after all: copied into buffers "
                 "from now on")
SHORT_TURNS = (f"copied into buffers from now on (a capture in place served fewer than {SLICE_REPLAYS} calls "
               f"before they moved, {SLICE_TURNS} times: a caller taking turns between buffers, where a capture "
               "at every turn costs more than their copies)")
NOT_PLAIN = "copied into buffers from now on (not a plain tensor with elements that a capture may read in place)"
# The watch of an input first captured ahead of any call at its shape (``capture_sizes``), on a
# resized copy of capturepass's own or on the caller's tensor: the caller's first call there is
# not steady. A copy's address must not count (the allocator hands its freed block to the
# caller's next tensor, which would then look like a buffer that stayed put), nor the caller's
# (the call that captured ahead replays next on its own tensors).
_NOWHERE = -1


def capture_key(base: tuple, plan: Plan | None, args: Sequence[Any]) -> tuple:
    """A capture's key: model instance, shapes, and the addresses of the inputs captured in place."""
    if not plan or not plan[0]:
        return (*base, ())
    return (*base, tuple(args[i].data_ptr() for i in plan[0]))


def is_slice(t: torch.Tensor) -> bool:
    """Whether ``t`` covers less than its storage: a slice of a buffer kept across calls (an
    engine's input buffers), unlike a tensor made for the call."""
    if t.numel() == 0:
        return False
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.untyped_storage().nbytes() > extent * t.element_size()


def owns_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage owns its memory through an allocator (a resizable storage).

    A replayed output handed out over a non-owning alias of its graph's pool is not: a later
    replay of the model copies it out first (the alias moves) or writes the pool under it, so
    no capture may read it where it lies. Memory from outside torch (``from_dlpack``) is not
    either; it is copied, which is always safe.
    """
    return t.untyped_storage().resizable()


class InPlacePlans:
    """The in-place plan of every base (model instance, shapes) of one program.

    Args:
        static_inputs: the program's static input positions (always in place, never planned).
        written: the input positions the program writes.
    """

    def __init__(self, static_inputs: Collection[int], written: Collection[int]) -> None:
        self._static = frozenset(static_inputs)
        self._written = frozenset(written)
        self._plans: dict[tuple, Plan] = {}
        # Whole read-only inputs still watched, per base: position -> [address, replays there, moves].
        self._steady: dict[tuple, dict[int, list[int]]] = {}
        # Slices that moved soon after their capture in place, per base: position -> how often.
        self._turns: dict[tuple, dict[int, int]] = {}
        # The plan of a base, if it has one: every captured call asks, so it is the dict's own method.
        self.get: Callable[[tuple], Plan | None] = self._plans.get
        # The whole read-only inputs of a base still watched, if any (every replay asks).
        self.watching: Callable[[tuple], dict[int, list[int]] | None] = self._steady.get

    def positions(self, args: Sequence[Any], given: Sequence[Any] | None = None) -> tuple[int, ...]:
        """Input positions to capture on the caller's tensor: written, or a slice of a larger buffer.

        With ``given`` (the caller's arguments, of which ``args`` are resized copies) only the
        positions that are the caller's own tensors qualify.
        """
        return tuple(i for i in self._callers(args, given) if i in self._written or is_slice(args[i]))

    def _callers(self, args: Sequence[Any], given: Sequence[Any] | None) -> list[int]:
        """Non-static positions holding a strided tensor of the caller's that owns its memory."""
        places = []
        for i, a in enumerate(args):
            if i in self._static or not isinstance(a, torch.Tensor) or a.layout != torch.strided:
                continue
            if given is not None and (i >= len(given) or a is not given[i]):
                continue
            if owns_memory(a):
                places.append(i)
        return places

    def plan(self, base: tuple, args: Sequence[Any], given: Sequence[Any] | None = None) -> Plan:
        """The plan of ``base``, decided (with ``args``' addresses) at its first capture; the whole
        read-only inputs of the caller are watched from then on (:meth:`observe`)."""
        plan = self._plans.get(base)
        if plan is None:
            places = self.positions(args, given)
            plan = self._plans[base] = (places, tuple(args[i].data_ptr() for i in places))
            # Watched whoever's they are now: after ``capture_sizes``' resized copies, the calls bring
            # the caller's own.
            steady = {}
            for i in self._callers(args, None):
                if i in places or i in self._written or not _plain(args[i]):
                    continue
                # From no address where this is a capture ahead (``given``: ``capture_sizes``), on a
                # copy of ours or on the caller's tensor: the call that made it replays next on the
                # same tensors, which says nothing of where the caller keeps them; and the caller's
                # first is not a move.
                steady[i] = [args[i].data_ptr(), 0, 0] if given is None else [_NOWHERE, 0, -1]
            if steady:
                self._steady[base] = steady
        return plan

    def observe(self, base: tuple, args: Sequence[Any]) -> tuple[int, ...]:
        """Counts a call of ``base`` (which :attr:`watching`) that found its capture; returns the
        watched positions that :data:`STEADY_CALLS` such calls in a row found where the call
        before had them (to :meth:`promote`), or ``()``."""
        steady = self._steady.get(base)
        if steady is None:
            return ()
        ready = []
        for i, seen in list(steady.items()):
            a = args[i]
            ptr = a.data_ptr()
            if ptr == seen[0]:
                seen[1] += 1
                if seen[1] >= STEADY_CALLS:
                    if owns_memory(a):
                        ready.append(i)
                        continue
                    seen[1] = 0  # an output handed back at the address of the last: never in place
                continue
            seen[0], seen[1], seen[2] = ptr, 0, seen[2] + 1
            if seen[2] > MAX_MOVES:
                del steady[i]  # a new tensor per call: copied for good
        if not steady:
            self._steady.pop(base, None)
        return tuple(ready)

    def saw(self, base: tuple, args: Sequence[Any]) -> None:
        """Notes the addresses of a call of ``base`` that captures (which :attr:`watching`): the
        next call counts as steady only where it finds its inputs at these."""
        for i, seen in self._steady.get(base, {}).items():
            seen[0], seen[1] = args[i].data_ptr(), 0

    def promote(self, base: tuple, args: Sequence[Any], positions: Collection[int]) -> Plan:
        """Adds ``positions`` (watched inputs that stayed put: whole read-only ones, and written
        ones that moved) to the plan of ``base``, at their addresses in ``args``; they are no
        longer watched. Returns the new plan."""
        steady = self._steady.get(base, {})
        for i in positions:
            steady.pop(i, None)
        if not steady:
            self._steady.pop(base, None)
        places, ptrs = self._plans[base]
        merged = sorted({**dict(zip(places, ptrs)), **{i: args[i].data_ptr() for i in positions}}.items())
        plan = self._plans[base] = (tuple(i for i, _ in merged), tuple(p for _, p in merged))
        return plan

    def watched(self, places: Collection[int], args: Sequence[Any]) -> frozenset[int]:
        """The in-place positions among ``places`` whose capture goes when their storage dies: the
        written inputs and slices. A whole read-only input (in place because it stayed put) is
        not: a caller that makes a new tensor per call at a recycled address would otherwise
        release and capture again at every call, while a capture keyed on a dead address is
        harmless (a replay runs only for a tensor at that address, and the replay writes no
        memory that was the caller's when it was captured)."""
        return frozenset(i for i in places if self.kept_by_caller(i, args))

    def kept_by_caller(self, i: int, args: Sequence[Any]) -> bool:
        """Whether input ``i`` is a tensor its caller keeps across calls (written by the graph, or a
        slice of a larger buffer) rather than one made per call."""
        return i in self._written or is_slice(args[i])

    def moved(self, base: tuple, args: Sequence[Any], served: int | None = None) -> dict[int, str]:
        """The in-place positions of ``base`` whose tensor ``args`` bring at another address than
        at the first capture, each with what becomes of it (:data:`WATCHED` and the others, in
        order). They are copied from now on (dropped from the plan), except a written one that
        its device cannot spare a buffer for (``runtime.aside``), which stays in the plan at its
        new address. An input back at its first address is not moved (its capture was released
        when the tensor died, and it is captured in place again). ``served``: the calls the
        capture on the old addresses ran, if it is still there (see :data:`SLICE_REPLAYS`)."""
        places, ptrs = self._plans[base]
        moved: dict[int, str] = {i: "" for i, ptr in zip(places, ptrs) if args[i].data_ptr() != ptr}
        if moved:
            # A written input whose device cannot spare a buffer of its size (a cache sized to the
            # memory left) stays in place, at its new address: a capture per address it takes.
            stay = {i for i in moved if i in self._written and aside.on_host([args[i]])}
            keep = [(i, args[i].data_ptr() if i in stay else ptr) for i, ptr in zip(places, ptrs)
                    if i not in moved or i in stay]
            self._plans[base] = (tuple(i for i, _ in keep), tuple(p for _, p in keep))
            # A tensor the caller keeps (a written input, a slice of its buffer) is watched from
            # here as a whole read-only input is: a cache that moved once (a new one per
            # generation) and then stays put is captured in place again at its new address,
            # instead of being copied in and back at every call; one that keeps moving is copied
            # for good after MAX_MOVES. A whole read-only input, in place only because it stayed
            # put, is copied for good once it moves: it is made per call after all, and where the
            # allocator hands it back at one address for a while and then elsewhere, watching it
            # again would capture twice at every such turn (a copy costs less than a capture).
            steady = self._steady.setdefault(base, {})
            turns = self._turns.setdefault(base, {})
            for i in moved:
                written, kept = i in self._written, self.kept_by_caller(i, args)
                if kept and not written and served is not None and served < SLICE_REPLAYS:
                    turns[i] = turns.get(i, 0) + 1
                if i in stay:
                    moved[i] = STAYS
                elif not kept:
                    moved[i] = MADE_PER_CALL
                elif not _plain(args[i]):
                    moved[i] = NOT_PLAIN
                elif not written and turns.get(i, 0) >= SLICE_TURNS:
                    moved[i] = SHORT_TURNS
                else:
                    moved[i] = WATCHED
                    steady[i] = [args[i].data_ptr(), 0, 1]
            if not steady:
                del self._steady[base]
            if not turns:
                del self._turns[base]
        return moved

    def clear(self) -> None:
        """Forgets every plan (the captures were released)."""
        self._plans.clear()
        self._steady.clear()
        self._turns.clear()

    def forget(self, match: Callable[[tuple], bool]) -> None:
        """Forgets the plans of the model instances ``match`` accepts."""
        for base in [b for b in self._plans if match(b[0])]:
            del self._plans[base]
            self._steady.pop(base, None)
            self._turns.pop(base, None)


def _plain(t: torch.Tensor) -> bool:
    """An input that may be captured in place once it stays put (a whole read-only one, or a
    written one that moved): a plain tensor (a subclass may keep state of its own) with
    elements, not requiring grad."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() > 0 and not t.requires_grad
