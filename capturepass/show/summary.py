"""What capturepass did, read back from a dump directory: the summary ``capturepass show`` prints.

Prints, for every compiled graph under ``DIR`` (each a directory holding
``graph.json``), its owner, lanes and counts; the owners its callable created at
run time, per model instance (from ``owners.json``, when the folder has one: see
``runtime.naming``); then its decisions: the schedule's time on one lane and on
its lanes (measured where the folder holds a measured run, estimated otherwise),
every lane with its kernels and why they are on it (hinted, placed by the
scheduler, kept from their hint), every capability other than the default with
its reason and source, and the decisions the passes recorded; the retained
objects with their owner and segment; the external streams; every wait with the
dependency that made it necessary; every break with its reason. ``--json``
prints the same as one JSON object whose keys are ``lanes``, ``records``,
``waits``, ``leases``, ``retained``, ``segments``, ``breaks`` (totals over the
graphs; ``lanes`` is the most any graph uses) and ``graphs`` (one object per
graph: the counts, ``runtime_owners`` (each with its ``name``, ``model``,
``role``, ``inputs`` and ``device``; ``runtime_owners_recorded`` says whether the
folder has an ``owners.json``, ``runtime_owners_not_shown`` why one was not
used), ``retained_objects``, ``wait_reasons``, ``timing`` and ``decisions``, each
decision with its ``kind`` and the ``text`` the plain output prints). A graph whose
schedule was measured at capture (its folder holds ``schedules.json``,
:mod:`capturepass.runtime.pick`) has one decision of kind ``pick`` per capture
shape: every candidate's estimate against its measured time, and the choice. The
command itself is :mod:`capturepass.show.cli`.
"""

from __future__ import annotations

import math
import os
from typing import Any

from capturepass.errors import DumpError
from capturepass.ir.graph_json import GraphDoc
from capturepass.runtime import naming
from capturepass.runtime.choices import PICKS_FILE, PickRecord, load_records
from capturepass.show.dumps import load_graph_dirs
from capturepass.show.schedule import duration_us, graph_timing, short_op, timing_line

SUMMARY_KEYS = ("lanes", "records", "waits", "leases", "retained", "segments", "breaks")


def _has_kernel(node: dict[str, Any]) -> bool:
    """A compute node that launches work (a view, a tuple selection or host math has no cost)."""
    return node["effect"] == "compute" and ("break" in node or duration_us(node) > 0)


def _names(nodes: list[dict[str, Any]], limit: int = 8) -> str:
    shown = ", ".join(f"%{n['name']}" for n in nodes[:limit])
    return shown + (f", … ({len(nodes) - limit} more)" if len(nodes) > limit else "")


def lane_decisions(graph: GraphDoc) -> list[dict[str, Any]]:
    """Per lane, its kernels and why each is there: hinted, placed by the scheduler, or kept.

    Read from the dump alone: a node's ``hint`` is the lane its hint named; a kernel off the
    main lane without a hint was put there by the ``auto`` policy's list scheduler (earliest
    estimated finish); a hinted kernel on another lane than its hint's was kept off it (the
    capability or ``max_aux_lanes`` decisions say why).
    """
    out = []
    kernels = [n for n in graph["nodes"] if _has_kernel(n) and "break" not in n]
    for li, lname in enumerate(graph["lanes"]):
        mine = [n for n in kernels if (n["lane"] or 0) == li]
        hinted = [n for n in mine if n.get("hint") == lname]
        kept = [n for n in mine if n.get("hint") not in (None, lname)]
        scheduled = [n for n in mine if n.get("hint") is None and li != 0]
        why = []
        if hinted:
            why.append(f"{len(hinted)} hinted to it (capturepass.lane or a stream region)")
        if scheduled:
            why.append(f"{len(scheduled)} placed by the scheduler (policy auto: earliest estimated finish)")
        if kept:
            why.append(f"{len(kept)} hinted elsewhere but kept here (see the capability decisions and decisions)")
        rest = len(mine) - len(hinted) - len(scheduled) - len(kept)
        if rest and why:
            why.append(f"{rest} unhinted")
        text = f"lane s{li} {lname}: {len(mine)} kernel(s)" + (f", {', '.join(why)}" if why else "")
        if mine:
            text += ": " + _names(mine)
        out.append({"kind": "lane", "lane": li, "name": lname, "kernels": [n["name"] for n in mine],
                    "hinted": [n["name"] for n in hinted], "scheduled": [n["name"] for n in scheduled],
                    "kept_from_hint": [n["name"] for n in kept], "text": text})
    return out


