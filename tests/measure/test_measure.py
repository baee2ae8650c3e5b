"""Measured traces (``capturepass.trace``): records → lanes → nodes → Chrome trace, and ``show --trace``.

The CPU tests feed synthetic profiler records (what ``torch.profiler`` exports: GPU
activities with a stream and a correlation id, launch calls, host ranges) through the same
functions a GPU session uses: streams become lanes through the marker kernels, a CUDA graph
replay's kernels get their lanes by matching the uncaptured run, ATen kernels get their
node. The same functions then read a real session recorded on an H200
(``tests/data/h200_moe_profile.json.gz``: the MoE demo's profile, replayed and uncaptured,
trimmed to the fields they read). The instrumentation (a profiler range per compiled-graph
call and per region) is checked with the real CPU profiler. The ``gpu`` test records a real
measured run of the MoE block on CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading

import pytest
import torch

import capturepass
from capturepass import measure
from capturepass.show import cli, dumps, trace
from capturepass.backends.compile import last_compiled
from capturepass.measure import PREFIX, Activity, GraphSpec, HostRange, RegionInfo
from capturepass.testing.models import MoEBlock

# -- match_lanes --------------------------------------------------------------------------------


def test_match_lanes_distinct_names():
    items = [("a", 0, 1), ("x", 0.5, 2), ("b", 1, 2), ("y", 2, 3)]
    assert measure.match_lanes(items, {0: ["a", "b"], 1: ["x", "y"]}) == [0, 1, 0, 1]


def test_match_lanes_uses_time_to_resolve_equal_names():
    # Both lanes run "gemm"; lane 1's gemm starts while lane 0's first gemm still runs,
    # so it cannot be lane 0's second kernel.
    items = [("gemm", 0.0, 10.0), ("gemm", 2.0, 8.0), ("silu", 10.5, 11.0), ("add", 8.5, 9.0)]
    lanes = measure.match_lanes(items, {0: ["gemm", "silu"], 1: ["gemm", "add"]})
    assert lanes == [0, 1, 0, 1]


def test_match_lanes_backtracks_over_an_early_wrong_choice():
    # "k" could be lane 0's or lane 1's; only lane 1 can then take "z".
    items = [("k", 0, 1), ("k", 1, 2), ("z", 2, 3)]
    assert measure.match_lanes(items, {0: ["k"], 1: ["k", "z"]}) in ([0, 1, 1], [1, 0, 1])
    assert measure.match_lanes(items, {0: ["k"], 1: ["k", "z"]})[2] == 1


def test_match_lanes_gives_up_on_other_kernels():
    assert measure.match_lanes([("a", 0, 1), ("c", 1, 2)], {0: ["a"], 1: ["b"]}) is None
    assert measure.match_lanes([("a", 0, 1)], {0: ["a"], 1: ["b"]}) is None  # a kernel missing
    assert measure.match_lanes([], {}) == []


# -- a synthetic profiled session ---------------------------------------------------------------

MAIN, AUX1, AUX2 = 7, 21, 22  # the profiler's stream ids of lanes 0, 1, 2
REGIONS = {
    0: RegionInfo(0, 1, False, ("t_1", "mm_1"), ("aten.t.default", "aten.mm.default")),
    1: RegionInfo(1, 0, False, ("t", "mm", "silu"), ("aten.t.default", "aten.mm.default", "aten.silu.default")),
    2: RegionInfo(2, 2, False, ("mm_3", "mm_4"), ("aten.mm.default", "aten.mm.default")),
    3: RegionInfo(3, 0, False, ("add",), ("aten.add.Tensor",)),
}
# (region, host op, kernel name, duration) in program order; lanes come from the regions.
PROGRAM = [
    (0, "aten::mm", "gemm_a", 10.0),
    (1, "aten::mm", "gemm_a", 12.0),
    (1, "triton_poi_fused_silu_0", "silu_kernel", 2.0),  # an Inductor kernel: no ATen op of its own
    (2, "aten::mm", "gemm_b", 5.0),
    (2, "aten::mm", "gemm_b", 5.0),
    (3, "aten::add", "add_kernel", 1.0),
]
STREAM = {0: MAIN, 1: AUX1, 2: AUX2}


class _Recorder:
    """Builds the records of a session: host ranges on a clock, kernels on per-stream clocks."""

    def __init__(self) -> None:
        self.acts: list[Activity] = []
        self.ranges: list[HostRange] = []
        self.host = 0.0

    def range(self, name: str, body) -> None:
        start = self.host
        self.host += 0.1
        body()
        self.host += 0.1
        self.ranges.append(HostRange(name, start, self.host))

    def launch(self, name: str, stream: int, start: float, dur: float, via_graph: bool = False) -> None:
        self.host += 0.1
        self.acts.append(Activity(name, stream, start, dur, launch=self.host, via_graph=via_graph))
        self.host += 0.1


def _uncaptured_run(rec: _Recorder, gpu0: float, streams: dict[int, int] = STREAM) -> None:
    """The program on the lanes' streams: lane 0 waits for lanes 1 and 2 before its add."""
    clocks = {lane: gpu0 for lane in streams}
    for region, op, kernel, dur in PROGRAM:
        lane = REGIONS[region].lane
        if region == 3:
            clocks[0] = max(clocks.values())

        def body(region=region, op=op, kernel=kernel, dur=dur, lane=lane):
            def launch():
                rec.launch(kernel, streams[lane], clocks[lane], dur)
                clocks[lane] += dur
            rec.range(op, launch)

        rec.range(f"{PREFIX}region:{region}", body)


