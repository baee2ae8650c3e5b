"""The schedule page of ``capturepass show DIR --html OUT``: one self-contained HTML file.

For every graph under ``DIR`` the page holds a timeline and, beside it, what one lane
would have taken against what the lanes took and the overlap gained, in numbers and as
bars (:func:`capturepass.show.schedule.graph_timing`); then the lanes and why each kernel is
on its lane, the capability decisions, the decisions of the passes, the owners its
callable created at run time (``owners.json``), the retained objects with their owner
and segment, the waits with their reasons and the breaks (the same lists as
``capturepass show``).

The timeline is drawn by a small inline script from a JSON model of the graph, so that
it fits the window at any width and zooms (the ``−``/``fit``/``+`` buttons, Ctrl +
wheel over it, or ``page.html#zoom=4``; the zoomed plot scrolls sideways, the lane
names stay). Kernels
are boxes as wide as their time: measured (the run of median span of the dump's
``measured.json``) or estimated by the cost model on a nominal device; the graph's
heading says which. Labels are placed only where they fit: a kernel's name inside its
box (shortened with ``…``, or left to the tooltip), segment and break names where they
do not run into the previous one; records and waits too close to tell apart merge into
one marker with a count. Event arrows are drawn beneath the kernels, so they never
cross a label. Every element has a tooltip.

The script also writes what it drew into attributes of ``<html>`` (``data-ready``,
``data-lane-rows``, ``data-labels``, ``data-label-overlaps``, ``data-overflow``,
``data-rows``: the first timeline's row centres and plot extent), which the browser
tests read back from the DOM.
"""

from __future__ import annotations

import html
import json
from typing import Any

from capturepass.measure.report import short_name
from capturepass.show.dumps import load_graph_dirs
from capturepass.show.schedule import LANE_COLORS, SYNC_US, Schedule, graph_timing, median_run, short_op, times_note
from capturepass.show.summary import summarize_graph


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _title(it: Any, source: str) -> str:
    n = it.node
    lines = [f"%{n['name']} = {n['op']}  : {n.get('type', '')}", f"lane s{it.lane}, start {it.start:.3f} us"]
    if n["effect"] == "compute":
        lines.append(f"{source} {it.dur:.3f} us")
    cost = n.get("cost")
    if cost:
        lines.append(f"cost {cost.get('flops', 0):.3g} flops / {cost.get('bytes', 0):.3g} bytes"
                     + (f" ({cost['symbolic']})" if cost.get("symbolic") else ""))
    cap = n.get("capability") or {}
    if cap.get("overlap") == "serialize":
        lines.append(f"serialized: {cap.get('reason', '')}")
    if cap.get("resident_grid"):
        lines.append(f"resident grid, {cap.get('ctas')} CTAs, {'barrier-free' if cap.get('barrier_free') else 'barrier'}")
    for key in ("hint", "event", "role", "lease", "owner", "segment", "break", "created_by", "why"):
        if key in n:
            lines.append(f"{key}: {n[key]}")
    if n.get("resources"):
        lines.append("resources: " + ", ".join(n["resources"]))
    return "\n".join(lines)


def _wait_key(gi: int, name: str) -> str:
    return f"g{gi}-{name}"


