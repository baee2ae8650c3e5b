"""Inputs captured in place: the inputs a capture reads and writes at the caller's own address.

Parameters and buffers (static inputs) are always read in place and key the model instance.
Of the other inputs, the capture of a shape reads and writes in place, with no copy in or
back, those the graph *writes* (a KV cache) and those that are a slice of a larger buffer (an
engine's input buffers, :func:`is_slice`): the addresses they had at capture join the
capture's key (:func:`capture_key`), so a replay only ever touches the tensor of the call at
hand.

The rule, per model instance and shapes (a *base*), kept by :class:`InPlacePlans`: the
first capture is made in place; when a later call brings one of those inputs at another
address (a caller that allocates a new tensor per call), that input is copied into a static
buffer from then on (:meth:`InPlacePlans.moved`), and the executor releases the captures made
on the old address. So a caller whose tensors stay put pays no copy, one whose tensors move
pays one extra capture per shape (at most one per input that moves, as they are found), and
captures never multiply per address.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

# (positions captured in place, their addresses at the base's first capture)
Plan = tuple[tuple[int, ...], tuple[int, ...]]


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
        # The plan of a base, if it has one: every captured call asks, so it is the dict's own method.
        self.get: Callable[[tuple], Plan | None] = self._plans.get

    def positions(self, args: Sequence[Any], given: Sequence[Any] | None = None) -> tuple[int, ...]:
        """Input positions to capture on the caller's tensor: written, or a slice of a larger buffer.

        With ``given`` (the caller's arguments, of which ``args`` are resized copies) only the
        positions that are the caller's own tensors qualify.
        """
        places = []
        for i, a in enumerate(args):
            if i in self._static or not isinstance(a, torch.Tensor) or a.layout != torch.strided:
                continue
            if given is not None and (i >= len(given) or a is not given[i]):
                continue
            if i in self._written or is_slice(a):
                places.append(i)
        return tuple(places)

    def plan(self, base: tuple, args: Sequence[Any], given: Sequence[Any] | None = None) -> Plan:
        """The plan of ``base``, decided (with ``args``' addresses) at its first capture."""
        plan = self._plans.get(base)
        if plan is None:
            places = self.positions(args, given)
            plan = self._plans[base] = (places, tuple(args[i].data_ptr() for i in places))
        return plan

    def moved(self, base: tuple, args: Sequence[Any]) -> list[int]:
        """The in-place positions of ``base`` whose tensor ``args`` bring at another address than
        at the first capture; they are copied from now on (dropped from the plan). An input
        back at its first address is not moved (its capture was released when the tensor died,
        and it is captured in place again)."""
        places, ptrs = self._plans[base]
        moved = [i for i, ptr in zip(places, ptrs) if args[i].data_ptr() != ptr]
        if moved:
            keep = [(i, ptr) for i, ptr in zip(places, ptrs) if i not in moved]
            self._plans[base] = (tuple(i for i, _ in keep), tuple(p for _, p in keep))
        return moved

    def clear(self) -> None:
        """Forgets every plan (the captures were released)."""
        self._plans.clear()

    def forget(self, match: Callable[[tuple], bool]) -> None:
        """Forgets the plans of the model instances ``match`` accepts."""
        for base in [b for b in self._plans if match(b[0])]:
            del self._plans[base]