def _markers(rec: _Recorder) -> None:
    base = rec.acts[-1].end + 100
    rec.range(f"{PREFIX}marker:0:0:1", lambda: rec.launch("fill", AUX1, base, 1.0))
    rec.range(f"{PREFIX}marker:0:0:2", lambda: rec.launch("fill", AUX2, base + 2, 1.0))
    rec.range(f"{PREFIX}marker:0:*:0", lambda: rec.launch("fill", MAIN, base + 4, 1.0))


def _session(replay: bool, runs: int = 2, replay_program=PROGRAM) -> _Recorder:
    rec = _Recorder()

    def body():
        if replay:
            rec.range(f"{PREFIX}reference", lambda: rec.range(f"{PREFIX}graph:0", lambda: _uncaptured_run(rec, 0.0)))
        for r in range(runs):
            t0 = 1000.0 * (r + 1)

            def one(t0=t0):
                if not replay:
                    _uncaptured_run(rec, t0)
                    return
                # A replay: the input copy on lane 0, then the graph's kernels on streams of
                # the graph executor's choosing (one launch call), overlapping as on the lanes.
                rec.launch("copy_kernel", MAIN, t0, 0.5)
                clocks = {lane: t0 + 1 for lane in STREAM}
                launch_at = rec.host + 0.1
                for i, (region, _op, kernel, dur) in enumerate(replay_program):
                    lane = REGIONS[region].lane
                    if region == 3:
                        clocks[0] = max(clocks.values())
                    rec.acts.append(Activity(kernel, 100 + i, clocks[lane], dur, launch=launch_at, via_graph=True))
                    clocks[lane] += dur
                rec.host += 0.3

            rec.range(f"{PREFIX}run:{r}", lambda one=one: rec.range(f"{PREFIX}graph:0", one))
        _markers(rec)

    rec.range(f"{PREFIX}session", body)
    return rec


def _spec(replayed: bool) -> GraphSpec:
    return GraphSpec(key=0, name="000_inference", kind="inference", lanes=["main", "aux0", "aux1"],
                     regions=dict(REGIONS), replayed=replayed)


def test_uncaptured_session_maps_streams_to_lanes_and_kernels_to_nodes():
    rec = _session(replay=False)
    (m,), session = measure.build_measurements(rec.acts, rec.ranges, [_spec(False)], {"device": "test"})
    assert m["mode"] == "uncaptured" and m["runs"] == 2 and "stream" in m["lanes_from"]
    run0 = [k for k in m["kernels"] if k["run"] == 0]
    assert [(k["name"], k["lane"]) for k in sorted(run0, key=lambda k: (k["lane"], k["start"]))] == [
        ("gemm_a", 0), ("silu_kernel", 0), ("add_kernel", 0), ("gemm_a", 1), ("gemm_b", 2), ("gemm_b", 2)]
    nodes = {(k["region"], k["start"]): k["nodes"] for k in run0}
    # The Inductor kernel gets the nodes of its region that no ATen kernel claimed.
    assert sorted(map(tuple, nodes.values())) == [("add",), ("mm",), ("mm_1",), ("mm_3",), ("mm_4",), ("t", "silu")]
    assert session["outside"] == [] and session["unattributed"] == 0  # the markers are the calibration's
    s = m["summary"]
    assert s["lanes"]["s0"] == {"name": "main", "kernels": 3, "busy_us": 15.0}
    assert s["lanes"]["s1"]["busy_us"] == 10.0 and s["lanes"]["s2"]["busy_us"] == 10.0
    # gemm_a on s0 (0-12) runs beside gemm_a on s1 (0-10) and the gemm_b's on s2 (0-10).
    assert s["overlap_us"] == 10.0 and s["pairs"] == {"s0&s1": 10.0, "s0&s2": 10.0, "s1&s2": 10.0}
    assert s["span_us"] == 15.0 and s["graph_span_us"] is None
    assert [sp["end"] - sp["start"] for sp in m["spans"]] == [15.0, 15.0]