def _capability_text(cap: dict[str, Any]) -> str:
    overlap = cap.get("overlap", "safe")
    parts = [{"safe": "may overlap", "serialize": "serialized: no other lane runs beside it",
              "join": "joined: every lane joins before it"}.get(overlap, f"overlap={overlap}")]
    if not cap.get("capturable", True):
        parts.append("not capturable (a break when captured)")
    if cap.get("resident_grid"):
        parts.append(f"resident grid of {cap.get('ctas')} CTA(s), "
                     + ("barrier-free" if cap.get("barrier_free", True) else "with a grid barrier"))
    if cap.get("monolithic"):
        parts.append("needs one monolithic CUDA graph")
    if cap.get("collective"):
        parts.append("a collective: runs on the comm lane")
    if cap.get("resources"):
        parts.append("uses " + ", ".join(cap["resources"]))
    return "; ".join(parts) + f"; because: {cap.get('reason') or '?'} ({cap.get('source', '?')})"


def capability_decisions(graph: GraphDoc) -> list[dict[str, Any]]:
    """The capability decisions of the dump: every op declared or found other than the default
    (capturable, free to overlap), grouped by op and decision, with the reason and its source."""
    groups: dict[tuple[str, str], list[str]] = {}
    for n in graph["nodes"]:
        cap = n.get("capability")
        if n["effect"] != "compute" or not cap:
            continue
        if (cap.get("capturable", True) and cap.get("overlap", "safe") == "safe" and not cap.get("resident_grid")
                and cap.get("source", "default") == "default"):
            continue
        groups.setdefault((short_op(n["op"]), _capability_text(cap)), []).append(n["name"])
    return [{"kind": "capability", "op": op, "nodes": names, "decision": what,
             "text": f"capability {op}: {what}: " + ", ".join(f"%{x}" for x in names)}
            for (op, what), names in groups.items()]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def pick_decisions(folder: str | None) -> list[dict[str, Any]]:
    """The measured schedule choices of a graph's folder (``schedules.json``), one per shape:
    ``kind`` ``pick``, the record's fields (``shape``, ``device``, ``choice``, ``cached``,
    ``rounds``, ``replays``, ``candidates`` with ``estimate_us``, ``measured_us``, ``fastest_us`` and
    ``workspace_mib``, ``scale``, ``unsteady``)
    and its ``text``.

    Raises:
        DumpError: the file is malformed (naming the entry and field at fault).
    """
    path = os.path.join(folder, PICKS_FILE) if folder is not None else PICKS_FILE
    try:
        entries = load_records(folder)
    except (OSError, ValueError) as e:
        raise DumpError(path, "", f"cannot be read: {e}") from None
    out = []
    for k, e in enumerate(entries):
        for key, kind in (("graph", str), ("shape", str), ("device", str), ("choice", str), ("cached", bool),
                          ("rounds", int), ("replays", int), ("candidates", list)):
            if not isinstance(e.get(key), kind):
                raise DumpError(path, f"picks[{k}].{key}", f"expected {kind.__name__}, got {e.get(key)!r}")
        for j, c in enumerate(e["candidates"]):
            where = f"picks[{k}].candidates[{j}]"
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("lanes"), int):
                raise DumpError(path, where, "expected an object with a name and a lane count")
            for key in ("estimate_us", "measured_us", "fastest_us", "workspace_mib"):
                if c.get(key) is not None and not _number(c[key]):
                    raise DumpError(path, f"{where}.{key}", f"expected a finite number or null, got {c[key]!r}")
        if e["choice"] not in [c["name"] for c in e["candidates"]]:
            raise DumpError(path, f"picks[{k}].choice", f"{e['choice']!r} is not one of the candidates")
        scale = e.get("scale")
        unsteady = e.get("unsteady", [])
        if not isinstance(unsteady, list) or not all(isinstance(n, str) for n in unsteady):
            raise DumpError(path, f"picks[{k}].unsteady", f"expected a list of candidate names, got {unsteady!r}")
        record = PickRecord(e["graph"], e["shape"], e["device"], e["choice"], e["cached"],
                            e.get("budget_ms") if _number(e.get("budget_ms")) else 0.0, e["rounds"], e["replays"],
                            e["candidates"], scale if _number(scale) else None, unsteady,
                            uncaptured=e.get("uncaptured") is True)
        out.append(dict(record.to_json(), kind="pick", text=f"pick: {record.text()}"))
    return out


