"""The executing owner of the current thread, for custom ops that call back into capturepass.

The runtime sets it around every call of a compiled graph (eager, capture,
replay set-up, or inside an outer capture); ``capturepass.retain`` and
``capturepass.workspace`` read it.

A tool that observes the runtime (``capturepass.trace``) installs an
:class:`Instrumentation` for the current thread with :func:`instrumented`:
every compiled-graph call, every run of an owner (inside a call: a replay with
its copies in and out, an uncaptured run, a capture) and every region call of
that thread then runs inside the context managers it returns (profiler ranges,
say). Other threads are not affected.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capturepass.runtime.owner import GraphOwner


class _State(threading.local):
    """This thread's instrumentation and executing owner. Class-level defaults: reading an
    attribute a ``threading.local`` lacks goes through a raised and caught ``AttributeError``
    (about 0.3 us), and the instrumentation is read on every call and region call."""

    instrumentation: "Instrumentation | None" = None
    owner: "GraphOwner | None" = None


#: This thread's state (``instrumentation``, ``owner``). Public for the one caller that cannot
#: afford a function call to read and set them: an uncaptured call of a small graph
#: (``Executor.__call__``), where each Python call costs about a tenth of a microsecond. Anything
#: else uses the functions below.
state = _State()


class Instrumentation:
    """What an observer wraps around calls (each a callable returning a context manager).

    Args:
        graph: called with the executor of each compiled-graph call.
        region: called with the ``RegionSpec`` of each region call.
        owner: called with the ``GraphOwner`` whose run starts (see :func:`running`).
    """

    def __init__(
        self,
        graph: Callable[[Any], contextlib.AbstractContextManager] | None = None,
        region: Callable[[Any], contextlib.AbstractContextManager] | None = None,
        owner: Callable[[Any], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.graph = graph
        self.region = region
        self.owner = owner


def instrumentation() -> Instrumentation | None:
    """The instrumentation of this thread, if any."""
    return state.instrumentation


class _set:
    """Sets this thread's ``name`` to ``value`` inside the block, and back after it.

    A class, not a generator: every uncaptured call enters one, and a generator-based context
    manager costs several times as much.
    """

    __slots__ = ("name", "value", "prev")

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        self.prev = getattr(state, self.name)
        setattr(state, self.name, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(state, self.name, self.prev)


def instrumented(inst: Instrumentation) -> contextlib.AbstractContextManager:
    """Installs ``inst`` for this thread inside the block (an inner one replaces an outer one)."""
    return _set("instrumentation", inst)


def current_owner() -> "GraphOwner | None":
    """The owner whose graph this thread is running, if any."""
    return state.owner


def current_segment() -> int | None:
    """The segment being captured by the current owner, if a capture is in progress."""
    owner = current_owner()
    return None if owner is None else owner.capturing


def running(owner: "GraphOwner") -> contextlib.AbstractContextManager:
    """Marks ``owner`` as the executing owner of this thread inside the block (inside the
    instrumentation's ``owner`` context too, when one is installed)."""
    inst = instrumentation()
    if inst is None or inst.owner is None:
        return _set("owner", owner)
    return _observed(owner, inst.owner)


@contextlib.contextmanager
def _observed(owner: "GraphOwner", observe: Callable[[Any], contextlib.AbstractContextManager]) -> Iterator[None]:
    with observe(owner), _set("owner", owner):
        yield