def test_replayed_kernels_get_their_lanes_from_the_uncaptured_run():
    rec = _session(replay=True)
    (m,), _ = measure.build_measurements(rec.acts, rec.ranges, [_spec(True)])
    assert m["mode"] == "replay" and "matched" in m["lanes_from"] and "unknown" not in m["lanes_from"]
    run1 = [k for k in m["kernels"] if k["run"] == 1]
    graph = [k for k in run1 if k["graph_kernel"]]
    assert len(graph) == len(PROGRAM)
    assert sorted((k["lane"], k["name"], tuple(k["nodes"])) for k in graph) == sorted([
        (0, "gemm_a", ("mm",)), (0, "silu_kernel", ("t", "silu")), (0, "add_kernel", ("add",)),
        (1, "gemm_a", ("mm_1",)), (2, "gemm_b", ("mm_3",)), (2, "gemm_b", ("mm_4",))])
    (copy,) = [k for k in run1 if not k["graph_kernel"]]
    assert copy["lane"] == 0 and copy["name"] == "copy_kernel"
    # Times are relative to the first measured kernel.
    assert min(k["start"] for k in m["kernels"]) == 0.0
    # The span covers the input copy; the graph's span its kernels (gemm_a 12 + silu 2 | add 1).
    assert m["summary"]["graph_span_us"] == 15.0 and m["summary"]["span_us"] == 16.0


def test_a_replay_that_ran_other_kernels_keeps_them_off_the_lanes():
    other = PROGRAM[:-1] + [(3, "aten::add", "fused_add_kernel", 1.0)]
    rec = _session(replay=True, runs=1, replay_program=other)
    (m,), session = measure.build_measurements(rec.acts, rec.ranges, [_spec(True)])
    graph = [k for k in m["kernels"] if k["graph_kernel"]]
    assert graph and all(k["lane"] is None for k in graph)
    assert "did not match" in m["lanes_from"] and session["notes"]
    assert m["summary"]["unmatched"]["kernels"] == len(other)
    doc = measure.trace_document([m], session)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert any("lane not matched" in n for n in names)


def test_trace_document_rows_spans_and_strict_json():
    rec = _session(replay=True)
    ms, session = measure.build_measurements(rec.acts, rec.ranges, [_spec(True)], {"device": "H", "torch": "t"})
    doc = measure.trace_document(ms, session)
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text) == doc
    ev = doc["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {0: "s0 main", 1: "s1 aux0", 2: "s2 aux1", measure.SPAN_TID: "measured span"}
    kernels = [e for e in ev if e["ph"] == "X" and e["cat"] == "kernel"]
    assert {e["tid"] for e in kernels} == {0, 1, 2} and all(e["dur"] > 0 for e in kernels)
    assert any(e["name"].startswith("%mm_1 · gemm_a") for e in kernels)
    spans = [e for e in ev if e["ph"] == "X" and e["tid"] == measure.SPAN_TID]
    assert [s["name"] for s in spans] == ["run 0", "run 1"]
    for s in spans:  # every kernel of a run lies inside its span
        mine = [e for e in kernels if e["args"]["run"] == int(s["name"][4:])]
        assert all(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-9 for e in mine)
    assert doc["otherData"]["times"] == "measured" and doc["otherData"]["device"] == "H"
    # One lane's kernels never overlap on its row.
    for tid in (0, 1, 2):
        for run in (0, 1):
            row = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if e["tid"] == tid and e["args"]["run"] == run)
            assert all(b[0] >= a[1] - 1e-9 for a, b in zip(row, row[1:]))


