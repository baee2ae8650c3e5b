"""A capture that fails on an op: the op becomes a break and the graph is rebuilt, or the
graph stops capturing, saying why.

A mixin of :class:`capturepass.runtime.executor.Executor`, which holds what it reads and
writes: ``program``, ``_what``, ``not_capturable`` (node -> reason), ``_rebuild`` (the graph's
passes again with given breaks, or ``None``), ``_rebuilds``, ``_captures`` and ``_places``, and
the methods ``_release_all`` and ``_adopt``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from capturepass.ir.capabilities import REGISTRY
from capturepass.runtime import capture
from capturepass.runtime.replay import CaptureFailure

log = logging.getLogger("capturepass")

# A graph is rebuilt at most this many times for ops that failed under capture; then it
# runs uncaptured (a graph of many such ops is better off eager).
MAX_REBUILDS = 8

# Ops already reported as not capturable in this process (each is logged once).
_warned_ops: set[str] = set()


class CaptureFailures:
    """The capture-failure methods of the executor (see the module)."""

    program: Any
    _what: str
    not_capturable: dict[str, str]
    uncaptured_reason: str | None
    captured: bool
    _rebuild: Callable[[dict[str, str]], Any] | None
    _rebuilds: int
    _captures: dict[tuple, Any]
    _places: Any

    def _capture_failed(self, failure: CaptureFailure) -> None:
        """Makes the op a failed capture stumbled on a break (or turns capture off, saying why)."""
        program = self.program
        piece = program.pieces[failure.piece]
        error = failure.error
        where = f"segment {piece.segment} of the {self._what}" + (f" (owner {failure.owner})" if failure.owner else "")
        culprits = self._learned_in(piece)
        if not culprits:
            try:
                found = capture.first_failing_node(program, failure.piece, failure.env, failure.device)
            finally:
                failure.put_back()
            if found is None:
                self._stop_capturing(
                    f"capturing {where} failed ({type(error).__name__}: {error}), and no single op of it fails "
                    "when captured alone, so no break can help"
                )
                return
            if found.opaque:
                REGISTRY.learn(found.op, found.reason)
            if found.op not in _warned_ops:
                _warned_ops.add(found.op)
                log.warning("capturepass: %s cannot be captured (%s: %s); %%%s runs eagerly as a break between "
                            "captured segments from now on", found.op, type(found.error).__name__,
                            str(found.error).strip().splitlines()[0] if str(found.error).strip() else "",
                            found.node)
            culprits = [(found.node, found.reason)]
        self.not_capturable.update(culprits)
        if self._rebuild is None:
            self._stop_capturing(f"%{culprits[0][0]} failed under capture ({culprits[0][1]}), and this graph "
                                 "cannot be rebuilt with it as a break")
            return
        if self._rebuilds >= MAX_REBUILDS:
            self._stop_capturing(f"{MAX_REBUILDS} ops failed under capture, the last %{culprits[0][0]}")
            return
        self._rebuilds += 1
        try:
            rebuilt = self._rebuild(dict(self.not_capturable))
        except Exception as exc:  # noqa: BLE001 - e.g. the op requires a monolithic graph
            self._stop_capturing(f"%{culprits[0][0]} failed under capture, and rebuilding the graph with it as a "
                                 f"break failed ({type(exc).__name__}: {exc})")
            return
        self._release_all()
        self._adopt(rebuilt)
        log.info("capturepass: %s rebuilt with %s as break(s); the next call captures it",
                 self._what, ", ".join(f"%{n}" for n, _ in culprits))

    def _learned_in(self, piece: Any) -> list[tuple[str, str]]:
        """Nodes of ``piece`` whose op the registry learned not capturable after this program was built."""
        learned = REGISTRY.learned()
        if not learned:
            return []
        found = []
        for step in piece.steps:
            if step.kind != "region":
                continue
            for node in step.payload.graph.graph.nodes:
                if node.op == "call_function" and node.name not in self.not_capturable:
                    why = learned.get(capture.op_name(node))
                    if why is not None:
                        found.append((node.name, why))
        return found

    def _stop_capturing(self, reason: str) -> None:
        self.uncaptured_reason = reason
        self.captured = False
        log.warning("capturepass: the %s runs uncaptured from now on: %s", self._what, reason)
        for cap in self._captures.values():
            cap.release()
        self._captures.clear()
        self._places.clear()
