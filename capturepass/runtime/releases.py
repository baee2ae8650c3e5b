"""Releasing an executor's capture owners: all of them, one model instance's, one capture's, or
those of the models whose static inputs live at given addresses.

A mixin of :class:`capturepass.runtime.executor.Executor`, which holds the tables it reads:
``_captures`` (capture key -> capture), ``_models`` (instance -> its name and shapes),
``_places`` (in-place plans), ``_eager_owners`` and ``_profile_owners`` (instance -> owner),
``_watchers`` (instance -> finalizers of its static inputs), ``_lock`` and ``_what``.
Releases that may run from a finalizer (a model or a caller's tensor collected) never wait
for the lock: a capture in progress on another thread keeps its owners, and the finalizer
tries again later (``runtime.lifetime``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from capturepass.runtime import comms
from capturepass.runtime.owner import GraphOwner
from capturepass.runtime.replay import Capture

log = logging.getLogger("capturepass")


class Releases:
    """The release methods of the executor (see the module)."""

    _captures: dict[tuple, Capture]
    _models: dict[tuple, Any]
    _places: Any
    _eager_owners: dict[tuple, Any]
    _profile_owners: dict[tuple, Any]
    _watchers: dict[tuple, list[Any]]
    _lock: Any
    _what: str
    _warned_bound: bool

    def release_captures(self) -> None:
        """Closes every capture owner (graphs, pools, leases, retained objects); the callable
        stays usable and captures again on its next call. Waits for a captured call in
        progress on another thread (its replay reads the graphs closed here)."""
        with self._lock:
            for cap in self._captures.values():
                cap.release()
            self._captures.clear()
            self._places.clear()
            self._warned_bound = False

    def release_instance(self, instance: tuple, why: str = "released") -> bool:
        """Closes every owner of one model instance; ``False`` if the callable is busy capturing
        on another thread (try again later)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            closed = self._release(lambda inst: inst == instance, forget=True)
        finally:
            self._lock.release()
        self._log_released(closed, why)
        return True

    def release_capture(self, key: tuple, cap: Capture | None, why: str) -> bool:
        """Closes the capture ``cap`` if it is still the one under ``key``; ``False`` if the
        callable is busy capturing on another thread (try again later)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if cap is None or self._captures.get(key) is not cap:
                return True
            del self._captures[key]
            model = self._models.get(key[0])
            cap.release()
        finally:
            self._lock.release()
        self._log_released([(model.name if model is not None else "?", cap.owner.name)], why)
        return True

    def release_addresses(self, addresses: set[int]) -> list[tuple[str, str]]:
        """Closes every owner of the model instances whose static inputs live at any of
        ``addresses``; returns them, as ``(model, owner)`` names. The models' communicators
        are the caller's to release (:func:`capturepass.runtime.comms.release_model`), in
        one order on every rank."""
        with self._lock:
            closed = self._release(lambda inst: not addresses.isdisjoint(inst))
        self._log_released(closed, "capturepass.release")
        return closed

    def _log_released(self, closed: list[tuple[str, str]], why: str) -> None:
        models: dict[str, list[str]] = {}
        for model, name in closed:
            models.setdefault(model, []).append(name)
        for model, names in models.items():
            log.info("capturepass: %s: released %d owner(s) of model %s (%s): %s",
                     self._what, len(names), model, ", ".join(names), why)

    def _release(self, match: Callable[[tuple], bool], forget: bool = False) -> list[tuple[str, str]]:
        """Closes the owners of the matching instances and returns them, as ``(model, owner)``
        names; with ``forget`` (the model died, or the callable is closed) also stops watching
        them and drops their names, so that a new model at the same addresses is a new
        instance. A model whose owners were released while it lives keeps its name and its
        capture shapes' numbers."""
        closed: list[tuple[str, str]] = []

        def close(instance: tuple, owner: GraphOwner, release: Callable[[], None] | None = None) -> None:
            model = self._models.get(instance)
            closed.append((model.name if model is not None else "?", owner.name))
            (release or owner.close)()

        for key in [k for k in self._captures if match(k[0])]:
            cap = self._captures.pop(key)
            close(key[0], cap.owner, cap.release)
        self._places.forget(match)
        for table in (self._eager_owners, self._profile_owners):
            for instance in [i for i in table if match(i)]:
                close(instance, table.pop(instance).owner)
        if forget:
            # The model died (or the callable did) at a moment of this rank's own: its
            # communicators, which its owners share, are dropped without a collective teardown.
            for model in dict.fromkeys(m for m, _ in closed if m != "?"):
                comms.release_model(model, in_step=False)
            for instance in [i for i in self._watchers if match(i)]:
                for finalizer in self._watchers.pop(instance):
                    finalizer.detach()
            for instance in [i for i in self._models if match(i)]:
                del self._models[instance]
        return closed

    def _release_all(self) -> None:
        self._release(lambda inst: True)