def estimated_model(s: Schedule, gi: int) -> dict[str, Any]:
    """The drawing of a simulated schedule: kernels, markers, arrows, segments, breaks (times in us)."""
    kernels, marks, edges, breaks = [], [], [], []
    index: dict[str, int] = {}
    segs: dict[str, list[float]] = {}
    hidden = 0
    for it in s.items:
        n = it.node
        eff = n["effect"]
        seg = n.get("segment")
        if seg is not None and eff in ("compute", "record", "wait", "release"):
            lo, hi = segs.setdefault(seg, [it.start, it.end])
            segs[seg] = [min(lo, it.start), max(hi, it.end)]
        if eff == "compute":
            if "break" in n:
                breaks.append({"s": it.start, "d": it.dur, "t": f"break %{n['name']}",
                               "h": f"break %{n['name']}: {n['break']}"})
            if it.dur <= 0:
                hidden += 1
                continue
            cls = "kernel"
            if (n.get("capability") or {}).get("overlap") == "serialize":
                cls += " serialize"
            if "break" in n:
                cls += " brk"
            kernels.append({"l": it.lane, "s": it.start, "d": it.dur, "t": short_op(n["op"]),
                            "h": _title(it, "estimated"), "c": cls})
        elif eff in ("record", "wait", "release"):
            mark = {"l": it.lane, "x": it.end if eff == "wait" else it.start, "k": eff, "h": _title(it, "")}
            if eff == "wait":
                mark["w"] = _wait_key(gi, n["name"])
            index[n["name"]] = len(marks)
            marks.append(mark)
    for e in s.edges:
        edges.append({"a": index[e.record.node["name"]], "b": index[e.wait.node["name"]],
                      "r": e.wait.node.get("role", ""), "w": _wait_key(gi, e.wait.node["name"]),
                      "h": f"{e.event}: %{e.record.node['name']} (s{e.record.lane}) → %{e.wait.node['name']} "
                           f"(s{e.wait.lane})\nwhy: {e.why}"})
    return {"lanes": list(s.lanes), "span": max(s.makespan, SYNC_US), "kernels": kernels, "marks": marks,
            "edges": edges, "breaks": breaks, "hidden": hidden,
            "segments": [{"t": f"segment {k}", "s": lo, "e": hi} for k, (lo, hi) in segs.items()]}


def measured_model(m: dict[str, Any]) -> dict[str, Any]:
    """The drawing of one measured run (the run of median span): each kernel at its measured time."""
    run = median_run(m)
    ks = [k for k in m["kernels"] if k["run"] == run]
    origin = min((k["start"] for k in ks), default=0.0)
    lanes = list(m["lanes"])
    extra = any(k["lane"] is None or k["lane"] >= len(lanes) for k in ks)
    if extra:
        lanes.append("lane not matched")
    kernels = []
    for k in ks:
        lane = k["lane"] if k["lane"] is not None and k["lane"] < len(m["lanes"]) else len(lanes) - 1
        nodes = k.get("nodes") or []
        label = f"%{nodes[0]}" if len(nodes) == 1 else short_op(k["op"]) if k.get("op") else short_name(k["name"], 40)
        title = [k["name"], f"lane s{lane}, start {k['start'] - origin:.3f} us, measured {k['dur']:.3f} us",
                 f"stream {k['stream']}" + (", from the CUDA graph" if k.get("graph_kernel") else "")]
        if k.get("owner"):
            title.append(f"owner {k['owner']}")
        if k.get("op"):
            title.append(f"op {k['op']}")
        if nodes:
            title.append("nodes: " + ", ".join(f"%{x}" for x in nodes))
        kernels.append({"l": lane, "s": k["start"] - origin, "d": k["dur"], "t": label, "h": "\n".join(title),
                        "c": "kernel"})
    span = max((k["s"] + k["d"] for k in kernels), default=0.0)
    return {"lanes": lanes, "span": max(span, SYNC_US), "kernels": kernels, "marks": [], "edges": [],
            "breaks": [], "segments": [], "hidden": 0, "run": run}


def _json_script(value: Any) -> str:
    # Inside <script>, "</" would end the element and "<!--" open a comment.
    return json.dumps(value, separators=(",", ":"), sort_keys=True).replace("<", "\\u003c")


