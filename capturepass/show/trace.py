"""The schedule of a dump directory as a Chrome trace (Perfetto and ``chrome://tracing`` open it).

One process per graph (named with its owner as the dump names it, ``000_inference · g3``,
and labelled with the owners its callable created at run time, from ``owners.json``),
one thread per lane, a complete event per node and a flow event per record→wait edge.
A graph whose folder holds a ``measured.json`` of its ``graph.json``
(:func:`capturepass.trace`) is drawn from the measured run instead:
one row per lane (the kernels each lane's stream ran, or, for CUDA graph replays,
the kernels matched to their lane), each kernel at its measured start and
duration, and a ``measured span`` row with each run's span. ``otherData.times``
and ``otherData.graphs`` say which graphs are measured and which estimated (a
``measured.json`` of another compile of the graph is ignored, and the note says so).
"""

from __future__ import annotations

import json
import math
from typing import Any

from capturepass.measure.report import load_measurement, measurement_events, process_title
from capturepass.runtime import naming
from capturepass.show.dumps import load_graph_dirs
from capturepass.show.schedule import SYNC_US, short_op, simulate, times_note


def render_trace(root: str, measured: bool = True) -> dict[str, Any]:
    """The Chrome trace-event document of every graph under a dump directory.

    A graph whose folder holds a ``measured.json`` of its ``graph.json`` (see
    :func:`capturepass.trace`) is drawn with its measured kernel times (``measured=False``
    ignores them); every other graph with the cost model's estimates. ``otherData`` says
    which: ``times`` is ``"measured"``, ``"estimated (nominal device)"`` or ``"mixed"``, and
    ``graphs`` maps each graph to ``"measured (...)"`` or ``"estimated"`` (with the reason a
    measurement present was not used).
    """
    events: list[dict[str, Any]] = []
    flow = 0
    which: dict[str, str] = {}
    sessions: list[dict[str, Any]] = []
    for gi, (name, folder, graph) in enumerate(load_graph_dirs(root)):
        pid = gi + 1
        m, why_not = load_measurement(folder) if measured else (None, None)
        if m is not None:
            m = dict(m, graph=name)
            events.extend(measurement_events(m, pid))
            which[name] = f"measured ({m['mode']}, {m['runs']} run(s) on {m.get('device', '?')})"
            sessions.append(m)
            continue
        which[name] = "estimated" + (f" ({why_not})" if why_not else "")
        s = simulate(graph, name)
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"capturepass {process_title(name, graph['owner'])}"}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        owners, _ = naming.load_owners(folder, graph["owner"])
        if owners is not None and owners["owners"]:
            events.append({"ph": "M", "pid": pid, "name": "process_labels",
                           "args": {"labels": "owners at run time: " + ", ".join(o["name"] for o in owners["owners"])}})
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


def write_trace(root: str, path: str, measured: bool = True) -> dict[str, Any]:
    """Writes :func:`render_trace` of ``root`` to ``path`` (strict JSON); returns the document."""
    doc = render_trace(root, measured)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=None, sort_keys=True, allow_nan=False)
        f.write("\n")
    return doc
