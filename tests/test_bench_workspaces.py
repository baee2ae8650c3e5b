"""bench/workspaces.py on the CPU: how it lists a measured choice's candidates."""

from __future__ import annotations

from capturepass.runtime.choices import PickRecord
from tests.test_bench_zoo import _load


def test_each_candidate_is_listed_with_its_time_and_workspaces():
    bench = _load("workspaces")
    cands = [
        {"name": "model", "lanes": 3, "estimate_us": 90.0, "measured_us": 150.24, "workspace_mib": 96.0, "note": None},
        {"name": "one_lane", "lanes": 1, "estimate_us": 194.1, "measured_us": 177.552, "workspace_mib": 32.0,
         "note": None},
        {"name": "aux1", "lanes": 2, "estimate_us": 134.7, "measured_us": None, "workspace_mib": None,
         "note": "capture failed: RuntimeError"},
    ]
    record = PickRecord("inference", "(bfloat16[16, 4096])", "H200 sm90", "model", False, 200.0, 25, 405, cands)
    assert bench.candidate_lines(record) == [
        "model (3 lane(s)): 150.24 us, workspaces 96 MiB",
        "one_lane (1 lane(s)): 177.552 us, workspaces 32 MiB",
        "aux1 (2 lane(s)): not measured, workspaces unknown",
    ]
