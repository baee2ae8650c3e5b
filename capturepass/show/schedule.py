"""The schedule of a dumped graph, replayed and timed.

:func:`simulate` replays a ``graph.json``'s schedule on the nominal device of
:mod:`capturepass.ir.cost`: each lane has a clock; a compute node starts at its
lane's clock and takes its roofline time (:func:`~capturepass.ir.cost.node_time`);
a record stamps its event with the lane's clock; a wait moves its lane's clock
up to that stamp. Nodes stay in program order on their lane, so the picture is
the schedule capturepass emitted, timed by the same estimates the scheduler
used (only ratios mean anything).

:func:`graph_timing` says what one lane would take, what the lanes take and the
overlap gained: measured where the graph's folder holds a measured run of the
same ``graph.json`` (``measured.json``, written by :func:`capturepass.trace` on a
GPU: the sum of the kernels' measured durations against the time some lane was
busy), estimated from the replay otherwise. The HTML page
(:mod:`capturepass.show.page`) and the Chrome trace (:mod:`capturepass.show.trace`)
draw these schedules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from capturepass.ir.cost import LAUNCH_FLOOR_S, node_time
from capturepass.ir.meta import Cost
from capturepass.measure.records import interval_length, interval_union
from capturepass.measure.report import load_measurement

# Records and waits take no device time; a hair of simulated time keeps them in
# order on their lane and gives each trace flow a slice to bind to.
SYNC_US = 0.01

LANE_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")


@dataclasses.dataclass
class Item:
    """One node placed on the timeline.

    Attributes:
        node: the graph.json entry.
        lane: the lane it runs on.
        start: start time in microseconds.
        dur: duration in microseconds (0 for views, records and waits).
    """

    node: dict[str, Any]
    lane: int
    start: float
    dur: float

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclasses.dataclass
class Edge:
    """A record→wait edge: ``wait`` cannot pass before ``record``."""

    record: Item
    wait: Item
    event: str
    why: str | None


@dataclasses.dataclass
class Schedule:
    """The simulated schedule of one graph."""

    name: str
    graph: dict[str, Any]
    items: list[Item]
    edges: list[Edge]
    makespan: float

    @property
    def lanes(self) -> list[str]:
        return list(self.graph["lanes"])


def duration_us(node: dict[str, Any]) -> float:
    cost = node.get("cost")
    if not cost:
        return 0.0
    # graph_json.load bounds every cost (NaN aside, which node_time reads as unknown), so
    # that no sum of durations overflows the clocks.
    flops = cost.get("flops") or 0.0
    nbytes = cost.get("bytes") or 0.0
    return node_time(Cost(flops=float(flops), bytes=float(nbytes))) * 1e6


def short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``, ``mylib.gemm.default`` -> ``gemm``."""
    parts = op.split("(")[0].split(".")
    if len(parts) >= 3:
        return parts[-2]
    if len(parts) == 2:
        return parts[1] if parts[0] in ("aten", "capturepass", "method", "module") else parts[0]
    return parts[-1]


def simulate(graph: dict[str, Any], name: str) -> Schedule:
    """Replays one ``graph.json`` document's schedule on per-lane clocks.

    ``graph`` is a document :func:`capturepass.ir.graph_json.load` (or ``validate``) accepted.
    """
    # One clock per lane a node names (a mapping: a lane index never sizes anything).
    clocks: dict[int, float] = {i: 0.0 for i in range(max(1, len(graph["lanes"])))}
    stamps: dict[str, Item] = {}
    items: list[Item] = []
    edges: list[Edge] = []
    for node in graph["nodes"]:
        effect = node["effect"]
        if effect in ("input", "constant", "output"):
            continue
        lane = node.get("lane") or 0
        clocks.setdefault(lane, 0.0)
        if effect == "wait":
            rec = stamps.get(node.get("event", ""))
            if rec is not None:
                clocks[lane] = max(clocks[lane], rec.end)
        if effect == "compute" and "break" in node:
            # A break runs eagerly between segment replays: after everything enqueued before it.
            clocks[lane] = max(clocks.values())
        dur = duration_us(node) if effect == "compute" else SYNC_US if effect in ("record", "wait") else 0.0
        item = Item(node, lane, clocks[lane], dur)
        clocks[lane] += dur
        items.append(item)
        if effect == "record" and "event" in node:
            stamps[node["event"]] = item
        elif effect == "wait" and node.get("event") in stamps:
            edges.append(Edge(stamps[node["event"]], item, node["event"], node.get("why")))
    return Schedule(name, graph, items, edges, max(clocks.values()))


# -- timing: what one lane would take, what the lanes took ---------------------------------------


def _r(x: float) -> float:
    return round(x, 3)


def estimated_timing(s: Schedule) -> dict[str, Any]:
    """One-lane time and scheduled time of a simulated schedule (cost-model estimates).

    ``one_lane_us`` is the sum of the kernels' estimated times (what one lane would take);
    ``scheduled_us`` the simulated makespan on the graph's lanes; ``gained_us`` the
    difference. ``at_floor`` counts the kernels whose estimate is the nominal device's launch
    floor (their drawn widths are equal for that reason, not because their work is).
    """
    kernels = [it for it in s.items if it.node["effect"] == "compute" and it.dur > 0]
    one_lane = sum(it.dur for it in kernels)
    floor = LAUNCH_FLOOR_S * 1e6
    return _with_gain({
        "source": "estimated",
        "kernels": len(kernels),
        "at_floor": sum(1 for it in kernels if abs(it.dur - floor) < 1e-9),
        "one_lane_us": _r(one_lane),
        "scheduled_us": _r(s.makespan),
        "lanes_busy_us": {f"s{i}": _r(sum(it.dur for it in kernels if it.lane == i)) for i in range(len(s.lanes))},
    })


