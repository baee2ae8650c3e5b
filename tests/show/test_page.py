"""``capturepass show DIR --html/--trace``: the schedule as a page and as a Chrome trace.

The model has two hinted lanes (``main`` and ``aux``) and one op declared not
capturable, compiled with ``cudagraphs="breakable"``: the dump then holds two
segments, one break between them, records and waits in both segments, and
retained static inputs. The page is checked as text (its per-graph drawing
model, the lists ``capturepass show`` prints, the one-lane and scheduled times),
with a measured run added to a copy of the dump, and then in a real headless
Chromium (skipped, saying how to get one, when none is installed) at two window
widths: the page's script must run to its end without an error (an ``onerror``
hook writes a marker into the DOM, read back with ``--dump-dom``), the DOM must
hold one row per lane, no two labels may overlap, the unzoomed schedule must fit
the window, and the screenshot must show each lane's kernels in its row up to
the schedule's end, and the lane names and kernel labels (a copy of the page
with its labels hidden differs there). A dense synthetic schedule checks the
labels where they cannot all fit; ``#zoom=4`` checks the zoom; a measured page
checks that boxes are as wide as the kernels ran.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import zlib

import pytest
import torch
import torch.nn as nn

import capturepass
from capturepass.show import cli, dumps, schedule
from capturepass.show import page as show_page
from capturepass.show import trace as show_trace
from capturepass.show import summary as show_summary


@torch.library.custom_op("capturepass_viewer_test::host_step", mutates_args=())
def host_step(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


@host_step.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.d = nn.Linear(32, 32)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.relu(self.a(x))
        y = h + torch.tanh(self.b(x))
        y = torch.ops.capturepass_viewer_test.host_step(y)
        with capturepass.lane("aux"):
            g = torch.sigmoid(self.c(y))
        return g * self.d(y)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    capturepass.register_capability(host_step, capturable=False)
    try:
        torch._dynamo.reset()
        root = tmp_path_factory.mktemp("dump")
        torch.manual_seed(0)
        model = Branchy()
        options = {"inner": "eager", "policy": "hints", "cudagraphs": "breakable", "dump_dir": str(root)}
        x = torch.randn(8, 32)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="capturepass", options=options)(x), model(x))
        torch._dynamo.reset()
    finally:
        capturepass.ir.capabilities.REGISTRY.unregister(host_step)
    return str(root)


@pytest.fixture(scope="module")
def graph(dump_dir):
    ((name, g),) = dumps.load_graphs(dump_dir)
    return name, g


def test_the_dump_has_what_the_page_must_draw(graph):
    _, g = graph
    assert g["lanes"] == ["main", "aux"]
    assert len(g["segments"]) == 2
    assert [b["source"] for b in g["breaks"]] == ["partition"]
    assert any(n["effect"] == "retain" for n in g["nodes"])


def test_simulated_schedule_respects_every_wait(graph):
    name, g = graph
    s = schedule.simulate(g, name)
    waits = [n for n in g["nodes"] if n["effect"] == "wait"]
    assert len(s.edges) == len(waits) > 0
    for e in s.edges:
        assert e.wait.start >= e.record.end
        assert e.why == e.wait.node["why"]
    # Program order on each lane: no two items of a lane overlap.
    for lane in range(len(g["lanes"])):
        items = [it for it in s.items if it.lane == lane]
        for a, b in zip(items, items[1:]):
            assert b.start >= a.end - 1e-9
    # The break runs after everything enqueued before it, on every lane.
    (brk,) = [it for it in s.items if "break" in it.node]
    before = s.items[: s.items.index(brk)]
    assert brk.start >= max(it.end for it in before) - 1e-9
    assert s.makespan >= max(it.end for it in s.items) - 1e-9


def _models(page: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'<script type="application/json" class="schedule-model">(.*?)</script>',
                                                page, re.S)]


def test_html_page_is_self_contained_and_lists_everything(dump_dir, graph):
    name, g = graph
    page = show_page.render_html(dump_dir)
    # No resource from elsewhere: the one URL is the SVG namespace the script creates elements in.
    assert "http://" not in page.replace("'http://www.w3.org/2000/svg'", "")
    assert "https://" not in page and "<link" not in page and " src=" not in page
    (model,) = _models(page)
    assert model["lanes"] == ["main", "aux"] and model["name"] == name
    assert len(model["segments"]) == 2 and len(model["breaks"]) == 1
    # Every wait with its reason, every retained object with its owner and segment.
    waits = [n for n in g["nodes"] if n["effect"] == "wait"]
    for w in waits:
        assert f"<code>%{w['name']}</code>" in page
        assert f"<code>{w['why'].replace('>', '&gt;')}</code>" in page
    retains = [n for n in g["nodes"] if n["effect"] == "retain"]
    for r in retains:
        for a in r["args"]:
            assert f"<code>{a}</code> input " in page and f"owner {r['owner']}, segment {r['segment']}</li>" in page
    # The lanes and why, the capability decision, the break: the lines of capturepass show.
    summary = show_summary.summarize_graph(g, name)
    for d in summary["decisions"]:
        if d["kind"] in ("lane", "capability"):
            assert f"<li>{html.escape(d['text'])}</li>" in page, d["text"]
    assert "host_step: may overlap; not capturable (a break when captured)" in page
    assert page.count('class="lane-stat"') == 2
    assert "Times: <b>estimated</b>" in page


def test_estimated_kernels_are_drawn_to_their_estimated_time(graph):
    name, g = graph
    s = schedule.simulate(g, name)
    model = show_page.estimated_model(s, 0)
    timed = [it for it in s.items if it.node["effect"] == "compute" and it.dur > 0]
    assert [(k["l"], k["s"], k["d"]) for k in model["kernels"]] == [(it.lane, it.start, it.dur) for it in timed]
    assert model["hidden"] == sum(1 for it in s.items if it.node["effect"] == "compute" and it.dur <= 0)
    assert len(model["edges"]) == len(s.edges) and model["span"] == s.makespan
    t = schedule.estimated_timing(s)
    assert t["one_lane_us"] == round(sum(it.dur for it in timed), 3)
    assert t["scheduled_us"] == round(s.makespan, 3)
    assert t["gained_us"] == round(t["one_lane_us"] - t["scheduled_us"], 3)


def _with_measurement(dump_dir, tmp_path) -> tuple[str, str, list[float]]:
    """A copy of the dump with a measured run of its graph (durations chosen to differ)."""
    import shutil

    from capturepass import measure
    from capturepass.measure.records import FORMAT

    root = tmp_path / "measured-dump"
    shutil.copytree(dump_dir, root)
    ((name, folder, g),) = dumps.load_graph_dirs(str(root))
    durs = [40.0, 5.0, 1.0, 12.0]
    kernels, spans = [], []
    for run, shift in ((0, 0.0), (1, 100.0), (2, 300.0)):
        slow = 2.0 if run == 2 else 1.0  # run 2 is slower: the median span is run 0's or 1's
        t = shift
        for i, d in enumerate(durs):
            lane = i % 2
            kernels.append({"name": f"kernel_{i}", "kind": "kernel", "lane": lane, "stream": 7 + lane, "run": run,
                            "start": t, "dur": d * slow, "region": None, "nodes": [["a_node", "b_node", "c", "d"][i]],
                            "op": "aten::mm", "graph_kernel": True})
            t += d * slow if lane == 1 else 0.5
        spans.append({"run": run, "start": shift, "end": max(k["start"] + k["dur"] for k in kernels if k["run"] == run)})
    m = {"format": FORMAT, "graph": name, "kind": "inference", "lanes": list(g["lanes"]), "mode": "replay",
         "lanes_from": "test", "runs": 3, "spans": spans, "kernels": kernels, "device": "Test GPU",
         "graph_sha256": measure.graph_digest(os.path.join(folder, "graph.json"))}
    measure.save_measurement(m, folder)
    return str(root), name, durs


def test_a_measured_run_is_drawn_with_its_durations(dump_dir, tmp_path, capsys):
    root, name, durs = _with_measurement(dump_dir, tmp_path)
    page = show_page.render_html(root)
    (model,) = _models(page)
    assert model["run"] in (0, 1)  # the median span, not the slow run
    assert [k["d"] for k in model["kernels"]] == durs
    assert [k["t"] for k in model["kernels"]] == ["%a_node", "%b_node", "%c", "%d"]
    assert "Times: <b>measured</b> (replay, 3 run(s) on Test GPU)" in page
    t = show_summary.summarize(root)["graphs"][0]["timing"]
    assert t["source"] == "measured" and t["one_lane_us"] == round(sum(durs) * 4 / 3, 3)
    assert cli.main(["show", root, "--html", str(tmp_path / "p.html")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"page {tmp_path / 'p.html'}: measured times for {name} (replay, 3 run(s) on Test GPU)")
    assert any(line.startswith("  schedule (measured: replay, 3 run(s) on Test GPU): one lane ") for line in out)


def test_trace_has_a_thread_per_lane_and_a_flow_per_wait(dump_dir, graph):
    _, g = graph
    trace = show_trace.render_trace(dump_dir)
    events = trace["traceEvents"]
    threads = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [t["args"]["name"] for t in threads] == ["s0 main", "s1 aux"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    waits = [n for n in g["nodes"] if n["effect"] == "wait"]
    assert len(starts) == len(finishes) == len(waits)
    assert starts.keys() == finishes.keys()
    for fid, f in finishes.items():
        s = starts[fid]
        assert f["bp"] == "e" and f["ts"] >= s["ts"] and f["name"] == s["name"]
        # Each flow end lies inside a slice of its thread, so that Perfetto can bind it.
        assert any(e["ph"] == "X" and e["tid"] == f["tid"] and e["ts"] <= f["ts"] <= e["ts"] + e["dur"] for e in events)
    computes = [n for n in g["nodes"] if n["effect"] == "compute"]
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] in ("compute", "break")) == len(computes)
    json.dumps(trace)  # serializable as is


def test_cli_writes_both_files(dump_dir, tmp_path, capsys):
    html_path, trace_path = tmp_path / "s.html", tmp_path / "s.json"
    assert cli.main(["show", dump_dir, "--html", str(html_path), "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph ")
    assert out.splitlines()[-2].startswith(f"page {html_path}: cost-model estimates (nominal device) for ")
    assert html_path.read_text() == show_page.render_html(dump_dir)
    assert json.loads(trace_path.read_text()) == show_trace.render_trace(dump_dir)


# -- a real browser -----------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _browser(tmp_path, url: str, *extra: str, window: tuple[int, int] = (1400, 900)) -> subprocess.CompletedProcess:
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: `bash scripts/install_browser.sh` says what it would install "
                    "(Debian's chromium, system-wide) and installs it with --yes")
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", f"--window-size={window[0]},{window[1]}", "--hide-scrollbars",
        "--virtual-time-budget=5000", *extra, url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _png_pixels(path) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB(A) rows of an 8-bit, non-interlaced PNG."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [b"".join(r[i:i + 3] for i in range(0, stride, bpp)) for r in rows]


def _dom(tmp_path, url: str, width: int) -> tuple[str, dict[str, str]]:
    proc = _browser(tmp_path, url, "--dump-dom", window=(width, 900))
    assert proc.returncode == 0, proc.stderr[-2000:]
    head = re.search(r"<html([^>]*)>", proc.stdout).group(1)
    return proc.stdout, dict(re.findall(r'(data-[a-z-]+)="([^"]*)"', head))


def _shot(tmp_path, url: str, width: int, name: str):
    shot = tmp_path / name
    proc = _browser(tmp_path, url, f"--screenshot={shot}", window=(width, 900))
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    return _png_pixels(shot)


@pytest.mark.parametrize("width", [800, 1600])
def test_the_page_in_headless_chromium(dump_dir, graph, tmp_path, width):
    """At two window widths: the script runs to its end, every lane has its row, the labels do not
    collide, the whole schedule is in the window, and the screenshot shows each lane's kernels and
    the labels (a copy of the page with the labels hidden differs there)."""
    _, g = graph
    page = tmp_path / "schedule.html"
    show_page.write_html(dump_dir, str(page))
    dom, attrs = _dom(tmp_path, page.as_uri(), width)
    assert attrs.get("data-ready") == "1", dom[:500]
    assert 'id="viewer-error"' not in dom and "data-error" not in attrs
    assert attrs["data-lane-rows"] == str(len(g["lanes"])) == str(dom.count('class="lane-row"'))
    assert int(attrs["data-labels"]) >= 4 and attrs["data-label-overlaps"] == "0"
    assert attrs["data-overflow"] == "0"  # no part of the page lies beyond the window's width
    left, right, scrolls = (int(v) for v in attrs["data-plot"].split(","))
    assert scrolls == 0 and 0 < left < right <= width  # the whole schedule fits, unzoomed
    rows = [int(y) for y in attrs["data-rows"].split(",")]
    assert len(rows) == len(g["lanes"]) and all(0 < y < 900 for y in rows)

    w, h, px = _shot(tmp_path, page.as_uri(), width, f"page-{width}.png")
    assert (w, h) == (width, 900)
    for lane, y in enumerate(rows):
        color = bytes.fromhex(schedule.LANE_COLORS[lane].lstrip("#"))
        xs = [x for yy in range(y - 5, y + 6) for x in range(left, right) if px[yy][3 * x:3 * x + 3] == color]
        assert len(xs) > 100, f"lane s{lane}'s kernels are not in its row"
        if lane == 0:  # the schedule's last kernel (on main, after the break's join) reaches the plot's end
            assert right - 40 <= max(xs) < right
    hidden = tmp_path / "hidden.html"
    hidden.write_text(page.read_text().replace("</style>", ".label{display:none}</style>"))
    _, _, bare = _shot(tmp_path, hidden.as_uri(), width, f"bare-{width}.png")
    for lane, y in enumerate(rows):
        def diff(x0, x1):
            return sum(1 for yy in range(y - 8, y + 9) for x in range(x0, x1)
                       if px[yy][3 * x:3 * x + 3] != bare[yy][3 * x:3 * x + 3])
        assert diff(0, left) > 20, f"no lane name drawn for s{lane}"
        assert diff(left, right) > 20, f"no kernel label drawn in s{lane}'s row"


def _dense_dump(tmp_path) -> str:
    """A graph.json of 80 kernels with long names over three lanes, 2 to 10 us each, with waits."""
    nodes = [{"name": "x", "op": "input", "effect": "input", "type": "f32[8]", "args": [], "lane": 0}]
    prev = "x"
    for i in range(80):
        lane = i % 3
        name = f"kernel_with_a_long_name_{i}"
        nodes.append({"name": name, "op": f"mylib.fused_attention_projection_variant_{i}.default",
                      "effect": "compute", "type": "f32[8]", "args": [prev], "lane": lane, "segment": "k0",
                      "cost": {"flops": 0.0, "bytes": 4e6 * (2 + i % 9), "symbolic": None}})
        if i % 3 == 2:
            nodes.append({"name": f"record_{i}", "op": "capturepass.record", "effect": "record", "type": "()",
                          "args": [], "lane": lane, "event": f"e{i}", "role": "join", "segment": "k0"})
            nodes.append({"name": f"wait_{i}", "op": "capturepass.wait", "effect": "wait", "type": "()",
                          "args": [], "lane": 0, "event": f"e{i}", "role": "join", "segment": "k0",
                          "why": f"%{name}->%next"})
        prev = name
    nodes.append({"name": "output", "op": "output", "effect": "output", "type": "()", "args": [prev], "lane": 0})
    doc = {"graph": "inference", "owner": "g0", "lanes": ["main", "aux0", "aux1"], "cudagraphs": "monolithic",
           "segments": ["k0"], "breaks": [], "decisions": [], "nodes": nodes}
    folder = tmp_path / "dense" / "000_inference"
    folder.mkdir(parents=True)
    (folder / "graph.json").write_text(json.dumps(doc))
    return str(tmp_path / "dense")


@pytest.mark.parametrize("width", [800, 1600])
def test_a_dense_schedule_keeps_its_labels_apart(tmp_path, width):
    root = _dense_dump(tmp_path)
    page = tmp_path / "dense.html"
    show_page.write_html(root, str(page))
    (model,) = _models(page.read_text())
    assert len(model["kernels"]) == 80 and len({k["d"] for k in model["kernels"]}) == 9  # widths differ
    _, attrs = _dom(tmp_path, page.as_uri(), width)
    assert attrs["data-ready"] == "1" and attrs["data-lane-rows"] == "3"
    assert attrs["data-label-overlaps"] == "0" and attrs["data-overflow"] == "0"
    assert attrs["data-plot"].endswith(",0")
    assert 0 < int(attrs["data-labels"]) <= 80


def test_the_page_zooms(dump_dir, tmp_path):
    page = tmp_path / "schedule.html"
    show_page.write_html(dump_dir, str(page))
    _, fit = _dom(tmp_path, page.as_uri(), 800)
    _, zoomed = _dom(tmp_path, page.as_uri() + "#zoom=4", 800)
    assert zoomed["data-ready"] == "1" and zoomed["data-label-overlaps"] == "0"
    assert zoomed["data-plot"].endswith(",1") and fit["data-plot"].endswith(",0")  # it scrolls sideways now
    assert zoomed["data-overflow"] == "0"  # inside its box: the page itself stays as wide as the window
    assert int(zoomed["data-labels"]) >= int(fit["data-labels"])


def test_measured_kernels_are_as_wide_as_they_ran(dump_dir, tmp_path):
    root, _, durs = _with_measurement(dump_dir, tmp_path)
    page = tmp_path / "measured.html"
    show_page.write_html(root, str(page))
    dom, attrs = _dom(tmp_path, page.as_uri(), 1200)
    assert attrs["data-ready"] == "1" and attrs["data-label-overlaps"] == "0"
    widths = [float(w) for w in re.findall(r'<rect class="kernel"[^>]*? width="([0-9.]+)"', dom)]
    assert len(widths) == len(durs)
    for wd, d in zip(widths, durs):
        assert wd / widths[0] == pytest.approx(d / durs[0], rel=1e-6)


def test_the_error_marker_catches_a_broken_script(dump_dir, tmp_path):
    """The check above can fail: a page whose script throws carries the marker."""
    page = tmp_path / "broken.html"
    page.write_text(show_page.render_html(dump_dir).replace("</body>", "<script>undefinedFunction();</script></body>"))
    proc = _browser(tmp_path, page.as_uri(), "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'id="viewer-error"' in proc.stdout and re.search(r"<html[^>]*data-error=", proc.stdout)
    assert "undefinedFunction" in proc.stdout.split('id="viewer-error"', 1)[1]


def test_unknown_costs_stay_valid_json(tmp_path):
    """A cost of NaN (a symbolic size without a hint) is drawn as no time and written as null."""
    graph = {
        "graph": "inference", "owner": "g0", "lanes": ["main"], "cudagraphs": "none", "segments": ["k0"],
        "breaks": [], "decisions": [],
        "nodes": [
            {"name": "x", "op": "input", "effect": "input", "type": "f32[s0]", "args": [], "lane": 0},
            {"name": "mm", "op": "aten.mm.default", "effect": "compute", "type": "f32[s0,s0]", "args": ["x"],
             "lane": 0, "segment": "k0", "cost": {"flops": float("nan"), "bytes": 64.0, "symbolic": "flops=s0**3"}},
            {"name": "output", "op": "output", "effect": "output", "type": "()", "args": ["mm"], "lane": 0},
        ],
    }
    (tmp_path / "graph.json").write_text(json.dumps(graph))
    (item,) = schedule.simulate(graph, "g").items
    assert item.dur > 0  # the bytes still count (and the launch floor)
    out = tmp_path / "trace.json"
    show_trace.write_trace(str(tmp_path), str(out))
    (mm,) = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert mm["args"]["cost"]["flops"] is None and mm["args"]["cost"]["bytes"] == 64.0
    assert "NaN" not in out.read_text()
