"""``capturepass show DIR``: what capturepass did, read back from a dump directory.

Prints, for every compiled graph under ``DIR`` (each a directory holding
``graph.json``), the lanes, records, waits, event leases, retained owners and
segments, every graph break with its reason, every wait with the dependency
that made it necessary, and the decisions the passes logged. ``--json`` prints
the same summary as one JSON object whose keys are ``lanes``, ``records``,
``waits``, ``leases``, ``retained``, ``segments``, ``breaks`` (totals over the
graphs; ``lanes`` is the most any graph uses) and ``graphs`` (one such object
per graph). ``--html OUT`` also writes the schedule as a self-contained HTML
timeline, ``--trace OUT`` as a Chrome trace (see :mod:`capturepass.viewer`): with
measured times for each graph whose folder holds a ``measured.json`` of the same
``graph.json`` (written by :func:`capturepass.trace` on a GPU), with the cost
model's estimates otherwise; the last line printed says which.

A malformed dump (a ``graph.json`` that is not the document the printer writes, a
folder without one, a file given as the folder) prints one line naming the file and
the field at fault, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from capturepass.errors import DumpError
from capturepass.ir import graph_json
from capturepass.ir.graph_json import GRAPH_FILE, GraphDoc

SUMMARY_KEYS = ("lanes", "records", "waits", "leases", "retained", "segments", "breaks")


def _graph_dirs(root: str) -> list[str]:
    if not os.path.exists(root):
        raise DumpError(root, "", "no such directory")
    if not os.path.isdir(root):
        raise DumpError(root, "", f"is a file, not a dump directory (give the folder that holds {GRAPH_FILE})")
    if os.path.isfile(os.path.join(root, GRAPH_FILE)):
        return [root]
    found = []
    for dirpath, _dirnames, filenames in sorted(os.walk(root)):
        if GRAPH_FILE in filenames:
            found.append(dirpath)
    return sorted(found)


def summarize_graph(graph: GraphDoc, name: str) -> dict[str, Any]:
    """The summary of one ``graph.json`` document."""
    nodes = graph["nodes"]
    records = [n for n in nodes if n["effect"] == "record"]
    waits = [n for n in nodes if n["effect"] == "wait"]
    retains = [n for n in nodes if n["effect"] == "retain"]
    leases = sorted({n["lease"] for n in records + waits if "lease" in n})
    retained = sum(len(n["args"]) + len(n.get("resources", [])) for n in retains)
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
        "segments": len(graph["segments"]),
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
        "decisions": graph.get("decisions", []),
    }


def load_graph_dirs(root: str) -> list[tuple[str, str, GraphDoc]]:
    """``(name, folder, graph.json document)`` of every graph under ``root``, in path order.

    Every document is validated (:func:`capturepass.ir.graph_json.load`).

    Raises:
        DumpError: ``root`` is missing or a file, holds no ``graph.json``, or one is
            malformed; it names the file and the field at fault.
    """
    graphs = []
    for d in _graph_dirs(root):
        name = os.path.relpath(d, root) if d != root else os.path.basename(os.path.normpath(d))
        graphs.append((name, d, graph_json.load(os.path.join(d, GRAPH_FILE))))
    if not graphs:
        raise DumpError(root, "", f"no capturepass dump ({GRAPH_FILE}) in this directory or below")
    return graphs


def load_graphs(root: str) -> list[tuple[str, GraphDoc]]:
    """``(name, graph.json document)`` of every graph under ``root``, in path order.

    Raises:
        DumpError: as :func:`load_graph_dirs`.
    """
    return [(name, graph) for name, _, graph in load_graph_dirs(root)]


def summarize(root: str) -> dict[str, Any]:
    """The summary of every graph under ``root``, with totals."""
    graphs = [summarize_graph(g, name) for name, g in load_graphs(root)]
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
        for x in g["external"]:
            lines.append(f"  external stream {x['name']} ({x['relation']}): {x['joins']} join(s)")
        for w in g["wait_reasons"]:
            lines.append(
                f"  wait %{w['node']} on s{w['lane']} for {w['event']} ({w['role']}, lease {w['lease']}): {w['why']}"
            )
        for b in g["breaks"]:
            where = f" at %{b['node']}" if b["node"] else ""
            lines.append(f"  break ({b['source']}){where}: {b['reason']}")
        for d in g["decisions"]:
            lines.append(f"  decision: {d}")
    lines.append(
        "total: " + ", ".join(
            f"{k} {summary[k] if k != 'breaks' else len(summary[k])}" for k in SUMMARY_KEYS
        )
    )
    return "\n".join(lines)


def summarize_dir(root: str) -> str:
    """:func:`format_summary` of :func:`summarize` (used by the examples)."""
    return format_summary(summarize(root))


def main(argv: list[str] | None = None) -> int:
    """The ``capturepass`` console script."""
    parser = argparse.ArgumentParser(prog="capturepass", description="Inspect capturepass dumps.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="summarize a dump directory")
    show.add_argument("dir", help="a dump directory (the dump_dir option, or one graph's folder in it)")
    show.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    show.add_argument("--html", metavar="OUT", help="also write the schedule as a self-contained HTML timeline")
    show.add_argument(
        "--trace", metavar="OUT",
        help="also write the schedule as a Chrome trace (Perfetto opens it): measured times where DIR holds a "
             "measured run (capturepass.trace), cost-model estimates otherwise",
    )
    args = parser.parse_args(argv)
    note = None
    try:
        summary = summarize(args.dir)
        if args.html or args.trace:
            from capturepass import viewer

            if args.html:
                viewer.write_html(args.dir, args.html)
            if args.trace:
                note = f"trace {args.trace}: " + viewer.trace_note(viewer.write_trace(args.dir, args.trace))
    except DumpError as exc:
        print(f"capturepass show: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output file (--html, --trace) that cannot be written
        print(f"capturepass show: {exc.filename or 'output'}: cannot be written ({exc.strerror or exc})",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
        if note:
            print(note, file=sys.stderr)
    else:
        print(format_summary(summary))
        if note:
            print(note)
    return 0
