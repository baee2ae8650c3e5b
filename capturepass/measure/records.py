"""The profiler's records, their attribution to graphs, lanes, regions and nodes, and per-lane
summaries of the measurements made from them.

Plain functions over plain records (no GPU needed): see :mod:`capturepass.measure`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

PREFIX = "capturepass.trace/"
FORMAT = "capturepass-measured/1"  # the measurement documents build_measurements makes
# Profiler timestamps are microseconds with nanosecond digits; two kernels of one lane
# closer than this are not counted as overlapping.
_EPS_US = 0.002

_DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_RANGE_CATS = ("cpu_op", "user_annotation")
_GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


# -- plain records ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activity:
    """One GPU activity (a kernel, a memcpy or a memset) as the profiler recorded it.

    Attributes:
        name: the kernel's (demangled) name, or ``Memcpy ...`` / ``Memset ...``.
        stream: the profiler's (CUPTI's) stream id.
        start: start in microseconds, on the profiler's clock.
        dur: duration in microseconds.
        launch: when its launch call ran on the host (same clock), if known.
        via_graph: launched by a CUDA graph replay (its launch is a ``cudaGraphLaunch``).
        device: the CUDA device index.
        kind: ``"kernel"``, ``"memcpy"`` or ``"memset"``.
    """

    name: str
    stream: int
    start: float
    dur: float
    launch: float | None = None
    via_graph: bool = False
    device: int = 0
    kind: str = "kernel"

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclasses.dataclass(frozen=True)
class HostRange:
    """A host range of the profiled thread: a ``record_function`` range or an operator."""

    name: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """One compiled region: its lane, whether it is a break, and its graph nodes (names and ops)."""

    index: int
    lane: int
    eager: bool
    nodes: tuple[str, ...]
    ops: tuple[str, ...]


@dataclasses.dataclass
class GraphSpec:
    """What the measurement needs to know about one compiled graph.

    Attributes:
        key: its number in the trace session (``capturepass.trace/graph:<key>``).
        name: its name (the dump folder's, e.g. ``000_inference``, when it was dumped).
        kind: ``inference``, ``forward`` or ``backward``.
        lanes: lane names, by index.
        regions: its regions, by index.
        replayed: whether the measured runs replay CUDA graphs.
        dump_dir: its dump folder, if any.
        graph_sha256: the digest of its ``graph.json``, if dumped.
        owner: its graph owner as the dump prints it (``g3``); the runtime owners that ran
            its calls (``g3.m0.c0``, ...) are named after it.
    """

    key: int
    name: str
    kind: str
    lanes: list[str]
    regions: dict[int, RegionInfo]
    replayed: bool
    dump_dir: str | None = None
    graph_sha256: str | None = None
    owner: str | None = None


def records_from_chrome_trace(doc: dict[str, Any]) -> tuple[list[Activity], list[HostRange]]:
    """The GPU activities and host ranges of a Chrome trace that ``torch.profiler`` exported.

    Each activity's launch time is the runtime or driver call with its correlation id; failing
    that, the host operator its ``External id`` names. Host ranges are those of the thread that
    ran the ``capturepass.trace/session`` range when there is one (else every thread's).
    """
    events = [e for e in doc.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    launches: dict[int, tuple[float, str]] = {}
    external: dict[int, float] = {}
    session_tid = None
    for e in events:
        cat, args = e.get("cat"), e.get("args") or {}
        if cat in _LAUNCH_CATS and "correlation" in args:
            launches[int(args["correlation"])] = (float(e["ts"]), str(e.get("name", "")))
        elif cat in _RANGE_CATS:
            if "External id" in args:
                external.setdefault(int(args["External id"]), float(e["ts"]))
            if e.get("name") == PREFIX + "session":
                session_tid = e.get("tid")
    activities: list[Activity] = []
    ranges: list[HostRange] = []
    for e in events:
        cat, args = e.get("cat"), e.get("args") or {}
        if cat in _DEVICE_CATS:
            launch, via_graph = None, False
            hit = launches.get(int(args.get("correlation", -1)))
            if hit is not None:
                launch = hit[0]
                via_graph = hit[1].startswith(_GRAPH_LAUNCH)
            elif "External id" in args:
                launch = external.get(int(args["External id"]))
            activities.append(Activity(
                name=str(e.get("name", "")), stream=int(args.get("stream", e.get("tid", -1))),
                start=float(e["ts"]), dur=float(e.get("dur", 0.0)), launch=launch, via_graph=via_graph,
                device=int(args.get("device", e.get("pid", 0)) or 0), kind=_DEVICE_CATS[cat],
            ))
        elif cat in _RANGE_CATS and (session_tid is None or e.get("tid") == session_tid):
            ts = float(e["ts"])
            ranges.append(HostRange(str(e.get("name", "")), ts, ts + float(e.get("dur", 0.0))))
    return activities, ranges


# -- attribution --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tags:
    phase: tuple | None = None  # ("run", r) | ("reference",) | ("marker", device, graph, lane)
    graph: int | None = None
    owner: str | None = None  # the runtime owner whose run launched it (g3.m0.c0)
    region: int | None = None
    ops: list[HostRange] = dataclasses.field(default_factory=list)  # host operators around the launch, outer first

    @property
    def op(self) -> str | None:
        return self.ops[-1].name if self.ops else None


def _tag(activities: Sequence[Activity], ranges: Sequence[HostRange]) -> list[_Tags]:
    """For each activity, the capturepass ranges and the innermost operator enclosing its launch."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i].start, -ranges[i].end))
    acts = sorted((a.launch, i) for i, a in enumerate(activities) if a.launch is not None)
    tags = [_Tags() for _ in activities]
    stack: list[HostRange] = []
    k = 0
    for t, i in acts:
        while k < len(order) and ranges[order[k]].start <= t:
            r = ranges[order[k]]
            while stack and stack[-1].end < r.start:
                stack.pop()
            stack.append(r)
            k += 1
        enclosing = [r for r in stack if r.start <= t <= r.end]
        tag = tags[i]
        for r in enclosing:  # outermost first: inner ranges overwrite
            name = r.name
            if not name.startswith(PREFIX):
                tag.ops.append(r)
                continue
            tag.ops = []  # only the operators inside the innermost capturepass range count
            what = name[len(PREFIX):]
            try:
                if what.startswith("run:"):
                    tag.phase = ("run", int(what[4:]))
                elif what == "reference":
                    tag.phase = ("reference",)
                elif what.startswith("marker:"):
                    dev, graph, lane = what[7:].split(":")
                    tag.phase = ("marker", int(dev), None if graph == "*" else int(graph), int(lane))
                elif what.startswith("graph:"):
                    tag.graph = int(what[6:])
                    tag.owner = None
                    tag.region = None
                elif what.startswith("owner:"):
                    tag.owner = what[6:]
                elif what.startswith("region:"):
                    tag.region = int(what[7:])
            except ValueError:
                continue  # a range of another capturepass version: ignore it
    return tags


def match_lanes(
    items: Sequence[tuple[str, float, float]], reference: dict[int, Sequence[str]], max_states: int = 4096
) -> list[int] | None:
    """Lanes for the kernels of a CUDA graph replay, from an uncaptured run's per-lane sequences.

    Args:
        items: the replay's kernels as ``(name, start, end)``.
        reference: per lane, the names of the kernels the uncaptured run ran on it, in order.
        max_states: the most partial assignments kept per step.

    Returns:
        the lane of each item (in the order given), or ``None`` when the items, in start order,
        are no interleaving of the reference sequences. Among interleavings it prefers the one
        with the least time during which two kernels of one lane overlap (a lane runs its
        kernels one after another).
    """
    lanes = sorted(reference)
    seqs = [list(reference[lane]) for lane in lanes]
    if len(items) != sum(len(s) for s in seqs):
        return None
    if not items:
        return []
    order = sorted(range(len(items)), key=lambda i: (items[i][1], items[i][2]))
    n_lanes = len(lanes)
    start = tuple([0] * n_lanes)
    layer: dict[tuple[int, ...], tuple[float, tuple[float, ...]]] = {start: (0.0, tuple([-math.inf] * n_lanes))}
    back: list[dict[tuple[int, ...], tuple[tuple[int, ...], int]]] = []
    for i in order:
        name, s, e = items[i]
        nxt: dict[tuple[int, ...], tuple[float, tuple[float, ...]]] = {}
        step: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        for pos, (cost, ends) in layer.items():
            for j in range(n_lanes):
                p = pos[j]
                if p >= len(seqs[j]) or seqs[j][p] != name:
                    continue
                c = cost + max(0.0, ends[j] - s - _EPS_US)
                npos = pos[:j] + (p + 1,) + pos[j + 1:]
                if npos not in nxt or c < nxt[npos][0]:
                    nxt[npos] = (c, ends[:j] + (max(ends[j], e),) + ends[j + 1:])
                    step[npos] = (pos, j)
        if not nxt:
            return None
        if len(nxt) > max_states:
            keep = sorted(nxt, key=lambda k: nxt[k][0])[:max_states]
            nxt = {k: nxt[k] for k in keep}
        back.append(step)
        layer = nxt
    state = tuple(len(s) for s in seqs)
    if state not in layer:
        return None
    out: list[int] = [0] * len(items)
    for k in range(len(order) - 1, -1, -1):
        prev, j = back[k][state]
        out[order[k]] = lanes[j]
        state = prev
    return out


def _aten_node(region: RegionInfo, ops: Sequence[HostRange], seen: dict) -> str | None:
    """The node of ``region`` whose ATen op launched a kernel inside host operators ``ops`` (outer first).

    The innermost ATen operator that is one of the region's ops names it: the kernels launched
    by the k-th call of ``aten::mm`` in the region belong to its k-th ``aten.mm`` node (one call
    may launch several kernels: a GEMM and its split-K reduction). ``seen`` keeps the calls met
    so far (one dict per run).
    """
    for op in reversed(ops):
        if not op.name.startswith("aten::"):
            continue
        want = "aten." + op.name[len("aten::"):]
        matches = [n for n, o in zip(region.nodes, region.ops) if o == want or o.startswith(want + ".")]
        if matches:
            calls = seen.setdefault((region.index, op.name), [])
            if op.start not in calls:
                calls.append(op.start)
            return matches[min(calls.index(op.start), len(matches) - 1)]
    return None


def _label_nodes(entries: Sequence[tuple[RegionInfo | None, Sequence[HostRange]]]) -> list[list[str]]:
    """The graph nodes of each kernel of one run, given its region and host operators, in launch order.

    A kernel that an ATen operator of its region launched gets that one node; any other kernel
    (an Inductor kernel, say) gets the region's nodes that no ATen kernel claimed (all of them
    when every node was claimed); a kernel outside any region, none.
    """
    seen: dict = {}
    matched = [(_aten_node(region, ops, seen) if region is not None else None) for region, ops in entries]
    claimed: dict[int, set[str]] = defaultdict(set)
    for (region, _), node in zip(entries, matched):
        if region is not None and node is not None:
            claimed[region.index].add(node)
    out = []
    for (region, _), node in zip(entries, matched):
        if region is None:
            out.append([])
        elif node is not None:
            out.append([node])
        else:
            out.append([n for n in region.nodes if n not in claimed[region.index]] or list(region.nodes))
    return out


def _kernel(a: Activity, lane: int | None, run: int, region: int | None, nodes: list[str], op: str | None,
            origin: float, owner: str | None = None) -> dict[str, Any]:
    return {
        "name": a.name, "kind": a.kind, "lane": lane, "stream": a.stream, "run": run,
        "start": round(a.start - origin, 3), "dur": round(a.dur, 3), "region": region, "nodes": nodes,
        "op": op, "graph_kernel": a.via_graph, "owner": owner,
    }


def build_measurements(
    activities: Sequence[Activity],
    ranges: Sequence[HostRange],
    graphs: Sequence[GraphSpec],
    info: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Turns one trace session's records into one measurement per graph.

    Args:
        activities / ranges: the session's records (:func:`records_from_chrome_trace`).
        graphs: the compiled graphs the session ran.
        info: what to record about the session (device, torch version, ...).

    Returns:
        ``(measurements, session)``: a :data:`FORMAT` document per graph (see
        :func:`measurement_events` and :func:`summarize_measurement`), and the session's
        summary (runs, the activities outside any capturepass graph, notes).
    """
    info = dict(info or {})
    tags = _tag(activities, ranges)
    # Streams -> lanes, from the markers.
    main_stream: dict[int, int] = {}
    lane_streams: dict[int, dict[tuple[int, int], int]] = defaultdict(dict)
    for a, t in zip(activities, tags):
        if t.phase and t.phase[0] == "marker":
            _, dev, graph, lane = t.phase
            if graph is None:
                main_stream[dev] = a.stream
            else:
                lane_streams[graph][(dev, a.stream)] = lane

    def stream_lane(graph: int, a: Activity) -> int | None:
        lane = lane_streams[graph].get((a.device, a.stream))
        if lane is not None:
            return lane
        return 0 if main_stream.get(a.device) == a.stream else None

    measured = [(a, t) for a, t in zip(activities, tags) if t.phase and t.phase[0] == "run"]
    runs = sorted({t.phase[1] for _, t in measured})
    origin = min((a.start for a, _ in measured), default=0.0)
    notes: list[str] = []

    # The uncaptured run: per graph and lane, the kernels that a replay runs from its graphs.
    reference: dict[int, dict[int, list[tuple[str, int | None, list[str], str | None]]]] = {}
    ref_bad: set[int] = set()
    for g in graphs:
        mine = sorted(((a, t) for a, t in zip(activities, tags) if t.phase == ("reference",) and t.graph == g.key),
                      key=lambda at: (at[0].launch or 0.0, at[0].start))
        regions = [g.regions.get(t.region) if t.region is not None else None for _, t in mine]
        for (a, t), region, nodes in zip(mine, regions, _label_nodes([(rg, t.ops) for rg, (_, t) in zip(regions, mine)])):
            if region is not None and region.eager:
                continue  # a break runs eagerly in a replay too: not a graph kernel
            lane = stream_lane(g.key, a)
            if lane is None:
                ref_bad.add(g.key)
                continue
            reference.setdefault(g.key, {}).setdefault(lane, []).append((a.name, t.region, nodes, t.op))

    measurements = []
    outside: list[dict[str, Any]] = []
    for g in graphs:
        kernels: list[dict[str, Any]] = []
        unmatched_runs = 0
        for r in runs:
            mine = sorted(((a, t) for a, t in measured if t.phase[1] == r and t.graph == g.key),
                          key=lambda at: at[0].start)
            replayed = [(a, t) for a, t in mine if a.via_graph]
            direct = sorted(((a, t) for a, t in mine if not a.via_graph), key=lambda at: (at[0].launch or 0.0, at[0].start))
            regions = [g.regions.get(t.region) if t.region is not None else None for _, t in direct]
            for (a, t), nodes in zip(direct, _label_nodes([(rg, t.ops) for rg, (_, t) in zip(regions, direct)])):
                kernels.append(_kernel(a, stream_lane(g.key, a), r, t.region, nodes, t.op, origin, t.owner))
            if not replayed:
                continue
            ref = reference.get(g.key, {})
            lanes = None
            if ref and g.key not in ref_bad:
                lanes = match_lanes([(a.name, a.start, a.end) for a, _ in replayed],
                                    {lane: [k[0] for k in seq] for lane, seq in ref.items()})
            if lanes is None:
                unmatched_runs += 1
                for a, t in replayed:
                    kernels.append(_kernel(a, None, r, None, [], t.op, origin, t.owner))
                continue
            # Walk the replay in start order (as match_lanes did) to hand out each lane's entries.
            pos: Counter = Counter()
            order = sorted(range(len(replayed)), key=lambda i: (replayed[i][0].start, replayed[i][0].end))
            for i in order:
                a, t = replayed[i]
                lane = lanes[i]
                _, region, nodes, op = ref[lane][pos[lane]]
                pos[lane] += 1
                kernels.append(_kernel(a, lane, r, region, nodes, op, origin, t.owner))
        kernels.sort(key=lambda k: (k["run"], k["start"], k["lane"] if k["lane"] is not None else 1 << 30))
        spans = []
        for r in runs:
            ks = [k for k in kernels if k["run"] == r]
            if ks:
                spans.append({"run": r, "start": min(k["start"] for k in ks),
                              "end": round(max(k["start"] + k["dur"] for k in ks), 3)})
        if g.replayed:
            lanes_from = "kernel order, matched against an uncaptured run of the same program"
            if unmatched_runs:
                lanes_from += (f"; in {unmatched_runs} of {len(runs)} run(s) the replay's kernels did not match it, "
                               "their lanes are unknown")
                notes.append(f"graph {g.name}: the kernels of {unmatched_runs} replay(s) could not be matched to lanes "
                             "(trace(..., uncaptured=True) measures the program on the lanes' own streams)")
            elif g.key in ref_bad or g.key not in reference:
                lanes_from = "unknown (no usable uncaptured run)"
        else:
            lanes_from = "the stream each kernel ran on"
        if g.replayed and not any(k["graph_kernel"] for k in kernels):
            notes.append(f"graph {g.name}: the profiler recorded no kernel of a CUDA graph replay")
        m = {
            "format": FORMAT,
            "graph": g.name,
            "owner": g.owner,
            "owners": sorted({k["owner"] for k in kernels if k["owner"]}),
            "kind": g.kind,
            "graph_sha256": g.graph_sha256,
            "lanes": list(g.lanes),
            "mode": "replay" if g.replayed else "uncaptured",
            "lanes_from": lanes_from,
            "runs": len(runs),
            "spans": spans,
            "kernels": kernels,
            "regions": [dataclasses.asdict(rg) for _, rg in sorted(g.regions.items())],
            **{k: v for k, v in info.items() if k not in ("format", "graph", "kernels")},
        }
        m["summary"] = summarize_measurement(m)
        measurements.append(m)
    for a, t in measured:
        if t.graph is None:
            outside.append(_kernel(a, None, t.phase[1], None, [], t.op, origin))
    unattributed = sum(1 for a, t in zip(activities, tags) if t.phase is None)
    if unattributed:
        notes.append(f"{unattributed} GPU activit{'y' if unattributed == 1 else 'ies'} of the session had no launch "
                     "inside a measured run (no launch record, or launched by another thread): left out")
    session = {
        "runs": len(runs),
        "outside": sorted(outside, key=lambda k: (k["run"], k["start"])),
        "unattributed": unattributed,
        "notes": notes,
        **info,
    }
    return measurements, session


# -- summary ------------------------------------------------------------------------------------


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def interval_length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _two_or_more(unions: list[list[tuple[float, float]]]) -> float:
    points = sorted([(s, 1) for u in unions for s, _ in u] + [(e, -1) for u in unions for _, e in u],
                    key=lambda p: (p[0], p[1]))
    total, depth, last = 0.0, 0, 0.0
    for t, d in points:
        if depth >= 2:
            total += t - last
        depth += d
        last = t
    return total


def summarize_measurement(m: dict[str, Any]) -> dict[str, Any]:
    """Per run (averaged over runs): each lane's kernels and busy time, the overlap between lanes, the span.

    Busy time is the union of a lane's kernel intervals; ``overlap_us`` is the time at least two
    lanes are busy, ``pairs`` the time each two lanes are both busy. Kernels without a lane are
    counted under ``unmatched``. Where several runtime owners ran the graph (two models of one
    class: ``g3.m0.c0`` and ``g3.m1.c0``), each owner's lanes are its own streams: unions and
    overlaps are taken per owner and added up, and ``owners`` gives each owner's kernels and
    busy time (the union over its lanes). ``span_us`` runs from the graph's first kernel to its last
    (with a replay: the input copy before the CUDA graph launch, the output copy after it);
    ``graph_span_us`` covers the kernels of the CUDA graph replays alone (``None`` without any).
    """
    runs = max(1, int(m.get("runs") or 0))
    lanes = list(m.get("lanes") or [])
    per_lane: dict[int, dict[str, float]] = {i: {"kernels": 0.0, "busy_us": 0.0} for i in range(len(lanes))}
    unmatched = {"kernels": 0.0, "busy_us": 0.0}
    overlap = 0.0
    pairs: dict[str, float] = {}
    by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
    by_owner: dict[tuple[int, Any], list[dict[str, Any]]] = defaultdict(list)
    owners: dict[str, dict[str, float]] = {}
    for k in m.get("kernels", []):
        by_run[k["run"]].append(k)
        by_owner[(k["run"], k.get("owner"))].append(k)
    for (_, owner), ks in by_owner.items():
        if owner:
            o = owners.setdefault(owner, {"kernels": 0.0, "busy_us": 0.0})
            o["kernels"] += len(ks)
            o["busy_us"] += interval_length(interval_union((k["start"], k["start"] + k["dur"]) for k in ks))
    for ks in by_owner.values():
        unions = []
        for i in range(len(lanes)):
            mine = [(k["start"], k["start"] + k["dur"]) for k in ks if k["lane"] == i]
            u = interval_union(mine)
            unions.append(u)
            per_lane[i]["kernels"] += len(mine)
            per_lane[i]["busy_us"] += interval_length(u)
        rest = [(k["start"], k["start"] + k["dur"]) for k in ks if k["lane"] is None or k["lane"] >= len(lanes)]
        unmatched["kernels"] += len(rest)
        unmatched["busy_us"] += interval_length(interval_union(rest))
        overlap += _two_or_more(unions)
        for i in range(len(lanes)):
            for j in range(i + 1, len(lanes)):
                key = f"s{i}&s{j}"
                pairs[key] = pairs.get(key, 0.0) + _intersect(unions[i], unions[j])
    spans = [s["end"] - s["start"] for s in m.get("spans", [])]
    graph_spans = []
    for ks in by_run.values():
        gk = [(k["start"], k["start"] + k["dur"]) for k in ks if k.get("graph_kernel")]
        if gk:
            graph_spans.append(max(e for _, e in gk) - min(s for s, _ in gk))

    def avg(x: float) -> float:
        return round(x / runs, 3)

    return {
        "runs": int(m.get("runs") or 0),
        "span_us": round(sum(spans) / len(spans), 3) if spans else 0.0,
        "graph_span_us": round(sum(graph_spans) / len(graph_spans), 3) if graph_spans else None,
        "lanes": {f"s{i}": {"name": lanes[i], "kernels": avg(v["kernels"]), "busy_us": avg(v["busy_us"])}
                  for i, v in per_lane.items()},
        "unmatched": {"kernels": avg(unmatched["kernels"]), "busy_us": avg(unmatched["busy_us"])},
        "overlap_us": avg(overlap),
        "pairs": {k: avg(v) for k, v in pairs.items()},
        "owners": {name: {"kernels": avg(v["kernels"]), "busy_us": avg(v["busy_us"])}
                   for name, v in sorted(owners.items())},
    }


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def format_measurement(m: dict[str, Any]) -> str:
    """The human-readable summary of one measurement."""
    s = m.get("summary") or summarize_measurement(m)
    owner = f"owner {m['owner']}, " if m.get("owner") else ""
    lines = [f"graph {m['graph']} ({owner}{m.get('kind', '?')}, {m['mode']}, {s['runs']} run(s); lanes from "
             f"{m['lanes_from']}): span {s['span_us']:.1f} us per run"
             + (f" (CUDA graph kernels {s['graph_span_us']:.1f} us)" if s.get("graph_span_us") is not None else "")]
    for name, v in (s.get("owners") or {}).items():
        lines.append(f"  owner {name}: {_count(v['kernels'])} kernel(s), busy {v['busy_us']:.1f} us")
    for key, v in s["lanes"].items():
        lines.append(f"  {key} {v['name']}: {_count(v['kernels'])} kernel(s), busy {v['busy_us']:.1f} us")
    if s["unmatched"]["kernels"]:
        lines.append(f"  lane not matched: {_count(s['unmatched']['kernels'])} kernel(s), "
                     f"busy {s['unmatched']['busy_us']:.1f} us")
    pairs = ", ".join(f"{k} {v:.1f} us" for k, v in s["pairs"].items())
    lines.append(f"  overlap: two or more lanes busy {s['overlap_us']:.1f} us" + (f" ({pairs})" if pairs else ""))
    return "\n".join(lines)