def test_summary_text():
    rec = _session(replay=False, runs=1)
    ms, session = measure.build_measurements(rec.acts, rec.ranges, [_spec(False)], {"device": "dev", "torch": "x"})
    text = measure.MeasuredTrace(measure.trace_document(ms, session), ms, session).summary()
    assert text.splitlines()[0] == "measured 1 run(s) on dev (torch x)"
    assert "  s1 aux0: 1 kernel(s), busy 10.0 us" in text
    assert "two or more lanes busy 10.0 us (s0&s1 10.0 us, s0&s2 10.0 us, s1&s2 10.0 us)" in text


def test_two_owners_of_one_graph_get_rows_and_summaries_of_their_own():
    """Two models of one class run one graph: its kernels carry their runtime owner's name (the
    owner ranges around each run), each owner gets its own rows, and overlaps stay per owner."""
    other = {0: MAIN, 1: 31, 2: 32}  # the second owner's own auxiliary streams
    rec = _Recorder()

    def body():
        def one():
            rec.range(f"{PREFIX}owner:g5.m0.eager", lambda: _uncaptured_run(rec, 1000.0))
            rec.range(f"{PREFIX}owner:g5.m1.eager", lambda: _uncaptured_run(rec, 1100.0, other))

        rec.range(f"{PREFIX}run:0", lambda: rec.range(f"{PREFIX}graph:0", one))
        _markers(rec)
        base = rec.acts[-1].end + 100
        rec.range(f"{PREFIX}marker:0:0:1", lambda: rec.launch("fill", 31, base, 1.0))
        rec.range(f"{PREFIX}marker:0:0:2", lambda: rec.launch("fill", 32, base + 2, 1.0))

    rec.range(f"{PREFIX}session", body)
    spec = dataclasses.replace(_spec(False), owner="g5")
    (m,), session = measure.build_measurements(rec.acts, rec.ranges, [spec])
    assert m["owner"] == "g5" and m["owners"] == ["g5.m0.eager", "g5.m1.eager"]
    assert [k["owner"] for k in m["kernels"]] == ["g5.m0.eager"] * 6 + ["g5.m1.eager"] * 6
    assert all(k["lane"] is not None for k in m["kernels"])
    s = m["summary"]
    # Each owner's program: busy 0-15 us over its lanes, two or more lanes busy 10 us; the two
    # programs run 100 us apart, and each lane's numbers add the two owners'.
    assert s["owners"] == {"g5.m0.eager": {"kernels": 6, "busy_us": 15.0},
                           "g5.m1.eager": {"kernels": 6, "busy_us": 15.0}}
    assert s["overlap_us"] == 20.0 and s["lanes"]["s0"] == {"name": "main", "kernels": 6, "busy_us": 30.0}
    text = measure.format_measurement(m)
    assert text.splitlines()[0].startswith("graph 000_inference (owner g5, inference, uncaptured, 1 run(s)")
    assert "  owner g5.m1.eager: 6 kernel(s), busy 15.0 us" in text
    doc = measure.trace_document([m], session)
    ev = doc["traceEvents"]
    (process,) = [e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"]
    assert process == "capturepass 000_inference · g5 (measured)"
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    kernels = [e for e in ev if e["ph"] == "X" and e["cat"] == "kernel"]
    for e in kernels:  # each kernel on a row of its own owner and lane
        assert threads[e["tid"]].endswith(f" · {e['args']['owner']}")
    assert {threads[e["tid"]] for e in kernels} == {
        f"s{lane} {name} · g5.m{i}.eager" for i in (0, 1) for lane, name in enumerate(["main", "aux0", "aux1"])}


# -- records from torch.profiler's Chrome trace --------------------------------------------------


def test_records_from_a_kineto_chrome_trace():
    doc = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": PREFIX + "session", "pid": 1, "tid": 5, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": PREFIX + "run:0", "pid": 1, "tid": 5, "ts": 1, "dur": 90,
         "args": {"External id": 2}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 5, "ts": 2, "dur": 5, "args": {"External id": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 9, "ts": 2, "dur": 5},  # another thread
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 5, "ts": 3, "dur": 1,
         "args": {"correlation": 40, "cbid": 211}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10.5, "dur": 4.25,
         "args": {"stream": 7, "correlation": 40, "device": 0, "External id": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 5, "ts": 20, "dur": 2,
         "args": {"correlation": 41}},
        {"ph": "X", "cat": "kernel", "name": "k_in_graph", "pid": 0, "tid": 33, "ts": 25, "dur": 1,
         "args": {"stream": 33, "correlation": 41, "device": 0}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 30, "dur": 0.5,
         "args": {"stream": 7, "correlation": 99, "device": 0, "External id": 2}},  # no runtime event: External id
        {"ph": "X", "cat": "gpu_user_annotation", "name": "x", "pid": 0, "tid": 7, "ts": 0, "dur": 1},
        {"ph": "s", "cat": "ac2g", "id": 40, "pid": 1, "tid": 5, "ts": 3},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ]}
    acts, ranges = measure.records_from_chrome_trace(doc)
    assert [(a.name, a.stream, a.start, a.dur, a.launch, a.via_graph, a.kind) for a in acts] == [
        ("gemm", 7, 10.5, 4.25, 3.0, False, "kernel"),
        ("k_in_graph", 33, 25.0, 1.0, 20.0, True, "kernel"),
        ("Memset (Device)", 7, 30.0, 0.5, 1.0, False, "memset"),
    ]
    assert [r.name for r in ranges] == [PREFIX + "session", PREFIX + "run:0", "aten::mm"]


