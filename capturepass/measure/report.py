"""What a measurement becomes: the Chrome trace document, and ``measured.json`` in a dump.

Plain functions over the measurements :func:`~capturepass.measure.records.build_measurements`
makes (no GPU needed): see :mod:`capturepass.measure`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from capturepass.ir import graph_json
from capturepass.measure.records import FORMAT

MEASURED_FILE = "measured.json"


# -- Chrome trace -------------------------------------------------------------------------------

SPAN_TID = 1000
_UNMATCHED_TID = 2000
_OWNER_TIDS = 10000  # rows of the i-th of several runtime owners start at (i + 1) * this


def short_name(name: str, limit: int = 60) -> str:
    base = name.split("(")[0].strip() or name
    if base.startswith("void "):
        base = base[5:]
    return base if len(base) <= limit else base[: limit - 1] + "…"


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


def process_title(graph: str, owner: str | None) -> str:
    """A graph's name with its owner, as the dump names it: ``000_inference · g3``."""
    return graph if not owner or owner in graph.split() else f"{graph} · {owner}"


def measurement_events(m: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    """The Chrome trace events of one measurement: its process, a row per lane (per runtime owner
    and lane where several owners ran the graph), a span row."""
    lanes = list(m["lanes"])
    owners = sorted({k["owner"] for k in m["kernels"] if k.get("owner")})
    ran = f"; owners {', '.join(owners)}" if owners else ""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "name": "process_name",
         "args": {"name": f"capturepass {process_title(m['graph'], m.get('owner'))} (measured)"}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
        {"ph": "M", "pid": pid, "name": "process_labels",
         "args": {"labels": f"{m['mode']}, {m['runs']} run(s), lanes from {m['lanes_from']}{ran}"}},
    ]
    # Two owners (two models of one class) run on streams of their own: a row per owner and lane.
    rows: list[tuple[str | None, int]] = [(None, 0)]
    if len(owners) > 1:
        rows = [(o, (oi + 1) * _OWNER_TIDS) for oi, o in enumerate(owners)]
        if any(not k.get("owner") for k in m["kernels"]):
            rows.append((None, 0))
    base = dict(rows)
    for owner, first in rows:
        for li, lname in enumerate(lanes):
            title = f"s{li} {lname}" + (f" · {owner}" if owner else " · owner not known" if len(rows) > 1 else "")
            events.append({"ph": "M", "pid": pid, "tid": first + li, "name": "thread_name", "args": {"name": title}})
            events.append({"ph": "M", "pid": pid, "tid": first + li, "name": "thread_sort_index",
                           "args": {"sort_index": first + li}})
    extra: dict[tuple[int, bool], int] = {}
    for k in m["kernels"]:
        lane = k["lane"]
        if lane is None or lane >= len(lanes):
            key = (k["stream"], bool(k.get("graph_kernel")))
            if key not in extra:
                tid = _UNMATCHED_TID + len(extra)
                extra[key] = tid
                what = "CUDA graph kernels, lane not matched" if key[1] else "not a lane of this graph"
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                               "args": {"name": f"stream {key[0]} ({what})"}})
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                               "args": {"sort_index": tid}})
            tid = extra[key]
        else:
            tid = base.get(k.get("owner"), 0) + lane
        nodes = k.get("nodes") or []
        label = short_name(k["name"])
        if len(nodes) == 1:
            label = f"%{nodes[0]} · {label}"
        elif nodes:
            label = f"region {k['region']} ({len(nodes)} nodes) · {label}"
        args = {"kernel": k["name"], "stream": k["stream"], "run": k["run"], "kind": k.get("kind", "kernel"),
                "graph_kernel": bool(k.get("graph_kernel"))}
        for key in ("owner", "region", "nodes", "op"):
            if k.get(key) not in (None, []):
                args[key] = k[key]
        events.append({"ph": "X", "pid": pid, "tid": tid, "ts": k["start"], "dur": k["dur"], "name": label,
                       "cat": "kernel", "args": args})
    events.append({"ph": "M", "pid": pid, "tid": SPAN_TID, "name": "thread_name", "args": {"name": "measured span"}})
    events.append({"ph": "M", "pid": pid, "tid": SPAN_TID, "name": "thread_sort_index", "args": {"sort_index": SPAN_TID}})
    for sp in m.get("spans", []):
        ks = [k for k in m["kernels"] if k["run"] == sp["run"]]
        per_lane = {f"s{i}": sum(1 for k in ks if k["lane"] == i) for i in range(len(lanes))}
        events.append({"ph": "X", "pid": pid, "tid": SPAN_TID, "ts": sp["start"],
                       "dur": round(sp["end"] - sp["start"], 3), "name": f"run {sp['run']}", "cat": "span",
                       "args": {"kernels": len(ks), "kernels_per_lane": per_lane}})
    return events


