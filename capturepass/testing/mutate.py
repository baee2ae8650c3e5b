"""Mutation testing of the synchronisation: remove one inserted guarantee at a time.

A *mutant* is a copy of a compiled (annotated, verified) graph with exactly one of the things
the pipeline inserted taken away:

- ``wait``: a ``capturepass.wait`` is removed;
- ``record``: a ``capturepass.record`` is removed (its waits then bind to an older record of the
  same event object, or to none);
- ``release``: a deferred ``capturepass.release`` is removed (the host frees at the default
  point again);
- ``retain``: one value (or one resource) is dropped from a segment's ``capturepass.retain``;
- ``lease``: an event is moved into the lease of another event of its role that is live at the
  same time, so that one event object serves both (its scope is lost). A move that only makes
  waits stronger is no removal and is not made: when both events are recorded on one lane and
  every wait of either comes after both records, each wait binds to the later record, which
  runs after the earlier one;
- ``external``: a ``capturepass.join_external`` of a declared external stream is removed.

:func:`score` runs the verifier and the interleaving simulator on every mutant. Every mutant
must be rejected by the verifier; the simulator reports what it can observe (a result that
differs from serial execution, a deadlock) and the unordered pairs its happens-before check
finds.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch.fx as fx

from capturepass.errors import VerificationError
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.ir.verify import verify
from capturepass.testing.simulate import explore

KINDS = ("wait", "record", "release", "retain", "lease")


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One removal: ``kind`` at node ``node`` (``detail`` names the value, resource or lease)."""

    kind: str
    node: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} %{self.node}" + (f" ({self.detail})" if self.detail else "")


def _spans(gm: fx.GraphModule) -> dict[Any, tuple[int, int, Any, str]]:
    """event -> (first, last program index, lease, role) of its record and waits."""
    spans: dict[Any, tuple[int, int, Any, str]] = {}
    for i, node in enumerate(gm.graph.nodes):
        rec = meta.info(node)
        if rec.effect not in (Effect.RECORD, Effect.WAIT):
            continue
        lo, hi, lease, role = spans.get(rec.event, (i, i, rec.lease, rec.role))
        spans[rec.event] = (min(lo, i), max(hi, i), lease, role)
    return spans


def _records_and_waits(gm: fx.GraphModule) -> dict[Any, tuple[list[tuple[int, int]], list[int]]]:
    """event -> ((program index, lane) of its records, program indices of its waits)."""
    out: dict[Any, tuple[list[tuple[int, int]], list[int]]] = {}
    for i, node in enumerate(gm.graph.nodes):
        rec = meta.info(node)
        if rec.effect is Effect.RECORD:
            out.setdefault(rec.event, ([], []))[0].append((i, meta.lane_of(node).index))
        elif rec.effect is Effect.WAIT:
            out.setdefault(rec.event, ([], []))[1].append(i)
    return out


def _only_strengthens(points: dict, event: Any, other: Any) -> bool:
    """Whether sharing one event object between ``event`` and ``other`` only makes waits stronger."""
    records = points[event][0] + points[other][0]
    waits = points[event][1] + points[other][1]
    return len({lane for _, lane in records}) == 1 and min(waits, default=-1) > max(i for i, _ in records)


def _lease_target(gm: fx.GraphModule, event: Any, spans: dict, points: dict) -> Any:
    """The lease of another live event of the same role that ``event`` can be moved into, if any."""
    lo, hi, lease, role = spans[event]
    for other, (olo, ohi, olease, orole) in spans.items():
        if other == event or orole != role or olease == lease or olease is None:
            continue
        if olo <= hi and lo <= ohi and not _only_strengthens(points, event, other):  # live at once
            return olease
    return None


def mutants(gm: fx.GraphModule) -> list[Mutant]:
    """Every single removal that applies to ``gm``, in program order."""
    out: list[Mutant] = []
    spans = _spans(gm)
    points = _records_and_waits(gm)
    for node in gm.graph.nodes:
        rec = meta.info(node)
        if rec.effect is Effect.WAIT:
            out.append(Mutant("wait", node.name))
        elif rec.effect is Effect.RECORD:
            out.append(Mutant("record", node.name))
            target = _lease_target(gm, rec.event, spans, points)
            if target is not None:
                out.append(Mutant("lease", node.name, f"into {target}"))
        elif rec.effect is Effect.RELEASE:
            out.append(Mutant("release", node.name))
        elif rec.effect is Effect.EXTERNAL:
            out.append(Mutant("external", node.name))
        elif rec.effect is Effect.RETAIN:
            for value in node.all_input_nodes:
                out.append(Mutant("retain", node.name, f"%{value.name}"))
            for binding in rec.resources:
                out.append(Mutant("retain", node.name, f"resource {binding}"))
    return out


