"""An interleaving simulator of a compiled graph's lanes, with an adversarial allocator.

The simulator runs the annotated ATen graph that the pipeline produced (or the one an emitted
:class:`~capturepass.runtime.program.Program` was built from) node by node with real tensors,
the way a GPU would run it: the host walks the program order and *issues* each node onto its
lane's queue; each lane runs its queue in order; a seeded adversarial scheduler interleaves the
host and the lanes, honouring only

- the order within each lane,
- the inserted events: a ``capturepass.wait`` blocks its lane until the record it is bound to has
  run. As with CUDA events, a wait is bound when the host issues it, to the last record of the
  same event object (the lease) issued before it; a wait on an event never recorded does nothing;
- host synchronisations: a node whose value the host needs (``.item()``) blocks the host until
  it has run.

Host model. View ops, tuple selections and size arithmetic run on the host when issued (they
touch no data). FX frees a value right after its last use in program order, and a
``capturepass.release`` is such a use: the storage of a root (the node that allocated it) is freed
by the host right after the last use of the root or of any of its views. The allocator hands
every block freed on a lane to the next allocation issued on the same lane (the caching
allocator's per-stream free list); when that allocation's kernel runs, it overwrites the block
with poison (NaN, a sentinel for integers, flipped booleans). Each allocation itself starts out
poisoned (uninitialised memory). So a read that runs before its producer, or after its block was
handed on, sees poison, and the result differs from serial execution: that is the oracle.

Given an emitted :class:`~capturepass.runtime.program.Program`, the host issues the nodes in
the program's own order instead (its steps in turn, each region's nodes when the region is
called), and values that cross pieces stay alive until the call returns, as in the program's
environment: this checks emit's ordering of regions, waits and releases too.

Capture model (``replay=True``, captured graphs only). A captured segment bakes in the addresses
of the static inputs and constants it reads; after the capture the caller may drop them. Those a
segment does not retain (``capturepass.retain``) are freed and reused before the replay, which is
simulated by poisoning them before the run.

Happens-before. Independently of the interleaving, a vector clock per lane (and one for the host)
follows the same events; every storage access is checked against the last write and the reads
since, and each unordered pair is reported as a :class:`Race` naming both nodes. A race is
reported even when no interleaving of this run happened to expose it.

Example::

    report = explore(gm, inputs, seeds=range(20))
    assert report.ok, report.describe()
"""


from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import SimulationError
from capturepass.testing.simulate.engine import _reference, _Sim
from capturepass.testing.simulate.graph import _Plan, _plan_of, graph_module
from capturepass.testing.simulate.memory import Race, SimResult, _clone, seeded_rng

__all__ = [
    "Race", "SimResult", "SimulationError", "Report", "serial", "simulate", "explore", "same", "seeded_rng",
    "graph_module",
]


@dataclasses.dataclass
class Report:
    """Several seeded interleavings compared with serial execution."""

    runs: int = 0
    mismatches: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    races: list[Race] = dataclasses.field(default_factory=list)
    deadlocks: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    reused: int = 0

    @property
    def ok(self) -> bool:
        """No mismatch, no race and no deadlock."""
        return not (self.mismatches or self.races or self.deadlocks)

    @property
    def observed(self) -> bool:
        """Whether some run computed a wrong result or deadlocked (a race alone is not observed)."""
        return bool(self.mismatches or self.deadlocks)

    def describe(self) -> str:
        lines = [f"{self.runs} interleavings, {self.reused} reused blocks"]
        lines += [f"seed {s}: result differs from serial execution: {d}" for s, d in self.mismatches[:5]]
        lines += [f"seed {s}: {d}" for s, d in self.deadlocks[:5]]
        lines += [f"race: {r}" for r in self.races[:10]]
        return "\n".join(lines)


def serial(gm_or_program: Any, inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Serial execution in program order: ``(outputs, inputs after the run)``. The oracle."""
    gm = graph_module(gm_or_program)
    args = [_clone(x) for x in inputs]
    with seeded_rng():
        env = _reference(gm, args)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return fx.node.map_arg(out_node.args[0], lambda n: _clone(env[n])), args


def same(a: Any, b: Any) -> str | None:
    """``None`` when ``a`` and ``b`` are equal bit for bit (NaN equal to NaN), else why not."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        except AssertionError as exc:
            return str(exc).splitlines()[0] if str(exc) else "tensors differ"
        return None
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return f"{len(a)} vs {len(b)} values"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same(x, y)
            if why is not None:
                return f"[{i}]: {why}"
        return None
    return None if a == b else f"{a!r} vs {b!r}"


def simulate(
    gm_or_program: Any,
    inputs: Sequence[Any],
    seed: int = 0,
    *,
    poison: bool = True,
    replay: bool = False,
    _plan: _Plan | None = None,
    _ref: dict[fx.Node, Any] | None = None,
) -> SimResult:
    """Runs the graph once in the interleaving chosen by ``seed``.

    Args:
        gm_or_program: the annotated ATen graph after the pipeline, or its emitted Program.
        inputs: real input values (copied; the caller's are not changed).
        seed: picks the interleaving.
        poison: poison reused and fresh blocks (off: only the race check finds bugs).
        replay: simulate a replay after capture: unretained static inputs and constants of
            captured segments are freed and reused first.

    Raises:
        SimulationError: the lanes deadlock (a wait on a record that can never run).
    """
    plan = _plan or _plan_of(gm_or_program)
    sim = _Sim(plan, inputs, seed, poison, replay)
    with seeded_rng():
        sim.ref = _ref if _ref is not None else _reference(plan.gm, [_clone(x) for x in inputs])
    with seeded_rng():
        return sim.run()


def explore(
    gm_or_program: Any, inputs: Sequence[Any], seeds: Iterable[int] = range(20), *, replay: bool = False
) -> Report:
    """Simulates every seed and compares each result with serial execution."""
    plan = _plan_of(gm_or_program)
    expected, expected_inputs = serial(plan.gm, inputs)
    with seeded_rng():
        ref = _reference(plan.gm, [_clone(x) for x in inputs])
    report = Report()
    races: set[Race] = set()
    for seed in seeds:
        report.runs += 1
        try:
            res = simulate(gm_or_program, inputs, seed, replay=replay, _plan=plan, _ref=ref)
        except SimulationError as exc:
            report.deadlocks.append((seed, str(exc)))
            continue
        report.reused += res.reused
        races.update(res.races)
        why = same(res.outputs, expected)
        if why is None:
            why = same(res.inputs, expected_inputs)
            if why is not None:
                why = f"inputs after the run: {why}"
        if why is not None:
            report.mismatches.append((seed, why))
    pairs: dict[tuple[str, str, str], Race] = {}
    for race in sorted(races):
        pairs.setdefault((race.first, race.second, race.storage), race)
    report.races = sorted(pairs.values())
    return report