def trace_document(measurements: Sequence[dict[str, Any]], session: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace of a session's measurements (one process per graph, then the work outside them)."""
    session = session or {}
    events: list[dict[str, Any]] = []
    for gi, m in enumerate(measurements):
        events.extend(measurement_events(m, gi + 1))
    outside = session.get("outside") or []
    if outside:
        pid = len(measurements) + 1
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": "outside capturepass graphs (measured)"}})
        streams = sorted({k["stream"] for k in outside})
        for s in streams:
            events.append({"ph": "M", "pid": pid, "tid": s, "name": "thread_name", "args": {"name": f"stream {s}"}})
        for k in outside:
            events.append({"ph": "X", "pid": pid, "tid": k["stream"], "ts": k["start"], "dur": k["dur"],
                           "name": short_name(k["name"]), "cat": "kernel",
                           "args": {"kernel": k["name"], "run": k["run"], **({"op": k["op"]} if k.get("op") else {})}})
    other = {"source": "capturepass", "times": "measured",
             "graphs": {m["graph"]: f"measured ({m['mode']}, {m['runs']} run(s))" for m in measurements}}
    for key in ("device", "torch", "cuda", "runs", "notes", "unattributed"):
        if key in session:
            other[key] = session[key]
    return {"traceEvents": [{k: _finite(v) for k, v in e.items()} for e in events],
            "displayTimeUnit": "ns", "otherData": other}


# -- measured.json in a dump --------------------------------------------------------------------


def graph_digest(graph_json_path: str) -> str | None:
    """The sha256 of a ``graph.json`` file (a measurement is only shown with the graph it measured)."""
    try:
        with open(graph_json_path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def load_measurement(graph_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """The measurement saved in a graph's dump folder, if it is there and measured this ``graph.json``.

    Returns:
        ``(measurement, None)``, or ``(None, reason)`` where ``reason`` is ``None`` when there is
        no ``measured.json`` and says why it is not used otherwise.
    """
    m, reason = graph_json.load_side_file(os.path.join(graph_dir, MEASURED_FILE), FORMAT)
    if m is None:
        return None, reason
    problem = _malformed(m)
    if problem is not None:
        return None, f"{MEASURED_FILE} is malformed: {problem}"
    digest = graph_digest(os.path.join(graph_dir, "graph.json"))
    if m.get("graph_sha256") and digest and m["graph_sha256"] != digest:
        return None, f"{MEASURED_FILE} measured another compile (graph.json changed since)"
    return m, None


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and (isinstance(x, int) or isinstance(x, float) and math.isfinite(x))


def _malformed(m: dict[str, Any]) -> str | None:
    """The first field of a measurement document :func:`measurement_events` could not read, if any.

    A ``measured.json`` is read back from a dump folder, where anything may have been written:
    a field of the wrong type would otherwise end ``capturepass show --trace`` in a traceback.
    """
    lanes = m.get("lanes")
    if not isinstance(lanes, list) or not all(isinstance(x, str) for x in lanes):
        return "lanes: must be a list of strings"
    if m.get("owner") is not None and not isinstance(m["owner"], str):
        return "owner: must be a string or null"
    for key in ("mode", "lanes_from"):
        if not isinstance(m.get(key), str):
            return f"{key}: must be a string"
    if not _is_number(m.get("runs")):
        return "runs: must be a number"
    kernels = m.get("kernels")
    if not isinstance(kernels, list):
        return "kernels: must be a list"
    for i, k in enumerate(kernels):
        if not isinstance(k, dict):
            return f"kernels[{i}]: must be an object"
        lane = k.get("lane")
        if lane is not None and (isinstance(lane, bool) or not isinstance(lane, int)):
            return f"kernels[{i}].lane: must be an integer or null"
        if not isinstance(k.get("name"), str):
            return f"kernels[{i}].name: must be a string"
        if k.get("owner") is not None and not isinstance(k["owner"], str):
            return f"kernels[{i}].owner: must be a string or null"
        for key in ("stream", "run", "start", "dur"):
            if not _is_number(k.get(key)):
                return f"kernels[{i}].{key}: must be a finite number"
        if not isinstance(k.get("nodes") or [], list):
            return f"kernels[{i}].nodes: must be a list"
    spans = m.get("spans", [])
    if not isinstance(spans, list):
        return "spans: must be a list"
    for i, sp in enumerate(spans):
        if not isinstance(sp, dict) or not all(_is_number(sp.get(key)) for key in ("run", "start", "end")):
            return f"spans[{i}]: must be an object of finite numbers run, start and end"
    return None


def save_measurement(m: dict[str, Any], graph_dir: str) -> str:
    """Writes ``m`` as ``measured.json`` into a graph's dump folder; returns the path."""
    path = os.path.join(graph_dir, MEASURED_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(m, f, indent=None, sort_keys=True, allow_nan=False)
        f.write("\n")
    return path
