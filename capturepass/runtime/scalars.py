"""Host scalars a capture holds: when a graph stops capturing new values of them.

A CUDA graph holds the value of every host scalar (a Python int or float Dynamo passes to the
graph) as a kernel argument, so each value takes a capture of its own, and the executor keys a
capture on them (``executor._shape_key``). A scalar that counts the calls (the length of a
sliding-window KV cache under Hugging Face's ``generate``) then makes a capture per call that
never replays: a warm-up and a capture (and with ``pick="measure"`` every candidate's) paid for
nothing. :class:`ScalarMisses` counts, per tensor shapes (any model instance), the captures made
in a row for values no replay came back to; after :data:`SCALAR_MISSES` of them, new values run
uncaptured (one warning names the scalars and their values), and a replay of a value captured
before resets the count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("capturepass")

SCALAR_MISSES = 3
"""Captures in a row, of one graph's tensor shapes, for host scalar values that no replay came
back to, before new values run uncaptured."""

_SCALARS = (int, float, bool)


def without_scalars(shape_key: tuple) -> tuple:
    """A shape key (``executor._shape_key``) with the values of host scalars left out (``None``
    in their place)."""
    return tuple(None if isinstance(k, _SCALARS) else k for k in shape_key)


class ScalarMisses:
    """The captures of one graph made for host scalar values that never replayed.

    Attributes:
        misses: per tensor shapes (:func:`without_scalars`), the ``(position, value)`` pairs of
            each capture made in a row that no replay has come back to; empty while no call of
            the graph has host scalars (the replay path checks it before anything else).
    """

    def __init__(self) -> None:
        self.misses: dict[tuple, list[tuple]] = {}
        self._warned = False

    def came_back(self, shape_key: tuple) -> None:
        """A replay of ``shape_key``: its tensor shapes' count starts again."""
        self.misses.pop(without_scalars(shape_key), None)

    def stop(self, shape_key: tuple, args: Sequence[Any], positions: Sequence[int],
             name: Callable[[int], str], what: str) -> bool:
        """Whether a call about to be captured, with ``shape_key`` over ``positions`` of ``args``,
        runs uncaptured instead (:data:`SCALAR_MISSES` captures in a row of its tensor shapes
        never replayed); otherwise counts this capture as one more. ``name`` names an input
        position; ``what`` the graph (the warning's)."""
        shapes = without_scalars(shape_key)
        if shapes == shape_key:
            return False  # no host scalar: shapes and instances are max_captures' to bound
        values = tuple((i, args[i]) for i in positions if i < len(args) and isinstance(args[i], _SCALARS))
        misses = self.misses.setdefault(shapes, [])
        if len(misses) < SCALAR_MISSES:
            misses.append(values)
            return False
        if not self._warned:
            self._warned = True
            calls = [dict(m) for m in [*misses, values]]
            changed = [i for i, _ in values if len({c.get(i) for c in calls}) > 1]
            seen = "; ".join(f"%{name(i)} = " + ", ".join(repr(c.get(i)) for c in calls) for i in changed)
            log.warning(
                "capturepass: %s: its last %d captures were made for values of its host scalar(s) that no "
                "capture of it held (%s, the last one now), and none of them replayed: a CUDA graph holds a "
                "scalar's value, so each value takes a capture of its own. Such calls run uncaptured from now "
                "on (values captured already still replay); pass a value that changes from call to call as a "
                "tensor to capture it once", what, len(misses), seen or "with another model instance",
            )
        return True