def _stats(t: dict[str, Any], lanes: list[str], gi: int) -> str:
    one, sched, gained = t["one_lane_us"], t["scheduled_us"], t["gained_us"]
    full = max(one, sched, 1e-9)
    measured = t["source"] == "measured"
    what = "busy (kernels of any lane)" if measured else "scheduled (estimated makespan)"
    rows = [
        '<aside class="stats">',
        '<h3>One lane against the lanes</h3>',
        f'<div class="stat"><b>one lane</b> <span class="num one-lane">{one:.2f} µs</span>'
        f'<div class="why">the same kernels back to back on one lane{"" if measured else " (estimated)"}</div></div>',
        f'<div class="bar" title="one lane: {one:.2f} us"><div class="fill one" style="width:{100 * one / full:.2f}%"></div></div>',
        f'<div class="stat"><b>on {len(lanes)} lane(s)</b> <span class="num scheduled">{sched:.2f} µs</span>'
        f'<div class="why">{what}</div></div>',
        f'<div class="bar" title="on {len(lanes)} lane(s): {sched:.2f} us"><div class="fill sched" '
        f'style="width:{100 * sched / full:.2f}%"></div><div class="fill gain" style="width:{100 * max(gained, 0) / full:.2f}%" '
        f'title="overlap gained: {gained:.2f} us"></div></div>',
        f'<div class="stat gained"><b>overlap gained</b> <span class="num"><span class="gain-us">{gained:.2f} µs</span> '
        f'<span class="gain-pct">({t["gained_pct"]:.0f}%)</span></span></div>',
    ]
    if measured:
        rows.append(f'<div class="why">span {t["span_us"]:.2f} µs per run, first kernel to last, gaps included '
                    f'(profiler overhead widens them)</div>')
    busy = t.get("lanes_busy_us", {})
    rows.append('<ul class="lane-stats">')
    for i, name in enumerate(lanes):
        color = LANE_COLORS[i % len(LANE_COLORS)]
        rows.append(f'<li class="lane-stat" data-lane="{i}"><span class="swatch" style="background:{color}"></span>'
                    f's{i} {_e(name)}: {busy.get(f"s{i}", 0.0):.2f} µs of kernels</li>')
    rows.append("</ul></aside>")
    return "\n".join(rows)


def _source_line(t: dict[str, Any], model: dict[str, Any]) -> str:
    if t["source"] == "measured":
        return (f'<p class="times measured">Times: <b>measured</b> ({_e(t["mode"])}, {t["runs"]} run(s) on '
                f'{_e(t.get("device") or "?")}); drawn: run {model.get("run")}, the run of median span. Each box is '
                "as wide as the kernel ran.</p>")
    floor = (f" {t['at_floor']} of {t['kernels']} kernels are at the device's 2 µs launch floor, so their boxes are "
             "equally wide." if t.get("at_floor") else "")
    why = f" ({_e(t['why_not_measured'])})" if t.get("why_not_measured") else ""
    hidden = f" Views and other nodes without a kernel ({model['hidden']}) are not drawn." if model["hidden"] else ""
    return (f'<p class="times estimated">Times: <b>estimated</b> by the cost model on a nominal device '
            f"(roofline, 790 TFLOP/s, 4 TB/s); no measured run in the dump{why}: record one on a GPU with "
            f"<code>capturepass.trace</code>.{floor}{hidden}</p>")


def _list(title: str, cls: str, items: list[str], empty: str | None = None) -> str:
    if not items:
        return f'<h3>{title}</h3><p class="muted">{empty}</p>' if empty else ""
    return f'<h3>{title}</h3><ul class="{cls}">' + "".join(f"<li>{x}</li>" for x in items) + "</ul>"