def test_profiler_ranges_wrap_each_graph_call_and_region(tmp_path):
    """The instrumentation, through the real (CPU) profiler and its Chrome export."""
    torch.manual_seed(0)
    model = MoEBlock()
    x = torch.randn(16, 64)
    compiled = torch.compile(model, backend="capturepass", options={"inner": "eager", "dump_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(x)
        session = measure._Session(threading.get_ident())
        with measure._instrumented(session):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.profiler.record_function(PREFIX + "session"):
                    compiled(x)
    path = tmp_path / "profile.json"
    prof.export_chrome_trace(str(path))
    _, ranges = measure.records_from_chrome_trace(json.loads(path.read_text()))
    names = [r.name for r in ranges]
    (ex,) = session.executors
    assert names.count(PREFIX + "graph:0") == 1
    # The run of its owner, named as the dump's owner: model 0 of graph gN, uncaptured on the host.
    assert [n for n in names if n.startswith(PREFIX + "owner:")] == [f"{PREFIX}owner:{ex.graph_owner}.m0.eager"]
    assert sorted(n for n in names if n.startswith(PREFIX + "region:")) == sorted(
        f"{PREFIX}region:{r.index}" for r in ex.program.regions)
    spec = measure._graph_spec(0, ex, uncaptured=False)
    assert re.fullmatch(r"\d{3}_inference", spec.name) and spec.lanes == ["main", "aux0", "aux1"]
    assert spec.owner == ex.graph_owner == json.loads((tmp_path / spec.name / "graph.json").read_text())["owner"]
    assert spec.graph_sha256 == measure.graph_digest(str(tmp_path / spec.name / "graph.json"))
    assert any("mm" in r.ops[i] for r in spec.regions.values() for i in range(len(r.ops)))
    # The patch is gone afterwards.
    from capturepass.runtime.executor import Executor
    from capturepass.runtime.program import RegionCall
    assert Executor.__call__.__name__ == "__call__" and RegionCall.__call__.__name__ == "__call__"


def _h200(mode: str):
    """Records of a real session on an H200 (tests/data/h200_moe_profile.json.gz), and its graph spec."""
    import gzip

    with gzip.open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "h200_moe_profile.json.gz"), "rt") as f:
        data = json.load(f)
    g = data["graph"]
    regions = {r["index"]: RegionInfo(r["index"], r["lane"], r["eager"], tuple(r["nodes"]), tuple(r["ops"]))
               for r in g["regions"]}
    spec = GraphSpec(key=0, name=g["graph"], kind="inference", lanes=g["lanes"], regions=regions,
                     replayed=mode == "replay")
    acts, ranges = measure.records_from_chrome_trace(data[mode])
    return acts, ranges, spec, g