def retained_objects(graph: GraphDoc) -> list[dict[str, Any]]:
    """Every object a capture segment keeps alive: its name, kind and type, the owner and segment."""
    by_name = {n["name"]: n for n in graph["nodes"]}
    out = []
    for n in graph["nodes"]:
        if n["effect"] != "retain":
            continue
        for a in n["args"]:
            src = by_name.get(a, {})
            out.append({"object": a, "kind": "input" if src.get("effect") == "input" else "value",
                        "type": src.get("type"), "owner": n.get("owner"), "segment": n.get("segment"),
                        "by": n["name"]})
        for r in n.get("resources", []):
            out.append({"object": r, "kind": "resource", "type": None, "owner": n.get("owner"),
                        "segment": n.get("segment"), "by": n["name"]})
    return out


def _retained_lines(objects: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[Any, Any], list[str]] = {}
    for o in objects:
        what = f"resource {o['object']}" if o["kind"] == "resource" else f"%{o['object']} {o['type'] or ''}".rstrip()
        groups.setdefault((o["segment"], o["owner"]), []).append(what)
    return [f"retained by segment {seg} (owner {owner}): " + ", ".join(items) for (seg, owner), items in groups.items()]


_ROLE_TEXT = {"capture": "capture of {}", "eager": "uncaptured runs, the first of {}",
              "profile": "profiling capture of {}"}


