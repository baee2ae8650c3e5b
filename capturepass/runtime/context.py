"""The executing owner of the current thread, for custom ops that call back into capturepass.

The runtime sets it around every call of a compiled graph (eager, capture,
replay set-up, or inside an outer capture); ``capturepass.retain`` and
``capturepass.workspace`` read it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capturepass.runtime.owner import GraphOwner

_state = threading.local()


def current_owner() -> "GraphOwner | None":
    """The owner whose graph this thread is running, if any."""
    return getattr(_state, "owner", None)


def current_segment() -> int | None:
    """The segment being captured by the current owner, if a capture is in progress."""
    owner = current_owner()
    return None if owner is None else owner.capturing


@contextlib.contextmanager
def running(owner: "GraphOwner") -> Iterator[None]:
    """Marks ``owner`` as the executing owner of this thread."""
    prev = getattr(_state, "owner", None)
    _state.owner = owner
    try:
        yield
    finally:
        _state.owner = prev
