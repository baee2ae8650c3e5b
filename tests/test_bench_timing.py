"""bench/timing.py's loop on the CPU: where its CUDA events go among the calls (CUDA faked)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "bench_timing", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "timing.py"))
_timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_timing)
timed = _timing.timed


class _Recorder:
    """Stands in for ``torch.cuda``'s events and synchronize (no CUDA here): logs what happens, in order."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        rec = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = len(rec.log)
                rec.log.append("record")

            def synchronize(self):
                rec.log.append("wait")

            def elapsed_time(self, end):
                return float(sum(e == "call" for e in rec.log[self.at:end.at]))  # one ms per call in between

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: rec.log.append("sync"))

    def call(self):
        self.log.append("call")


def test_each_repetition_queues_its_lead_in_calls_before_the_start_event(monkeypatch):
    rec = _Recorder(monkeypatch)
    ms = timed(rec.call, iters=4, reps=2, warmup=1, lead_in=2)
    rep = ["call", "call", "record", "call", "call", "call", "call", "record", "wait"]
    assert rec.log == ["call", "sync"] + rep + rep
    assert ms == 1.0  # the lead-in calls are not in the time: 4 calls between the events, over 4


def test_no_lead_in_starts_the_timing_on_the_idle_gpu(monkeypatch):
    rec = _Recorder(monkeypatch)
    timed(rec.call, iters=3, reps=1, warmup=0, lead_in=0)
    assert rec.log == ["sync", "record", "call", "call", "call", "record", "wait"]


@pytest.mark.parametrize("lead_in", [0, 3])
def test_the_wall_clock_path_has_no_lead_in(lead_in):
    calls = []
    timed(lambda: calls.append(1), iters=5, reps=2, warmup=1, device="cpu", lead_in=lead_in)
    assert len(calls) == 1 + 2 * 5


def test_each_worker_starts_from_empty_caches_of_its_own():
    """A worker that found another's compiled kernels or Triton tuning on disk would skip work (and
    the tuning's flush buffer) a first compile pays: each gets empty caches, and what it adds."""
    a, b = _timing.fresh_caches(), _timing.fresh_caches(CAPTUREPASS_PICK_LOCK="/tmp/lock")
    assert b["CAPTUREPASS_PICK_LOCK"] == "/tmp/lock"
    assert a.get("CAPTUREPASS_PICK_LOCK") == os.environ.get("CAPTUREPASS_PICK_LOCK")
    for key in ("TORCHINDUCTOR_CACHE_DIR", "CAPTUREPASS_CACHE_DIR"):
        assert a[key] != b[key]
        for env in (a, b):
            assert os.path.isdir(env[key]) and os.listdir(env[key]) == []
            os.rmdir(env[key])
