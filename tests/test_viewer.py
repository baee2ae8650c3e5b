"""``capturepass show DIR --html/--trace``: the schedule as a page and as a Chrome trace.

The model has two hinted lanes (``main`` and ``aux``) and one op declared not
capturable, compiled with ``cudagraphs="breakable"``: the dump then holds two
segments, one break between them, records and waits in both segments, and
retained static inputs. The page is checked as text, then loaded in a real
headless Chromium (skipped when no chromium binary is installed): the page's
script must run to its end without an error (an ``onerror`` hook writes a
marker into the DOM, read back with ``--dump-dom``), the DOM must hold one row
per lane, and the screenshot must show each lane's colour.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib

import pytest
import torch
import torch.nn as nn

import capturepass
from capturepass import cli, viewer


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
        capturepass.capabilities.REGISTRY.unregister(host_step)
    return str(root)


@pytest.fixture(scope="module")
def graph(dump_dir):
    ((name, g),) = cli.load_graphs(dump_dir)
    return name, g


def test_the_dump_has_what_the_page_must_draw(graph):
    _, g = graph
    assert g["lanes"] == ["main", "aux"]
    assert len(g["segments"]) == 2
    assert [b["source"] for b in g["breaks"]] == ["partition"]
    assert any(n["effect"] == "retain" for n in g["nodes"])


def test_simulated_schedule_respects_every_wait(graph):
    name, g = graph
    s = viewer.simulate(g, name)
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


def test_html_page_is_self_contained_and_lists_every_wait(dump_dir, graph):
    _, g = graph
    page = viewer.render_html(dump_dir)
    assert page.count('class="lane-row"') == len(g["lanes"])
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "<link" not in page and " src=" not in page
    waits = [n for n in g["nodes"] if n["effect"] == "wait"]
    for w in waits:
        assert f"<code>%{w['name']}</code>" in page
        assert f"<code>{w['why'].replace('>', '&gt;')}</code>" in page
    assert page.count('class="segment-band"') == 2
    assert page.count('class="break-band"') == 1
    retained = [a for n in g["nodes"] if n["effect"] == "retain" for a in n["args"]]
    assert retained and all(f"<code>{a}</code>" in page for a in retained)


def test_trace_has_a_thread_per_lane_and_a_flow_per_wait(dump_dir, graph):
    _, g = graph
    trace = viewer.render_trace(dump_dir)
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
    assert capsys.readouterr().out.startswith("graph ")
    assert html_path.read_text() == viewer.render_html(dump_dir)
    assert json.loads(trace_path.read_text()) == viewer.render_trace(dump_dir)


# -- a real browser -----------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _browser(tmp_path, url: str, *extra: str) -> subprocess.CompletedProcess:
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: `bash scripts/install_browser.sh` says what it would install "
                    "(Debian's chromium, system-wide) and installs it with --yes")
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", "--window-size=1400,900", *extra, url,
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


def _count_color(rows: list[bytes], rgb: str) -> int:
    want = bytes.fromhex(rgb.lstrip("#"))
    return sum(sum(1 for i in range(0, len(r), 3) if r[i:i + 3] == want) for r in rows)


def test_page_loads_in_headless_chromium_without_errors(dump_dir, graph, tmp_path):
    _, g = graph
    page = tmp_path / "schedule.html"
    viewer.write_html(dump_dir, str(page))
    proc = _browser(tmp_path, page.as_uri(), "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert 'data-ready="1"' in dom, dom[:500]
    assert 'id="viewer-error"' not in dom and not re.search(r"<html[^>]*data-error=", dom)
    assert f'data-lane-rows="{len(g["lanes"])}"' in dom
    assert dom.count('class="lane-row"') == len(g["lanes"])
    assert "Uncaught" not in proc.stderr

    shot = tmp_path / "schedule.png"
    proc = _browser(tmp_path, page.as_uri(), f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (1400, 900)
    # Each lane's kernels are drawn in that lane's colour: the screenshot shows every lane.
    for lane in range(len(g["lanes"])):
        assert _count_color(rows, viewer._LANE_COLORS[lane]) > 200, f"lane s{lane} not visible"


def test_the_error_marker_catches_a_broken_script(dump_dir, tmp_path):
    """The check above can fail: a page whose script throws carries the marker."""
    page = tmp_path / "broken.html"
    page.write_text(viewer.render_html(dump_dir).replace("</body>", "<script>undefinedFunction();</script></body>"))
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
    (item,) = viewer.simulate(graph, "g").items
    assert item.dur > 0  # the bytes still count (and the launch floor)
    out = tmp_path / "trace.json"
    viewer.write_trace(str(tmp_path), str(out))
    (mm,) = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert mm["args"]["cost"]["flops"] is None and mm["args"]["cost"]["bytes"] == 64.0
    assert "NaN" not in out.read_text()