@pytest.mark.parametrize("mode", ["replay", "uncaptured"])
def test_a_real_h200_session(mode):
    """The MoE demo's profile on an H200: every kernel on a lane, the GEMMs labelled with their node."""
    acts, ranges, spec, g = _h200(mode)
    (m,), session = measure.build_measurements(acts, ranges, [spec])
    s = m["summary"]
    assert session["notes"] == [] and session["outside"] == [] and session["unattributed"] == 0
    assert m["runs"] == 5 and s["unmatched"]["kernels"] == 0
    # Lane 0 also runs the replay's input and output copies.
    assert {k: v["kernels"] for k, v in s["lanes"].items()} == (
        {"s0": 7, "s1": 1, "s2": 11} if mode == "replay" else {"s0": 5, "s1": 1, "s2": 11})
    if mode == "replay":
        assert sum(k["graph_kernel"] for k in m["kernels"]) == 17 * 5
        assert s["overlap_us"] > 20 and s["graph_span_us"] < s["span_us"]
        for key in ("lanes", "overlap_us", "pairs", "span_us", "graph_span_us"):
            assert s[key] == g["summary"][key]  # as the GPU run itself computed them
    else:
        assert not any(k["graph_kernel"] for k in m["kernels"]) and s["graph_span_us"] is None
    on_lane = {lane: {n for r in spec.regions.values() if r.lane == lane for n in r.nodes} for lane in range(3)}
    for k in m["kernels"]:
        assert set(k["nodes"]) <= on_lane[k["lane"]], k
    gemms = {(k["lane"], k["nodes"][0]) for k in m["kernels"] if k["op"] in ("aten::mm", "aten::bmm")}
    assert gemms == {(0, "mm"), (0, "mm_2"), (1, "mm_1"), (2, "mm_3"), (2, "bmm"), (2, "bmm_1")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_trace_without_cuda_raises_a_clear_error():
    with pytest.raises(measure.TraceError, match="needs a CUDA device"):
        capturepass.trace(lambda x: x, torch.ones(1))
    assert issubclass(measure.TraceError, capturepass.CapturePassError)


# -- capturepass show --trace: measured or estimated ---------------------------------------------


@pytest.fixture()
def cpu_dump(tmp_path):
    """A dump of the MoE block compiled on the CPU, and its one graph's name (``NNN_inference``)."""
    torch.manual_seed(0)
    model = MoEBlock()
    compiled = torch.compile(model, backend="capturepass", options={"inner": "eager", "dump_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(16, 64))
    ((name, _),) = dumps.load_graphs(str(tmp_path))
    return str(tmp_path), name


def _measurement_for(dump: str) -> dict:
    """A synthetic measurement of the dump's graph (as trace() would save it on a GPU)."""
    ((name, folder, graph),) = dumps.load_graph_dirs(dump)
    rec = _session(replay=False, runs=1)
    spec = GraphSpec(key=0, name=name, kind="inference", lanes=list(graph["lanes"]), regions=dict(REGIONS),
                     replayed=False, dump_dir=folder, graph_sha256=measure.graph_digest(os.path.join(folder, "graph.json")))
    (m,), _ = measure.build_measurements(rec.acts, rec.ranges, [spec], {"device": "NVIDIA Test", "torch": "2.x"})
    return m


def test_show_trace_writes_estimates_without_a_measured_run(cpu_dump, tmp_path, capsys):
    cpu_dump, name = cpu_dump
    out = tmp_path / "t.json"
    assert cli.main(["show", cpu_dump, "--trace", str(out)]) == 0
    stdout = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["otherData"]["times"] == "estimated (nominal device)"
    assert doc["otherData"]["graphs"] == {name: "estimated"}
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"trace {out}: cost-model estimates") and "capturepass.trace" in last


def test_show_trace_writes_the_measured_run_when_the_dump_has_one(cpu_dump, tmp_path, capsys):
    cpu_dump, name = cpu_dump
    m = _measurement_for(cpu_dump)
    folder = os.path.join(cpu_dump, name)
    measure.save_measurement(m, folder)
    out = tmp_path / "t.json"
    assert cli.main(["show", cpu_dump, "--trace", str(out)]) == 0
    stdout = capsys.readouterr().out
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["otherData"]["times"] == "measured" and doc["otherData"]["device"] == "NVIDIA Test"
    assert doc["otherData"]["graphs"][name].startswith("measured (uncaptured, 1 run(s)")
    assert f"measured times for {name}" in stdout.strip().splitlines()[-1]
    threads = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert threads[:3] == ["s0 main", "s1 aux0", "s2 aux1"] and "measured span" in threads
    kernels = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel"]
    assert len(kernels) == len(PROGRAM) and {e["tid"] for e in kernels} == {0, 1, 2}
    # --json keeps stdout pure JSON: the note goes to stderr.
    assert cli.main(["show", cpu_dump, "--json", "--trace", str(out)]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert "measured times" in captured.err
    # A single graph's folder works too; measured=False gives the estimates back.
    assert trace.render_trace(folder)["otherData"]["times"] == "measured"
    assert trace.render_trace(cpu_dump, measured=False)["otherData"]["times"].startswith("estimated")


def test_a_measurement_of_another_compile_is_not_shown(cpu_dump):
    cpu_dump, name = cpu_dump
    m = _measurement_for(cpu_dump)
    m["graph_sha256"] = "0" * 64
    measure.save_measurement(m, os.path.join(cpu_dump, name))
    doc = trace.render_trace(cpu_dump)
    assert doc["otherData"]["times"] == "estimated (nominal device)"
    assert "graph.json changed" in doc["otherData"]["graphs"][name]
    assert "graph.json changed" in trace.trace_note(doc)


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("uncaptured", [False, True], ids=["replay", "uncaptured"])
def test_measured_trace_of_the_moe_block_on_cuda(tmp_path, uncaptured, capsys):
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    dump = tmp_path / "dump"
    # The cost model's schedule: a measured choice could be a lane map, whose owner bears its name.
    compiled = torch.compile(model, backend="capturepass",
                             options={"dump_dir": str(dump), "verify": True, "pick": "model"})
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=3e-2, rtol=3e-2)
        result = capturepass.trace(compiled, x, runs=3, path=str(tmp_path / "trace.json"), uncaptured=uncaptured)
    print(result.summary())
    (m,) = result.measurements
    assert m["mode"] == ("uncaptured" if uncaptured else "replay")
    assert m["lanes"] == list(last_compiled()[-1].executor.program.info.lanes) and len(m["lanes"]) >= 2
    # Every measured kernel ran in one runtime owner, named after the graph owner the dump prints.
    owner = last_compiled()[-1].executor.graph_owner
    assert m["owner"] == owner and m["owners"] == [f"{owner}.m0.{'eager' if uncaptured else 'c0'}"]
    assert all(k["owner"] == m["owners"][0] for k in m["kernels"])
    doc = json.loads((tmp_path / "trace.json").read_text())
    kernels = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel" and e["pid"] == 1]
    lanes = {e["tid"] for e in kernels if e["tid"] < len(m["lanes"])}
    assert len(lanes) >= 2, result.summary()
    assert all(e["dur"] > 0 for e in kernels)
    assert not m["summary"]["unmatched"]["kernels"], result.summary()
    # The GEMMs (extern kernels of Inductor's code, under aten::mm) are labelled with their one node.
    assert any(len(k["nodes"]) == 1 and k["op"] in ("aten::mm", "aten::bmm") for k in m["kernels"])
    # A replay's kernels come from its CUDA graph; an uncaptured run has none.
    assert any(k["graph_kernel"] for k in m["kernels"]) is not uncaptured
    spans = {int(e["name"][4:]): e for e in doc["traceEvents"]
             if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == measure.SPAN_TID}
    assert len(spans) == 3
    aux = [e for e in kernels if 0 < e["tid"] < len(m["lanes"])]
    main = [e for e in kernels if e["tid"] == 0]
    for e in aux:  # every aux-lane kernel falls inside its run's measured span
        s = spans[e["args"]["run"]]
        assert s["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3
    overlaps = any(a["args"]["run"] == b["args"]["run"] and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
                   for a in aux for b in main)
    print("aux kernels overlap main-lane kernels:", overlaps, "overlap_us:", m["summary"]["overlap_us"])
    # The dump got the measurement, and show --trace uses it.
    ((name, _),) = dumps.load_graphs(str(dump))
    assert result.saved == [str(dump / name / "measured.json")]
    out = tmp_path / "show.json"
    assert cli.main(["show", str(dump), "--trace", str(out)]) == 0
    assert json.loads(out.read_text())["otherData"]["times"] == "measured"
    assert f"measured times for {name}" in capsys.readouterr().out