def runtime_owners(graph: GraphDoc, folder: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The owners the graph's callable created at run time (``owners.json`` beside ``graph.json``),
    and why there are none to show when the file is there but not used."""
    if folder is None:
        return [], None
    doc, why_not = naming.load_owners(folder, graph["owner"])
    return (list(doc["owners"]) if doc is not None else []), why_not


def _owner_lines(owners: list[dict[str, Any]], why_not: str | None, recorded: bool) -> list[str]:
    if why_not is not None:
        return [f"owners at run time: not shown ({why_not})"]
    if not owners:
        return ["owners at run time: none yet (no model ran this graph)"] if recorded else []
    models: dict[str, list[str]] = {}
    for o in owners:
        what = _ROLE_TEXT.get(o["role"], o["role"] + " of {}").format(o["inputs"] or "no inputs")
        models.setdefault(o["model"], []).append(f"{o['name']} ({what})")
    lines = [f"owners at run time: {len(models)} model(s), {len(owners)} owner(s)"]
    lines += [f"  model {m}: " + ", ".join(items) for m, items in models.items()]
    return lines


def summarize_graph(graph: GraphDoc, name: str, folder: str | None = None) -> dict[str, Any]:
    """The summary of one ``graph.json`` document (``folder``: its dump folder, for a measured run)."""
    nodes = graph["nodes"]
    records = [n for n in nodes if n["effect"] == "record"]
    waits = [n for n in nodes if n["effect"] == "wait"]
    retains = [n for n in nodes if n["effect"] == "retain"]
    leases = sorted({n["lease"] for n in records + waits if "lease" in n})
    retained = sum(len(n["args"]) + len(n.get("resources", [])) for n in retains)
    timing, _, _ = graph_timing(folder, graph, name)
    decisions: list[dict[str, Any]] = [{"kind": "schedule", "text": timing_line(timing, len(graph["lanes"])),
                                        "timing": timing}]
    decisions += lane_decisions(graph)
    decisions += capability_decisions(graph)
    decisions += [{"kind": "pass", "text": f"decision: {d}"} for d in graph.get("decisions", [])]
    decisions += pick_decisions(folder)
    owners, owners_not_shown = runtime_owners(graph, folder)
    recorded = folder is not None and os.path.isfile(os.path.join(folder, naming.OWNERS_FILE))
    return {
        "name": name,
        "graph": graph["graph"],
        "owner": graph["owner"],
        "cudagraphs": graph["cudagraphs"],
        "lane_names": graph["lanes"],
        "lanes": len(graph["lanes"]),
        "records": len(records),
        "waits": len(waits),
        "leases": len(leases),
        "retained": retained,
        "runtime_owners": owners,
        "runtime_owners_recorded": recorded,
        "runtime_owners_not_shown": owners_not_shown,
        "retained_objects": retained_objects(graph),
        "segments": len(graph["segments"]),
        "segment_names": list(graph["segments"]),
        "breaks": [dict(b, graph=name) for b in graph["breaks"]],
        "releases": sum(1 for n in nodes if n["effect"] == "release"),
        "external": [
            dict(x, joins=sum(1 for n in nodes if n["effect"] == "external" and n.get("external") == x["name"]))
            for x in graph.get("external", [])
        ],
        "wait_reasons": [
            {"node": n["name"], "lane": n["lane"], "event": n.get("event"), "role": n.get("role"),
             "lease": n.get("lease"), "why": n.get("why")}
            for n in waits
        ],
        "timing": timing,
        "decisions": decisions,
    }


def summarize(root: str) -> dict[str, Any]:
    """The summary of every graph under ``root``, with totals."""
    graphs = [summarize_graph(g, name, folder) for name, folder, g in load_graph_dirs(root)]
    total: dict[str, Any] = {
        "lanes": max(g["lanes"] for g in graphs),
        "breaks": [b for g in graphs for b in g["breaks"]],
    }
    for key in ("records", "waits", "leases", "retained", "segments"):
        total[key] = sum(g[key] for g in graphs)
    total["graphs"] = graphs
    return total


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable form of :func:`summarize`."""
    lines = []
    for g in summary["graphs"]:
        lanes = " ".join(f"s{i}={n}" for i, n in enumerate(g["lane_names"]))
        lines.append(f"graph {g['name']} ({g['graph']}, owner {g['owner']}, cudagraphs={g['cudagraphs']})")
        lines.append(f"  lanes {g['lanes']}: {lanes}")
        lines.append(
            f"  records {g['records']}, waits {g['waits']}, leases {g['leases']}, releases {g['releases']}, "
            f"retained {g['retained']}, segments {g['segments']}, breaks {len(g['breaks'])}"
        )
        owner_lines = _owner_lines(g["runtime_owners"], g["runtime_owners_not_shown"], g["runtime_owners_recorded"])
        lines.extend(f"  {line}" for line in owner_lines)
        for d in g["decisions"]:
            lines.append(f"  {d['text']}")
        lines.extend(f"  {line}" for line in _retained_lines(g["retained_objects"]))
        for x in g["external"]:
            lines.append(f"  external stream {x['name']} ({x['relation']}): {x['joins']} join(s)")
        for w in g["wait_reasons"]:
            lines.append(
                f"  wait %{w['node']} on s{w['lane']} for {w['event']} ({w['role']}, lease {w['lease']}): {w['why']}"
            )
        for b in g["breaks"]:
            where = f" at %{b['node']}" if b["node"] else ""
            lines.append(f"  break ({b['source']}){where}: {b['reason']}")
    lines.append(
        "total: " + ", ".join(
            f"{k} {summary[k] if k != 'breaks' else len(summary[k])}" for k in SUMMARY_KEYS
        )
    )
    return "\n".join(lines)


def summarize_dir(root: str) -> str:
    """:func:`format_summary` of :func:`summarize` (used by the examples)."""
    return format_summary(summarize(root))
