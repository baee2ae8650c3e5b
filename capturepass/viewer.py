"""The schedule of a dump as a picture: a self-contained HTML timeline and a Chrome trace.

``capturepass show DIR --html out.html`` and ``--trace out.json`` read every
``graph.json`` under ``DIR`` and replay its schedule on the nominal device of
:mod:`capturepass.ir.cost`: each lane has a clock; a compute node starts at its
lane's clock and takes its roofline time (:func:`~capturepass.ir.cost.node_time`);
a record stamps its event with the lane's clock; a wait moves its lane's clock
up to that stamp. Nodes stay in program order on their lane, so the picture is
the schedule capturepass emitted, timed by the same estimates the scheduler
used (only ratios mean anything).

The HTML page needs no network: CSS, the SVG and a few lines of script are
inline. It draws a row per lane, each kernel as a box as wide as its estimated
time, records and waits as markers joined by arrows, segments and breaks as
shaded bands, and lists the waits with the dependency that made each necessary
(also shown on hover), the retained owners, the breaks and the decisions.

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
page always draws the estimates.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from typing import Any

from capturepass.ir.cost import node_time
from capturepass.ir.meta import Cost

# Records and waits take no device time; a hair of simulated time keeps them in
# order on their lane and gives each trace flow a slice to bind to.
SYNC_US = 0.01

_LANE_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")


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


# -- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 4px;border-top:1px solid #ccc;padding-top:12px}
h3{font-size:13px;margin:12px 0 4px} .muted{color:#666} code{font:12px ui-monospace,monospace}
svg.timeline{display:block;border:1px solid #ddd;background:#fafafa;margin:8px 0}
.lane-label{font:12px ui-monospace,monospace;fill:#222} .axis{font:10px sans-serif;fill:#777}
.lane-bg{fill:#fff;stroke:#e4e4e4} .segment{fill:#cfe3f7;opacity:.45} .segment-label{font:11px sans-serif;fill:#3b6ea5}
.break{stroke:#c0392b;stroke-width:1} .break-label{font:11px sans-serif;fill:#c0392b}
.kernel{stroke:#fff;stroke-width:.5} .kernel.serialize{stroke:#222;stroke-width:1.5;stroke-dasharray:3 2}
.kernel.view{opacity:.35} .kernel-text{font:10px ui-monospace,monospace;fill:#fff;pointer-events:none}
.record{fill:#222} .wait{fill:#fff;stroke:#222;stroke-width:1.5} .release{stroke:#888;stroke-width:1.5}
.edge{fill:none;stroke:#555;stroke-width:1.2;opacity:.7}
.edge.join{stroke:#8e44ad} .edge.fork{stroke:#16a085}
.hl{opacity:1 !important;stroke:#e74c3c !important;stroke-width:3 !important}
tr.hl td{background:#fdecea}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f0f0f0} .key span{display:inline-block;margin-right:14px}
.swatch{display:inline-block;width:14px;height:10px;vertical-align:middle;margin-right:4px;border:1px solid #999}
#viewer-error{background:#c0392b;color:#fff;padding:8px;font-weight:bold}
"""

# Installed before anything else runs: any script error leaves a marker in the DOM
# (tests read it back with --dump-dom), as well as in the console.
_ERROR_HOOK = """
window.onerror=function(msg,src,line){document.documentElement.setAttribute('data-error',String(msg));
var d=document.createElement('div');d.id='viewer-error';d.textContent='script error: '+msg+' (line '+line+')';
(document.body||document.documentElement).appendChild(d);};
"""

_SCRIPT = """
(function(){
  function mark(key,on){document.querySelectorAll('[data-wait="'+key+'"]').forEach(function(el){
    el.classList.toggle('hl',on);});}
  document.querySelectorAll('[data-wait]').forEach(function(el){
    var key=el.getAttribute('data-wait');
    el.addEventListener('mouseenter',function(){mark(key,true);});
    el.addEventListener('mouseleave',function(){mark(key,false);});
  });
  var rows=document.querySelectorAll('.lane-row').length;
  document.documentElement.setAttribute('data-lane-rows',String(rows));
  document.documentElement.setAttribute('data-ready','1');
})();
"""