def _with_gain(t: dict[str, Any]) -> dict[str, Any]:
    t["gained_us"] = _r(t["one_lane_us"] - t["scheduled_us"])
    t["gained_pct"] = round(100.0 * t["gained_us"] / t["one_lane_us"], 1) if t["one_lane_us"] > 0 else 0.0
    return t


def median_run(m: dict[str, Any]) -> int | None:
    """The run of a measurement whose span is the median one (the run the page draws)."""
    spans = sorted(m.get("spans") or [], key=lambda sp: (sp["end"] - sp["start"], sp["run"]))
    if spans:
        return spans[(len(spans) - 1) // 2]["run"]
    runs = sorted({k["run"] for k in m.get("kernels", [])})
    return runs[(len(runs) - 1) // 2] if runs else None


def measured_timing(m: dict[str, Any]) -> dict[str, Any]:
    """One-lane time and scheduled time of a measured run (``measured.json``), averaged over its runs.

    ``one_lane_us`` is the sum of the kernels' measured durations per run (the same kernels back
    to back on one lane); ``scheduled_us`` the time some lane was busy (the union of every
    kernel's interval), so that ``gained_us`` is the kernel time the lanes overlapped;
    ``span_us`` is the run's span, first kernel to last, gaps between kernels included.
    """
    by_run: dict[int, list[dict[str, Any]]] = {}
    for k in m.get("kernels", []):
        by_run.setdefault(k["run"], []).append(k)
    runs = max(1, len(by_run))
    serial = sum(k["dur"] for ks in by_run.values() for k in ks) / runs
    busy = sum(interval_length(interval_union((k["start"], k["start"] + k["dur"]) for k in ks)) for ks in by_run.values()) / runs
    spans = [sp["end"] - sp["start"] for sp in m.get("spans") or []]
    lanes = list(m.get("lanes") or [])
    per_lane = {f"s{i}": _r(sum(k["dur"] for ks in by_run.values() for k in ks if k["lane"] == i) / runs)
                for i in range(len(lanes))}
    return _with_gain({
        "source": "measured",
        "mode": m.get("mode"),
        "runs": len(by_run),
        "device": m.get("device"),
        "kernels": round(sum(len(ks) for ks in by_run.values()) / runs, 1),
        "one_lane_us": _r(serial),
        "scheduled_us": _r(busy),
        "span_us": _r(sum(spans) / len(spans)) if spans else _r(busy),
        "lanes_busy_us": per_lane,
        "drawn_run": median_run(m),
    })


def graph_timing(folder: str | None, graph: dict[str, Any], name: str,
                 measured: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None, Schedule]:
    """``(timing, measurement or None, simulated schedule)`` of one dumped graph.

    The measurement is the folder's ``measured.json`` when it measured this ``graph.json``
    (:func:`capturepass.measure.load_measurement`); the timing is then measured, else
    estimated, and ``timing["why_not_measured"]`` gives the reason a ``measured.json`` present
    was not used.
    """
    s = simulate(graph, name)
    m, why_not = (None, None)
    if measured and folder is not None:
        m, why_not = load_measurement(folder)
    if m is not None:
        return measured_timing(m), m, s
    t = estimated_timing(s)
    if why_not:
        t["why_not_measured"] = why_not
    return t, None, s


def timing_line(t: dict[str, Any], lanes: int) -> str:
    """One line saying what one lane would take, what the lanes take, and the overlap gained."""
    gained = f"overlap gains {t['gained_us']:.2f} us ({t['gained_pct']:.0f}%)"
    if t["source"] == "measured":
        return (f"schedule (measured: {t['mode']}, {t['runs']} run(s) on {t.get('device') or '?'}): one lane "
                f"{t['one_lane_us']:.2f} us of kernels, on {lanes} lane(s) busy {t['scheduled_us']:.2f} us "
                f"(span {t['span_us']:.2f} us with the gaps); {gained}")
    why = f"; {t['why_not_measured']}" if t.get("why_not_measured") else ""
    return (f"schedule (estimated, nominal device{why}): one lane {t['one_lane_us']:.2f} us, on {lanes} lane(s) "
            f"{t['scheduled_us']:.2f} us; {gained}")


def times_note(which: dict[str, str]) -> str:
    """One line saying which graphs are drawn with measured times and which with estimates."""
    measured = [f"{g} {w[len('measured '):]}" for g, w in which.items() if w.startswith("measured")]
    estimated = [g + w[len("estimated"):] for g, w in which.items() if not w.startswith("measured")]
    parts = []
    if measured:
        parts.append("measured times for " + ", ".join(measured))
    if estimated:
        parts.append("cost-model estimates (nominal device) for " + ", ".join(estimated))
    line = "; ".join(parts)
    if not measured:
        line += " (no measured run in the dump: record one on a GPU with capturepass.trace(compiled, *args))"
    return line