def apply(gm: fx.GraphModule, mutant: Mutant) -> fx.GraphModule:
    """A copy of ``gm`` with ``mutant`` applied (``gm`` is not changed)."""
    out = copy.deepcopy(gm)
    node = next(n for n in out.graph.nodes if n.name == mutant.node)
    rec = meta.info(node)
    if mutant.kind in ("wait", "record", "release", "external"):
        out.graph.erase_node(node)
    elif mutant.kind == "retain":
        if mutant.detail.startswith("resource "):
            kept = tuple(b for b in rec.resources if f"resource {b}" != mutant.detail)
            meta.update(node, "mutate", resources=kept)
        else:
            values, lane = node.args
            node.args = ([v for v in values if f"%{v.name}" != mutant.detail], lane)
    elif mutant.kind == "lease":
        target = _lease_target(out, rec.event, _spans(out), _records_and_waits(out))
        assert target is not None, mutant
        for n in out.graph.nodes:
            r = meta.info(n)
            if r.effect in (Effect.RECORD, Effect.WAIT) and r.event == rec.event:
                meta.update(n, "mutate", lease=target)
    else:
        raise ValueError(f"unknown mutation kind {mutant.kind!r}; kinds are {KINDS}")
    out.recompile()
    return out


@dataclasses.dataclass
class Outcome:
    """What the verifier and the simulator said about one mutant."""

    mutant: Mutant
    verifier: str | None  # the rule that rejected it, or None
    observed: bool  # the simulator computed a wrong result or deadlocked
    races: int  # unordered pairs the happens-before check found


@dataclasses.dataclass
class Score:
    """Outcomes over a corpus, with per-kind totals."""

    outcomes: list[Outcome] = dataclasses.field(default_factory=list)

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            row = table.setdefault(o.mutant.kind, {"mutants": 0, "verifier": 0, "simulator": 0, "race": 0, "either": 0})
            row["mutants"] += 1
            row["verifier"] += o.verifier is not None
            row["simulator"] += o.observed
            row["race"] += o.races > 0
            row["either"] += o.observed or o.races > 0
        return table

    @property
    def escaped(self) -> list[Outcome]:
        """Mutants the verifier accepted (each one is a verifier bug)."""
        return [o for o in self.outcomes if o.verifier is None]

    def table(self) -> str:
        """A markdown table of the per-kind figures."""
        lines = [
            "| removed | mutants | verifier rejects | simulator: wrong result | simulator: race reported | simulator: either |",
            "|---|---|---|---|---|---|",
        ]
        total = {"mutants": 0, "verifier": 0, "simulator": 0, "race": 0, "either": 0}
        rows = self.by_kind()
        for kind in KINDS:
            row = rows.get(kind)
            if row is None:
                continue
            for k in total:
                total[k] += row[k]
            lines.append(_row(kind, row))
        lines.append(_row("**all**", total))
        return "\n".join(lines)


def _pct(a: int, b: int) -> str:
    return f"{a} ({100.0 * a / b:.1f}%)" if b else "0"


def _row(name: str, row: dict[str, int]) -> str:
    n = row["mutants"]
    return (
        f"| {name} | {n} | {_pct(row['verifier'], n)} | {_pct(row['simulator'], n)} | "
        f"{_pct(row['race'], n)} | {_pct(row['either'], n)} |"
    )


def judge(gm: fx.GraphModule, inputs: Sequence[Any], seeds: Iterable[int] = range(20)) -> Iterator[Outcome]:
    """Applies every mutant of ``gm`` and asks the verifier and the simulator about it."""
    seeds = list(seeds)
    for mutant in mutants(gm):
        bad = apply(gm, mutant)
        try:
            verify(bad)
            rule = None
        except VerificationError as exc:
            rule = exc.rule
        report = explore(bad, inputs, seeds, replay=True)
        yield Outcome(mutant, rule, report.observed, len(report.races))


def score(corpus: Iterable[tuple[fx.GraphModule, Sequence[Any]]], seeds: Iterable[int] = range(20)) -> Score:
    """Judges every mutant of every graph of ``corpus`` (pairs of a compiled graph and inputs)."""
    result = Score()
    seeds = list(seeds)
    for gm, inputs in corpus:
        result.outcomes.extend(judge(gm, inputs, seeds))
    return result
