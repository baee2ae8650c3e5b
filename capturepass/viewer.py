"""The schedule of a dump as a picture: a self-contained HTML timeline and a Chrome trace.

``capturepass show DIR --html out.html`` and ``--trace out.json`` read every
``graph.json`` under ``DIR`` and replay its schedule on the nominal device of
:mod:`capturepass.ir.cost`: each lane has a clock; a compute node starts at its
lane's clock and takes its roofline time (:func:`~capturepass.ir.cost.node_time`);
a record stamps its event with the lane's clock; a wait moves its lane's clock
up to that stamp. Nodes stay in program order on their lane, so the picture is
the schedule capturepass emitted, timed by the same estimates the scheduler
used (only ratios mean anything).

The HTML page (:mod:`capturepass.viewer_html`) needs no network: its CSS, data and
script are inline. It draws a row per lane, each kernel as a box as wide as its
time (measured where the dump holds a measured run, estimated otherwise, and the
page says which), records and waits as markers joined by arrows, segments and
breaks as shaded bands; beside it the one-lane time and the overlap gained
(:func:`graph_timing`), in numbers and as bars; and it lists the waits with the
dependency that made each necessary (also shown on hover), the lanes and why each
kernel is on its lane, the capability decisions, the retained objects with their
owner and segment, the breaks and the decisions of the passes.

The trace is the Chrome trace-event format (Perfetto and ``chrome://tracing``
open it): one process per graph, one thread per lane, a complete event per
node and a flow event per record→wait edge.

Measured times: on a GPU, :func:`capturepass.trace` (``capturepass.measure``)
records real runs of the compiled graphs with ``torch.profiler`` and writes a
``measured.json`` next to each dumped graph's ``graph.json``. For such a graph
``--trace`` writes the measured run instead of the estimates: one row per lane
(the kernels each lane's stream ran, or, for CUDA graph replays, the kernels
matched to their lane), each kernel at its measured start and duration, and a
``measured span`` row with each run's span. ``otherData.times`` and
``otherData.graphs`` in the trace, and the last line ``capturepass show``
prints, say which graphs are measured and which estimated (a ``measured.json``
of another compile of the graph is ignored, and the line says so). The HTML
page draws the measured run the same way (the run of median span), and says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from capturepass.ir.cost import LAUNCH_FLOOR_S, node_time
from capturepass.ir.meta import Cost

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


def _duration_us(node: dict[str, Any]) -> float:
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
        dur = _duration_us(node) if effect == "compute" else SYNC_US if effect in ("record", "wait") else 0.0
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
    from capturepass.measure.records import _length, _union

    by_run: dict[int, list[dict[str, Any]]] = {}
    for k in m.get("kernels", []):
        by_run.setdefault(k["run"], []).append(k)
    runs = max(1, len(by_run))
    serial = sum(k["dur"] for ks in by_run.values() for k in ks) / runs
    busy = sum(_length(_union((k["start"], k["start"] + k["dur"]) for k in ks)) for ks in by_run.values()) / runs
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
        from capturepass import measure

        m, why_not = measure.load_measurement(folder)
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


# -- HTML (capturepass.viewer_html) ---------------------------------------------------------------


def render_html(root: str) -> str:
    """The self-contained HTML page of every graph under a dump directory (:mod:`capturepass.viewer_html`)."""
    from capturepass import viewer_html

    return viewer_html.render(root)[0]


# -- Chrome trace -------------------------------------------------------------------------------


def render_trace(root: str, measured: bool = True) -> dict[str, Any]:
    """The Chrome trace-event document of every graph under a dump directory.

    A graph whose folder holds a ``measured.json`` of its ``graph.json`` (see
    :func:`capturepass.trace`) is drawn with its measured kernel times (``measured=False``
    ignores them); every other graph with the cost model's estimates. ``otherData`` says
    which: ``times`` is ``"measured"``, ``"estimated (nominal device)"`` or ``"mixed"``, and
    ``graphs`` maps each graph to ``"measured (...)"`` or ``"estimated"`` (with the reason a
    measurement present was not used).
    """
    from capturepass import measure
    from capturepass.cli import load_graph_dirs

    events: list[dict[str, Any]] = []
    flow = 0
    which: dict[str, str] = {}
    sessions: list[dict[str, Any]] = []
    for gi, (name, folder, graph) in enumerate(load_graph_dirs(root)):
        pid = gi + 1
        m, why_not = measure.load_measurement(folder) if measured else (None, None)
        if m is not None:
            m = dict(m, graph=name)
            events.extend(measure.measurement_events(m, pid))
            which[name] = f"measured ({m['mode']}, {m['runs']} run(s) on {m.get('device', '?')})"
            sessions.append(m)
            continue
        which[name] = "estimated" + (f" ({why_not})" if why_not else "")
        s = simulate(graph, name)
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"capturepass {name}"}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        for li, lname in enumerate(s.lanes):
            events.append({"ph": "M", "pid": pid, "tid": li, "name": "thread_name", "args": {"name": f"s{li} {lname}"}})
            events.append({"ph": "M", "pid": pid, "tid": li, "name": "thread_sort_index", "args": {"sort_index": li}})
        for it in s.items:
            n = it.node
            if n["effect"] not in ("compute", "record", "wait"):
                continue
            args = {k: n[k] for k in ("op", "type", "segment", "event", "role", "lease", "why", "break") if k in n}
            if "cost" in n:
                # NaN (a size without a hint) is not JSON: trace viewers reject the file.
                args["cost"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in n["cost"].items()}
            cat = "break" if "break" in n else n["effect"]
            events.append({"ph": "X", "pid": pid, "tid": it.lane, "ts": round(it.start, 4),
                           "dur": round(max(it.dur, SYNC_US), 4), "name": f"{short_op(n['op'])} %{n['name']}",
                           "cat": cat, "args": args})
        for e in s.edges:
            flow += 1
            common = {"pid": pid, "name": e.event, "cat": "event", "id": flow}
            events.append({**common, "ph": "s", "tid": e.record.lane, "ts": round(e.record.start, 4)})
            events.append({**common, "ph": "f", "bp": "e", "tid": e.wait.lane, "ts": round(e.wait.start, 4)})
    n_measured = len(sessions)
    times = ("measured" if n_measured == len(which) else
             "estimated (nominal device)" if n_measured == 0 else "mixed")
    other: dict[str, Any] = {"source": "capturepass", "times": times, "graphs": which}
    if sessions:
        for key in ("device", "torch", "cuda"):
            if key in sessions[0]:
                other[key] = sessions[0][key]
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}


def trace_note(doc: dict[str, Any]) -> str:
    """One line saying which graphs of a :func:`render_trace` document are measured, which estimated."""
    return times_note(doc.get("otherData", {}).get("graphs", {}))


def write_html(root: str, path: str) -> dict[str, str]:
    """Writes :func:`render_html` of ``root`` to ``path``; returns, per graph, whether its times
    are measured or estimated (as ``render_trace``'s ``otherData.graphs``: see :func:`times_note`)."""
    from capturepass import viewer_html

    page, which = viewer_html.render(root)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return which


def write_trace(root: str, path: str, measured: bool = True) -> dict[str, Any]:
    """Writes :func:`render_trace` of ``root`` to ``path`` (strict JSON); returns the document."""
    doc = render_trace(root, measured)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=None, sort_keys=True, allow_nan=False)
        f.write("\n")
    return doc