_LABEL_W = 150
_PLOT_W = 1150
_ROW_H = 40
_BOX_H = 24
_TOP = 34


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``, ``mylib.gemm.default`` -> ``gemm``."""
    parts = op.split("(")[0].split(".")
    if len(parts) >= 3:
        return parts[-2]
    if len(parts) == 2:
        return parts[1] if parts[0] in ("aten", "capturepass", "method", "module") else parts[0]
    return parts[-1]


def _node_title(it: Item) -> str:
    n = it.node
    lines = [f"%{n['name']} = {n['op']}  : {n.get('type', '')}", f"lane s{it.lane}, start {it.start:.3f} us"]
    if n["effect"] == "compute":
        lines.append(f"estimated {it.dur:.3f} us")
    cost = n.get("cost")
    if cost:
        lines.append(f"cost {cost.get('flops', 0):.3g} flops / {cost.get('bytes', 0):.3g} bytes"
                     + (f" ({cost['symbolic']})" if cost.get("symbolic") else ""))
    cap = n.get("capability") or {}
    if cap.get("overlap") == "serialize":
        lines.append(f"serialized: {cap.get('reason', '')}")
    if cap.get("resident_grid"):
        lines.append(f"resident grid, {cap.get('ctas')} CTAs, {'barrier-free' if cap.get('barrier_free') else 'barrier'}")
    for key in ("event", "role", "lease", "segment", "break", "created_by", "why"):
        if key in n:
            lines.append(f"{key}: {n[key]}")
    if n.get("resources"):
        lines.append("resources: " + ", ".join(n["resources"]))
    return "\n".join(lines)


def _wait_key(sched_index: int, wait_name: str) -> str:
    return f"g{sched_index}-{wait_name}"


def _svg(s: Schedule, gi: int) -> str:
    lanes = s.lanes
    span = s.makespan if s.makespan > 0 else 1.0
    scale = _PLOT_W / span
    height = _TOP + _ROW_H * len(lanes) + 24
    width = _LABEL_W + _PLOT_W + 20

    def x(t: float) -> float:
        return _LABEL_W + t * scale

    def y(lane: int) -> float:
        return _TOP + lane * _ROW_H

    out = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-graph="{_e(s.name)}">',
        f'<defs><pattern id="hatch{gi}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#fbe3e0"/><line x1="0" y1="0" x2="0" y2="6" stroke="#e8a9a1" stroke-width="3"/>'
        '</pattern>'
        f'<marker id="arrow{gi}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto">'
        '<path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    bottom = y(len(lanes))
    # Segments and breaks, behind everything else.
    spans: dict[str, list[float]] = {}
    for it in s.items:
        seg = it.node.get("segment")
        if seg is not None and it.node["effect"] not in ("retain",):
            lo, hi = spans.setdefault(seg, [it.start, it.end])
            spans[seg] = [min(lo, it.start), max(hi, it.end)]
    for seg, (lo, hi) in spans.items():
        w = max(x(hi) - x(lo), 2.0)
        out.append(f'<g class="segment-band" data-segment="{_e(seg)}"><rect class="segment" x="{x(lo):.1f}" y="{_TOP - 16}" '
                   f'width="{w:.1f}" height="{bottom - _TOP + 16}"><title>segment {_e(seg)}: {lo:.2f}–{hi:.2f} us</title></rect>'
                   f'<text class="segment-label" x="{x(lo) + 3:.1f}" y="{_TOP - 4}">segment {_e(seg)}</text></g>')
    for it in s.items:
        if it.node["effect"] == "compute" and "break" in it.node:
            w = max(it.dur * scale, 4.0)
            out.append(f'<g class="break-band"><rect class="break" fill="url(#hatch{gi})" x="{x(it.start):.1f}" y="{_TOP - 16}" width="{w:.1f}" '
                       f'height="{bottom - _TOP + 16}"><title>break %{_e(it.node["name"])}: {_e(it.node["break"])}</title></rect>'
                       f'<text class="break-label" x="{x(it.start) + 3:.1f}" y="{bottom + 14}">break %{_e(it.node["name"])}</text></g>')
    # Lane rows and their nodes.
    for li, lname in enumerate(lanes):
        color = _LANE_COLORS[li % len(_LANE_COLORS)]
        out.append(f'<g class="lane-row" data-lane="{li}" data-lane-name="{_e(lname)}">')
        out.append(f'<rect class="lane-bg" x="{_LABEL_W}" y="{y(li) + 2}" width="{_PLOT_W}" height="{_ROW_H - 4}"/>')
        out.append(f'<text class="lane-label" x="6" y="{y(li) + _ROW_H / 2 + 4}">s{li} {_e(lname)}</text>')
        for it in s.items:
            if it.lane != li:
                continue
            n = it.node
            title = f"<title>{_e(_node_title(it))}</title>"
            cy = y(li) + _ROW_H / 2
            if n["effect"] == "compute":
                w = it.dur * scale
                cls = "kernel"
                if (n.get("capability") or {}).get("overlap") == "serialize":
                    cls += " serialize"
                if w < 1.0:
                    cls += " view"
                    w = 1.0
                fill = "#7f8c8d" if "break" in n else color
                out.append(f'<rect class="{cls}" data-node="{_e(n["name"])}" x="{x(it.start):.2f}" y="{cy - _BOX_H / 2:.1f}" '
                           f'width="{w:.2f}" height="{_BOX_H}" fill="{fill}">{title}</rect>')
                label = _short_op(n["op"])
                fits = int((w - 4) // 6.2)
                if len(label) > fits >= 4:
                    label = label[: fits - 1] + "…"
                if fits >= len(label):
                    out.append(f'<text class="kernel-text" x="{x(it.start) + 3:.1f}" y="{cy + 4:.1f}">{_e(label)}</text>')
            elif n["effect"] == "record":
                out.append(f'<circle class="record" data-node="{_e(n["name"])}" cx="{x(it.start):.2f}" cy="{cy - _BOX_H / 2 - 3:.1f}" '
                           f'r="3.5">{title}</circle>')
            elif n["effect"] == "wait":
                key = _wait_key(gi, n["name"])
                px, py = x(it.end), cy - _BOX_H / 2 - 3
                out.append(f'<path class="wait" data-node="{_e(n["name"])}" data-wait="{_e(key)}" '
                           f'd="M{px - 4:.2f},{py - 4:.1f} L{px + 4:.2f},{py - 4:.1f} L{px:.2f},{py + 3:.1f} z">{title}</path>')
            elif n["effect"] == "release":
                px, py = x(it.start), cy + _BOX_H / 2 + 3
                out.append(f'<path class="release" data-node="{_e(n["name"])}" d="M{px - 3:.2f},{py - 3:.1f} L{px + 3:.2f},{py + 3:.1f} '
                           f'M{px - 3:.2f},{py + 3:.1f} L{px + 3:.2f},{py - 3:.1f}">{title}</path>')
        out.append("</g>")
    # Event edges on top.
    for e in s.edges:
        key = _wait_key(gi, e.wait.node["name"])
        x1, y1 = x(e.record.start), y(e.record.lane) + _ROW_H / 2 - _BOX_H / 2 - 3
        x2, y2 = x(e.wait.end), y(e.wait.lane) + _ROW_H / 2 - _BOX_H / 2 - 7
        mid = (y1 + y2) / 2
        role = e.wait.node.get("role", "")
        out.append(f'<path class="edge {_e(role)}" data-wait="{_e(key)}" marker-end="url(#arrow{gi})" '
                   f'd="M{x1:.2f},{y1:.1f} C{x1 + 12:.2f},{mid:.1f} {x2 - 12:.2f},{mid:.1f} {x2:.2f},{y2:.1f}">'
                   f'<title>{_e(e.event)}: %{_e(e.record.node["name"])} (s{e.record.lane}) → %{_e(e.wait.node["name"])} '
                   f'(s{e.wait.lane})\nwhy: {_e(e.why)}</title></path>')
    # Time axis.
    for i in range(6):
        t = span * i / 5
        out.append(f'<text class="axis" x="{x(t):.1f}" y="{height - 4}" text-anchor="middle">{t:.1f} us</text>')
    out.append("</svg>")
    return "\n".join(out)


def _retained(graph: dict[str, Any]) -> list[tuple[str, list[str]]]:
    rows = []
    for n in graph["nodes"]:
        if n["effect"] == "retain":
            rows.append((n.get("segment") or "?", list(n["args"]) + [f"resource {r}" for r in n.get("resources", [])]))
    return rows


def _section(s: Schedule, gi: int, summary: dict[str, Any]) -> str:
    g = s.graph
    parts = [
        f'<section class="graph" data-graph="{_e(s.name)}">',
        f"<h2>graph {_e(s.name)} <span class=\"muted\">({_e(g['graph'])}, owner {_e(g['owner'])}, "
        f"cudagraphs={_e(g['cudagraphs'])})</span></h2>",
        f'<p class="summary">lanes {summary["lanes"]}, records {summary["records"]}, waits {summary["waits"]}, '
        f'leases {summary["leases"]}, releases {summary["releases"]}, retained {summary["retained"]}, '
        f'segments {summary["segments"]}, breaks {len(summary["breaks"])}; estimated makespan '
        f'{s.makespan:.2f} us</p>',
        _svg(s, gi),
        "<h3>Waits, and the dependency that made each necessary</h3>",
    ]
    if s.edges:
        parts.append("<table class=\"waits\"><tr><th>wait</th><th>lane</th><th>event</th><th>recorded by</th><th>why</th></tr>")
        for e in s.edges:
            w = e.wait.node
            parts.append(
                f'<tr data-wait="{_e(_wait_key(gi, w["name"]))}"><td><code>%{_e(w["name"])}</code></td>'
                f"<td>s{e.wait.lane}</td><td>{_e(e.event)} ({_e(w.get('role', ''))}, lease {_e(w.get('lease', '-'))})</td>"
                f"<td><code>%{_e(e.record.node['name'])}</code> on s{e.record.lane}</td><td><code>{_e(e.why)}</code></td></tr>"
            )
        parts.append("</table>")
    else:
        parts.append('<p class="muted">no waits: one lane, or nothing crosses lanes</p>')
    parts.append("<h3>Retained owners</h3>")
    retained = _retained(g)
    if retained:
        parts.append("<ul class=\"retained\">")
        for seg, names in retained:
            parts.append(f"<li>segment {_e(seg)}: " + ", ".join(f"<code>{_e(n)}</code>" for n in names) + "</li>")
        parts.append("</ul>")
    else:
        parts.append('<p class="muted">none (nothing is captured, or the segments read no static storage)</p>')
    if g["breaks"]:
        parts.append("<h3>Breaks</h3><ul class=\"breaks\">")
        for b in g["breaks"]:
            where = f" at <code>%{_e(b['node'])}</code>" if b.get("node") else ""
            parts.append(f"<li>{_e(b['source'])}{where}: {_e(b['reason'])}</li>")
        parts.append("</ul>")
    if g.get("decisions"):
        parts.append("<h3>Decisions</h3><ul class=\"decisions\">")
        parts.extend(f"<li>{_e(d)}</li>" for d in g["decisions"])
        parts.append("</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def render_html(root: str) -> str:
    """The self-contained HTML page of every graph under a dump directory."""
    from capturepass.cli import load_graphs, summarize_graph

    graphs = load_graphs(root)
    sections = []
    for gi, (name, graph) in enumerate(graphs):
        sections.append(_section(simulate(graph, name), gi, summarize_graph(graph, name)))
    key = (
        '<p class="key"><span><span class="swatch" style="background:#4e79a7"></span>kernel (width: estimated time)</span>'
        '<span><span class="swatch" style="background:#fff;border:1.5px dashed #222"></span>serialized op</span>'
        '<span>● record</span><span>▽ wait</span><span>✕ deferred release</span>'
        '<span><span class="swatch" style="background:#cfe3f7"></span>capture segment</span>'
        '<span><span class="swatch" style="background:#fbe3e0;border-color:#c0392b"></span>break (runs eagerly)</span>'
        "<span>→ record→wait edge (hover a wait or an arrow for its reason)</span></p>"
    )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>capturepass schedule</title>"
        f"<script>{_ERROR_HOOK}</script><style>{_CSS}</style></head><body>\n"
        "<h1>capturepass schedule</h1>\n"
        '<p class="muted">Each row is a lane (a CUDA stream on a GPU); nodes are placed in program order on their lane '
        "and timed by capturepass's cost estimates on a nominal device (only ratios mean anything).</p>\n"
        + key + "\n" + "\n".join(sections) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n"
    )


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
                           "dur": round(max(it.dur, SYNC_US), 4), "name": f"{_short_op(n['op'])} %{n['name']}",
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
    graphs = doc.get("otherData", {}).get("graphs", {})
    measured = [f"{g} {w[len('measured '):]}" for g, w in graphs.items() if w.startswith("measured")]
    estimated = [g + w[len("estimated"):] for g, w in graphs.items() if not w.startswith("measured")]
    parts = []
    if measured:
        parts.append("measured times for " + ", ".join(measured))
    if estimated:
        parts.append("cost-model estimates (nominal device) for " + ", ".join(estimated))
    line = "; ".join(parts)
    if not measured:
        line += " (no measured run in the dump: record one on a GPU with capturepass.trace(compiled, *args))"
    return line


def write_html(root: str, path: str) -> None:
    """Writes :func:`render_html` of ``root`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(root))


def write_trace(root: str, path: str, measured: bool = True) -> dict[str, Any]:
    """Writes :func:`render_trace` of ``root`` to ``path`` (strict JSON); returns the document."""
    doc = render_trace(root, measured)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=None, sort_keys=True, allow_nan=False)
        f.write("\n")
    return doc
