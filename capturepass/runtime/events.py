"""EventPool: CUDA events leased by role, owner and scope, never shared between them.

An event recorded inside a stream capture is part of how that capture tracks
its cross-stream dependencies; an event that eager code (or another owner's
capture) records in the meantime can alias it (the bug seed 000 fixed by hand).
The pool therefore hands out events per *lease key* ``(owner, scope, role)``:

- a lease taken while capturing belongs to the capturing owner and that capture
  (scope ``"capture:<n>"``), and lives until the owner is closed;
- eager execution gets private reusable leases (scope ``"eager"``): the same
  owner reuses them call after call, nobody else ever sees them;
- roles (fork, join, and roles custom ops name) have separate free lists, so a
  role's events are never borrowed by another.

No event object is ever handed to two lease keys: ``counters`` and
``leases()`` let tests assert it.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch


class EventPool:
    """Process-wide accounting of event leases."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str, str], list[Any]] = {}
        self.counters: Counter = Counter()

    def acquire(self, owner: str, scope: str, role: str) -> Any:
        """A new event for ``(owner, scope, role)``; it serves that key alone."""
        event = torch.cuda.Event() if torch.cuda.is_available() else object()
        with self._lock:
            self._by_key.setdefault((owner, scope, role), []).append(event)
            self.counters["created"] += 1
            self.counters[f"role_{role}"] += 1
            self.counters["live"] += 1
        return event

    def release_owner(self, owner: str) -> int:
        """Drops every lease of ``owner`` (after its lanes were synchronized); returns how many."""
        with self._lock:
            keys = [k for k in self._by_key if k[0] == owner]
            n = sum(len(self._by_key.pop(k)) for k in keys)
            self.counters["live"] -= n
            self.counters["released"] += n
        return n

    def leases(self) -> list[tuple[str, str, str, int]]:
        """``(owner, scope, role, id(event))`` of every live lease."""
        with self._lock:
            return [(k[0], k[1], k[2], id(e)) for k, events in self._by_key.items() for e in events]

    def live(self, owner: str | None = None) -> int:
        """How many leases are live (of ``owner``, or in all)."""
        with self._lock:
            return sum(len(v) for k, v in self._by_key.items() if owner is None or k[0] == owner)


POOL = EventPool()