def _section(gi: int, name: str, summary: dict[str, Any], model: dict[str, Any]) -> str:
    g = summary
    t = g["timing"]
    model = dict(model, name=name, gi=gi)
    parts = [
        f'<section class="graph" data-graph="{_e(name)}">',
        f'<h2>graph {_e(name)} <span class="muted">({_e(g["graph"])}, owner {_e(g["owner"])}, '
        f'cudagraphs={_e(g["cudagraphs"])})</span></h2>',
        f'<p class="summary">lanes {g["lanes"]}, records {g["records"]}, waits {g["waits"]}, leases {g["leases"]}, '
        f'releases {g["releases"]}, retained {g["retained"]}, segments {g["segments"]}, breaks {len(g["breaks"])}</p>',
        _source_line(t, model),
        '<div class="row">',
        f'<div class="timeline-box" data-graph="{_e(name)}"><div class="toolbar">'
        '<button type="button" data-zoom="out" title="zoom out">−</button>'
        '<button type="button" data-zoom="fit" title="fit the window">fit</button>'
        '<button type="button" data-zoom="in" title="zoom in (or Ctrl + wheel over the timeline)">+</button>'
        '<span class="zoom-level">×1</span></div>'
        '<div class="tl"><div class="lane-names"></div><div class="scroller"></div></div>'
        f'<script type="application/json" class="schedule-model">{_json_script(model)}</script></div>',
        _stats(t, model["lanes"] if t["source"] == "measured" else g["lane_names"], gi),
        "</div>",
    ]
    decisions = g["decisions"]
    parts.append(_list("Lanes, and why each kernel is on its lane", "lanes",
                       [_e(d["text"]) for d in decisions if d["kind"] == "lane"]))
    parts.append(_list("Capability decisions", "capabilities",
                       [_e(d["text"]) for d in decisions if d["kind"] == "capability"],
                       "every op capturable and free to overlap (the defaults)"))
    parts.append(_list("Decisions of the passes", "decisions",
                       [_e(d["text"][len("decision: "):]) for d in decisions if d["kind"] == "pass"]))
    picks = [_e(d["text"][len("pick: "):]) for d in decisions if d["kind"] == "pick"]
    if picks:
        parts.append(_list("Schedules measured (at capture: estimate against measured; uncaptured calls: the "
                           "lanes against one stream)", "picks", picks))
    owners = [f"<code>{_e(o['name'])}</code> — model {_e(o['model'])}, {_e(o['role'])}, inputs "
              f"{_e(o['inputs'] or 'none')}" for o in g["runtime_owners"]]
    if g["runtime_owners_not_shown"]:
        parts.append(_list("Owners at run time", "owners", [], f"not shown ({_e(g['runtime_owners_not_shown'])})"))
    elif owners or g["runtime_owners_recorded"]:
        parts.append(_list("Owners at run time (named after the graph owner: model instance, capture shape)", "owners",
                           owners, "none yet (no model ran this graph)"))
    retained = [f"<code>{_e(o['object'])}</code> {_e(o['kind'])} {_e(o['type'] or '')} — owner {_e(o['owner'])}, "
                f"segment {_e(o['segment'])}" for o in g["retained_objects"]]
    parts.append(_list("Retained objects (kept alive for the captured segments)", "retained", retained,
                       "none (nothing is captured, or the segments read no static storage)"))
    parts.append("<h3>Waits, and the dependency that made each necessary</h3>")
    if g["wait_reasons"]:
        parts.append('<table class="waits"><tr><th>wait</th><th>lane</th><th>event</th><th>why</th></tr>')
        for w in g["wait_reasons"]:
            parts.append(f'<tr data-wait="{_e(_wait_key(gi, w["node"]))}"><td><code>%{_e(w["node"])}</code></td>'
                         f'<td>s{w["lane"]}</td><td>{_e(w["event"])} ({_e(w["role"] or "")}, lease '
                         f'{_e(w["lease"] or "-")})</td><td><code>{_e(w["why"])}</code></td></tr>')
        parts.append("</table>")
    else:
        parts.append('<p class="muted">no waits: one lane, or nothing crosses lanes</p>')
    brks = [f"{_e(b['source'])}" + (f" at <code>%{_e(b['node'])}</code>" if b.get("node") else "")
            + f": {_e(b['reason'])}" for b in g["breaks"]]
    parts.append(_list("Breaks", "breaks", brks))
    parts.append("</section>")
    return "\n".join(parts)


def render(root: str) -> tuple[str, dict[str, str]]:
    """The page of every graph under ``root``, and per graph which times it draws."""
    sections, which = [], {}
    for gi, (name, folder, graph) in enumerate(load_graph_dirs(root)):
        timing, m, s = graph_timing(folder, graph, name)
        summary = summarize_graph(graph, name, folder)
        if m is not None:
            model = measured_model(m)
            which[name] = f"measured ({m['mode']}, {m['runs']} run(s) on {m.get('device', '?')})"
        else:
            model = estimated_model(s, gi)
            which[name] = "estimated" + (f" ({timing['why_not_measured']})" if timing.get("why_not_measured") else "")
        sections.append(_section(gi, name, summary, model))
    key = (
        '<p class="key"><span><span class="swatch" style="background:#4e79a7"></span>kernel (width: its time)</span>'
        '<span><span class="swatch" style="background:#fff;border:1.5px dashed #222"></span>serialized op</span>'
        '<span>● record</span><span>▽ wait</span><span>✕ deferred release</span><span>(3) markers merged</span>'
        '<span><span class="swatch" style="background:#cfe3f7"></span>capture segment</span>'
        '<span><span class="swatch" style="background:#fbe3e0;border-color:#c0392b"></span>break (runs eagerly)</span>'
        "<span>→ record→wait (hover a wait, an arrow or a table row for its reason)</span></p>"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>capturepass schedule</title>"
        f"<script>{_ERROR_HOOK}</script><style>{_CSS}</style></head><body>\n"
        "<h1>capturepass schedule</h1>\n"
        f'<p class="muted">Each row is a lane (a CUDA stream on a GPU), kernels in program order on their lane. '
        f"{_e(times_note(which))}.</p>\n"
        "<noscript><p><b>The timelines are drawn by the page's script; the lists below need none.</b></p></noscript>\n"
        + key + "\n" + "\n".join(sections) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n"
    )
    return page, which


_CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:12px 16px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:20px 0 4px;border-top:1px solid #ccc;padding-top:10px}
h3{font-size:13px;margin:12px 0 4px} .muted{color:#666} code{font:12px ui-monospace,monospace}
p.times{margin:4px 0} .row{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.timeline-box{flex:1 1 480px;min-width:0} .toolbar{margin:2px 0}
.toolbar button{font:12px system-ui,sans-serif;min-width:28px;margin-right:2px}
.zoom-level{font-size:11px;color:#666;margin-left:6px}
.tl{display:flex;border:1px solid #ddd;background:#fafafa} .lane-names{flex:none} .scroller{flex:1 1 auto;overflow-x:auto;min-width:0}
svg{display:block} .lane-label{font:12px ui-monospace,monospace;fill:#222} .axis{font:10px sans-serif;fill:#666}
.tick{stroke:#e4e4e4} .lane-bg{fill:#fff;fill-opacity:.55;stroke:#e4e4e4} .segment{fill:#cfe3f7;opacity:.45}
.segment-label{font:11px sans-serif;fill:#3b6ea5} .break{stroke:#c0392b;stroke-width:1} .break-label{font:11px sans-serif;fill:#c0392b}
.kernel{stroke:#fff;stroke-width:.5} .kernel.serialize{stroke:#222;stroke-width:1.5;stroke-dasharray:3 2}
.kernel-text{font:11px ui-monospace,monospace;fill:#fff;pointer-events:none}
.record{fill:#222} .wait{fill:#fff;stroke:#222;stroke-width:1.5} .release{stroke:#888;stroke-width:1.5;fill:none}
.cluster{fill:#fff;stroke:#222} .cluster-text{font:9px sans-serif;fill:#222;pointer-events:none}
.edge{fill:none;stroke:#555;stroke-width:1.2;opacity:.55} .edge.join{stroke:#8e44ad} .edge.fork{stroke:#16a085}
.hl{opacity:1 !important;stroke:#e74c3c !important;stroke-width:3 !important} tr.hl td{background:#fdecea}
.stats{flex:0 1 260px;min-width:220px;border:1px solid #ddd;padding:6px 10px;background:#fcfcfc}
.stats h3{margin:0 0 6px} .stat{margin-top:6px} .stat .num{font:13px ui-monospace,monospace;float:right}
.stat .why,.stats .why{font-size:11px;color:#666;clear:both}
.bar{height:12px;background:#eee;margin:3px 0 6px;display:flex} .fill{height:100%} .fill.one{background:#7f8c8d}
.fill.sched{background:#4e79a7} .fill.gain{background:repeating-linear-gradient(45deg,#a8d5a2 0 4px,#d7efd3 4px 8px)}
.gained b{color:#2e7d32} ul.lane-stats{list-style:none;padding:0;margin:8px 0 0;font-size:12px}
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

_SCRIPT = (
    "var COLORS=" + json.dumps(list(LANE_COLORS)) + ";\n"
    + r"""
(function(){
'use strict';
var NS='http://www.w3.org/2000/svg';
var ROW=46, BOX=22, STRIP=14, TOP=24, AXIS=20, PAD=10, BRK=16;
var canvas=document.createElement('canvas').getContext('2d');
function tw(text,font){canvas.font=font;return canvas.measureText(text).width;}
var KFONT='11px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace', LFONT='12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace', SFONT='11px sans-serif';
function el(tag,attrs,parent,text){var e=document.createElementNS(NS,tag);for(var k in attrs){e.setAttribute(k,attrs[k]);}
  if(text!=null){e.textContent=text;} if(parent){parent.appendChild(e);} return e;}
function tip(e,text){if(text){el('title',{},e,text);}return e;}
function fmt(t){return (t>=100?t.toFixed(0):t>=10?t.toFixed(1):t>=1?t.toFixed(2):t.toFixed(3))+' µs';}
function step(span,px){var raw=span*70/Math.max(px,1),p=Math.pow(10,Math.floor(Math.log(raw)/Math.LN10));
  var m=[1,2,5,10];for(var i=0;i<m.length;i++){if(m[i]*p>=raw){return m[i]*p;}}return 10*p;}
function fit(text,font,room){if(tw(text,font)+6<=room){return text;}
  for(var n=text.length-1;n>=3;n--){var t=text.slice(0,n)+'…';if(tw(t,font)+6<=room){return t;}}return null;}
function rowTop(li){return TOP+li*ROW;}

function draw(box){
  var m=box._model, zoom=box._zoom||1;
  var names=box.querySelector('.lane-names'), scroller=box.querySelector('.scroller');
  var labelW=16; m.lanes.forEach(function(n,i){labelW=Math.max(labelW,tw('s'+i+' '+n,LFONT)+14);});
  labelW=Math.min(labelW,Math.max(90,box.clientWidth*0.3));
  var avail=Math.max(160,box.clientWidth-labelW-4);
  var plotW=Math.max(100,(avail-2*PAD)*zoom), span=m.span>0?m.span:1, sx=plotW/span;
  function x(t){return PAD+t*sx;}
  var nl=m.lanes.length, H=TOP+ROW*nl+(m.breaks.length?BRK:0)+AXIS, W=plotW+2*PAD;
  // Lane names: a column of their own, so that they stay when the plot scrolls.
  names.innerHTML=''; scroller.innerHTML='';
  var left=el('svg',{width:labelW,height:H},names);
  var svg=el('svg',{'class':'timeline',width:W,height:H,viewBox:'0 0 '+W+' '+H},scroller);
  var bands=el('g',{},svg), rows=el('g',{},svg), edgesG=el('g',{},svg), boxes=el('g',{},svg), marksG=el('g',{},svg), text=el('g',{},svg);
  // The time axis: ticks at least 70 px apart.
  var st=step(span,plotW);
  for(var t=0;t<=span+1e-9;t+=st){var tx=x(t),lab=fmt(t),half=tw(lab,'10px sans-serif')/2;
    el('line',{'class':'tick',x1:tx,x2:tx,y1:TOP,y2:H-AXIS},bands);
    el('text',{'class':'axis label',x:tx,y:H-6,'text-anchor':tx-half<0?'start':tx+half>W?'end':'middle'},text,lab);}
  // Segments and breaks, behind everything; their names only where they fit.
  var lastSeg=-1e9;
  m.segments.forEach(function(s){var x0=x(s.s),w=Math.max(x(s.e)-x0,2);
    tip(el('rect',{'class':'segment',x:x0,y:4,width:w,height:TOP-4+ROW*nl},bands),s.t+': '+fmt(s.s)+' – '+fmt(s.e));
    var lw=tw(s.t,SFONT);if(x0+3>=lastSeg+6&&x0+3+lw<=W){el('text',{'class':'segment-label label',x:x0+3,y:16},text,s.t);lastSeg=x0+3+lw;}});
  var lastBrk=-1e9;
  m.breaks.forEach(function(b){var x0=x(b.s),w=Math.max(b.d*sx,4);
    tip(el('rect',{'class':'break',fill:'url(#hatch'+m.gi+')',x:x0,y:4,width:w,height:TOP-4+ROW*nl},bands),b.h);
    var lw=tw(b.t,SFONT);if(x0+2>=lastBrk+6&&x0+2+lw<=W){el('text',{'class':'break-label label',x:x0+2,y:TOP+ROW*nl+12},text,b.t);lastBrk=x0+2+lw;}});
  var defs=el('defs',{},svg);
  var pat=el('pattern',{id:'hatch'+m.gi,width:6,height:6,patternUnits:'userSpaceOnUse',patternTransform:'rotate(45)'},defs);
  el('rect',{width:6,height:6,fill:'#fbe3e0'},pat);el('line',{x1:0,y1:0,x2:0,y2:6,stroke:'#e8a9a1','stroke-width':3},pat);
  var mk=el('marker',{id:'arrow'+m.gi,viewBox:'0 0 10 10',refX:9,refY:5,markerWidth:6,markerHeight:6,orient:'auto'},defs);
  el('path',{d:'M0,0 L10,5 L0,10 z',fill:'#555'},mk);
  // Rows, kernels and their labels.
  var lastLabel=[];
  for(var li=0;li<nl;li++){
    var g=el('g',{'class':'lane-row','data-lane':li,'data-lane-name':m.lanes[li]},rows);
    el('rect',{'class':'lane-bg',x:0,y:rowTop(li)+2,width:W,height:ROW-4},g);
    el('text',{'class':'lane-label label',x:6,y:rowTop(li)+STRIP+BOX/2+6},left,'s'+li+' '+m.lanes[li]);
    lastLabel.push(-1e9);
  }
  m.kernels.forEach(function(k){
    var x0=x(k.s),w=Math.max(k.d*sx,1),y0=rowTop(k.l)+STRIP+2;
    var color=k.c.indexOf('brk')>=0?'#7f8c8d':COLORS[k.l%COLORS.length];
    tip(el('rect',{'class':k.c,x:x0,y:y0,width:w,height:BOX,fill:color},boxes),k.h);
    var label=fit(k.t,KFONT,w);
    if(label&&x0+3>=lastLabel[k.l]+2){el('text',{'class':'kernel-text label',x:x0+3,y:y0+BOX/2+4},text,label);lastLabel[k.l]=x0+3+tw(label,KFONT);}
  });
  // Records, waits and releases in a strip above the boxes; markers closer than 9 px merge.
  var pos=[], groups=[];
  m.marks.forEach(function(mk,i){pos.push({i:i,l:mk.l,x:x(mk.x)});});
  pos.sort(function(a,b){return a.l-b.l||a.x-b.x;});
  pos.forEach(function(p){var last=groups.length?groups[groups.length-1]:null;
    if(last&&last.l===p.l&&p.x-last.right<9){last.items.push(p.i);last.right=p.x;}else{groups.push({l:p.l,x:p.x,right:p.x,items:[p.i]});}});
  var at={};
  groups.forEach(function(gr){
    var cy=rowTop(gr.l)+STRIP/2+2, cx=(gr.x+gr.right)/2;
    gr.items.forEach(function(i){at[i]={x:cx,y:cy};});
    if(gr.items.length===1){var mk=m.marks[gr.items[0]],e;
      if(mk.k==='record'){e=el('circle',{'class':'record',cx:cx,cy:cy,r:3.5},marksG);}
      else if(mk.k==='wait'){e=el('path',{'class':'wait',d:'M'+(cx-4)+','+(cy-4)+' L'+(cx+4)+','+(cy-4)+' L'+cx+','+(cy+3)+' z'},marksG);e.setAttribute('data-wait',mk.w);}
      else{e=el('path',{'class':'release',d:'M'+(cx-3)+','+(cy-3)+' L'+(cx+3)+','+(cy+3)+' M'+(cx-3)+','+(cy+3)+' L'+(cx+3)+','+(cy-3)},marksG);}
      tip(e,mk.h);}
    else{var n=String(gr.items.length),w=Math.max(gr.right-gr.x,0)+tw(n,'9px sans-serif')+8;
      var r=tip(el('rect',{'class':'cluster',x:cx-w/2,y:cy-5,width:w,height:10,rx:5},marksG),
        gr.items.length+' markers:\n'+gr.items.map(function(i){return m.marks[i].h.split('\n')[0];}).join('\n'));
      gr.items.forEach(function(i){if(m.marks[i].w){r.setAttribute('data-wait',m.marks[i].w);}});
      el('text',{'class':'cluster-text',x:cx,y:cy+3,'text-anchor':'middle'},marksG,n);}
  });
  // Event arrows beneath the boxes and labels: they never cross a label.
  m.edges.forEach(function(e){var a=at[e.a],b=at[e.b];if(!a||!b){return;}var mid=(a.y+b.y)/2;
    var p=el('path',{'class':'edge '+e.r,'data-wait':e.w,'marker-end':'url(#arrow'+m.gi+')',
      d:'M'+a.x+','+a.y+' C'+a.x+','+mid+' '+b.x+','+mid+' '+b.x+','+(b.y-4)},edgesG);tip(p,e.h);});
  box.querySelector('.zoom-level').textContent='×'+(Math.round(zoom*10)/10);
  hover(box);
}

function hover(root){
  root.querySelectorAll('[data-wait]').forEach(function(e){
    var key=e.getAttribute('data-wait');
    function mark(on){document.querySelectorAll('[data-wait="'+key+'"]').forEach(function(x){x.classList.toggle('hl',on);});}
    e.addEventListener('mouseenter',function(){mark(true);});e.addEventListener('mouseleave',function(){mark(false);});
  });
}

function setZoom(box,z){
  var sc=box.querySelector('.scroller'), old=box._zoom||1, centre=(sc.scrollLeft+sc.clientWidth/2)/Math.max(sc.scrollWidth,1);
  box._zoom=Math.min(512,Math.max(1,z));
  draw(box);
  sc.scrollLeft=centre*sc.scrollWidth-sc.clientWidth/2;
  if(old!==box._zoom){box.setAttribute('data-zoom',String(box._zoom));}
}

var boxes=[].slice.call(document.querySelectorAll('.timeline-box'));
// A link may open the page zoomed in: page.html#zoom=4.
var start=/zoom=([0-9.]+)/.exec(location.hash||'');
boxes.forEach(function(box){
  box._model=JSON.parse(box.querySelector('.schedule-model').textContent);
  box._zoom=start?Math.min(512,Math.max(1,parseFloat(start[1])||1)):1;
  box.querySelectorAll('[data-zoom]').forEach(function(b){b.addEventListener('click',function(){
    var how=b.getAttribute('data-zoom');setZoom(box,how==='in'?box._zoom*2:how==='out'?box._zoom/2:1);});});
  box.querySelector('.scroller').addEventListener('wheel',function(ev){if(!ev.ctrlKey){return;}ev.preventDefault();
    setZoom(box,box._zoom*(ev.deltaY<0?1.25:0.8));},{passive:false});
  draw(box);
});
// Once every timeline is in, the page's height (and so a scroll bar) is known: fit again.
boxes.forEach(draw);
document.querySelectorAll('tr[data-wait]').forEach(function(r){hover(r.parentNode);});
var pending=false;
window.addEventListener('resize',function(){if(pending){return;}pending=true;
  requestAnimationFrame(function(){pending=false;boxes.forEach(draw);report();});});

// What was drawn, for the browser tests: rows, labels, overlaps between labels, overflow.
function report(){
  var doc=document.documentElement, labels=[].slice.call(document.querySelectorAll('text.label'));
  var rects=labels.map(function(l){return l.getBoundingClientRect();}), overlaps=0;
  for(var i=0;i<rects.length;i++){for(var j=i+1;j<rects.length;j++){var a=rects[i],b=rects[j];
    if(a.width&&b.width&&a.left<b.right-0.5&&b.left<a.right-0.5&&a.top<b.bottom-0.5&&b.top<a.bottom-0.5){overlaps++;}}}
  doc.setAttribute('data-lane-rows',String(document.querySelectorAll('.lane-row').length));
  doc.setAttribute('data-labels',String(document.querySelectorAll('.kernel-text').length));
  doc.setAttribute('data-label-overlaps',String(overlaps));
  doc.setAttribute('data-overflow',String(doc.scrollWidth>doc.clientWidth?1:0));
  if(boxes.length){var sc=boxes[0].querySelector('.scroller'),r=sc.getBoundingClientRect(),
    ys=[].slice.call(boxes[0].querySelectorAll('.lane-row')).map(function(g){var b=g.querySelector('.lane-bg').getBoundingClientRect();return Math.round(b.top+window.scrollY+STRIP+BOX/2);});
    doc.setAttribute('data-rows',ys.join(','));
    doc.setAttribute('data-plot',Math.round(r.left)+','+Math.round(r.right)+','+(sc.scrollWidth>sc.clientWidth+1?1:0));}
  doc.setAttribute('data-ready','1');
}
report();
})();
"""
)


def render_html(root: str) -> str:
    """The self-contained HTML page of every graph under a dump directory."""
    return render(root)[0]


def write_html(root: str, path: str) -> dict[str, str]:
    """Writes :func:`render_html` of ``root`` to ``path``; returns, per graph, whether its times
    are measured or estimated (as ``render_trace``'s ``otherData.graphs``: see :func:`times_note`)."""
    page, which = render(root)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return which
