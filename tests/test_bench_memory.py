"""bench/memory.py on the CPU: its arguments and its report's arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.test_bench_zoo import ROOT, _load


def test_memory_bench_help():
    ok = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "memory.py"), "--help"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--sizes" in ok.stdout


def test_memory_report_compares_reserved_memory_with_reduce_overhead_at_each_n():
    memory = _load("memory")
    row = dict(captured=None, allocated_mib=32.0, peak_mib=90.0, rel_err=0.0)
    rows = [
        dict(row, variant="reduce-overhead", sizes=8, reserved_mib=80.0, segments={"pool (1, 2)": [60.0, 30.0]}),
        dict(row, variant="capturepass", sizes=8, captured=8, reserved_mib=120.0, rel_err=0.2,
             segments={"pool (1, 5)": [64.0, 32.0], "stream 0x0": [56.0, 0.0]}),
        dict(row, variant="capturepass", sizes=32, captured=32, reserved_mib=100.0,
             peak_sites=["peak of the recorded history: 40.0 MiB in 2 block(s)", "    32.0 MiB  cublas"]),
    ]
    lines = memory.report(rows).splitlines()
    assert lines[2] == "| 8 | reduce-overhead |  | 32 | 80 | 90 | 1.00 |"
    assert lines[3] == "| 8 | capturepass | 8 | 32 | 120 | 90 | 1.50 |"
    assert lines[4] == "| 32 | capturepass | 32 | 32 | 100 | 90 |  |"  # no reduce-overhead row at N=32
    assert "large difference from eager: capturepass N=8 rel 0.2" in lines
    assert ("segments, capturepass N=8: pool (1, 5): 64 reserved / 32 allocated, stream 0x0: 56 reserved / 0 allocated"
            in lines)
    at = lines.index("segments, capturepass N=32: ")
    assert lines[at + 1:] == ["  at the peak: peak of the recorded history: 40.0 MiB in 2 block(s)",
                              "  at the peak:     32.0 MiB  cublas"]



def test_segment_sites_name_the_allocation_that_made_each_segment_outside_a_pool(monkeypatch):
    import torch

    memory = _load("memory")
    mib = 2**20
    here = [{"filename": "/x/site-packages/torch/_inductor/runtime/benchmarking.py", "line": 7, "name": "flush"},
            {"filename": "/x/capturepass/runtime/executor.py", "line": 40, "name": "warm"}]
    snapshot = {
        "segments": [
            {"address": 1, "total_size": 2 * mib, "allocated_size": 0, "stream": 0, "segment_pool_id": (0, 0)},
            {"address": 2, "total_size": 60 * mib, "allocated_size": mib, "stream": 7, "segment_pool_id": (0, 0)},
            {"address": 3, "total_size": 90 * mib, "allocated_size": 0, "stream": 0, "segment_pool_id": (1, 4)},
        ],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 2, "size": 60 * mib, "stream": 7, "frames": here},
            {"action": "alloc", "addr": 1, "size": mib, "stream": 0, "frames": here},
        ]],
    }
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    assert memory.segment_sites() == [
        "60.0 MiB on stream 0x7, 1.0 allocated: torch/_inductor/runtime/benchmarking.py:7 flush"
        " <- capturepass/runtime/executor.py:40 warm",
        "2.0 MiB on stream 0x0, 0.0 allocated: ? (made before the history)",
    ]
