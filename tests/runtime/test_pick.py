"""Measured lane choice on the CPU: the choice, the budget, the cache, the dump and ``show``.

Nothing is captured on the CPU, so the picker runs here with a fake executor (its
captures are records of which program was captured) and an injected timer (each
candidate's replay takes a fixed time): every count below is exact. The GPU path
is ``tests/runtime/test_pick_gpu.py``.

The candidates themselves are ``tests/backends/test_candidates.py``; the lock processes that
share a GPU time their candidates under, ``tests/runtime/test_pick_lock.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from capturepass.backends import candidates
from capturepass.backends import dynamo
from capturepass.backends.compile import compile_graph
from capturepass.errors import DumpError, OptionError
from capturepass.ir import meta
from capturepass.ir.options import Options
from capturepass.runtime import choices, files, pick
from capturepass.runtime.pick import ScheduleCache
from capturepass.show import cli
from capturepass.show import summary as show_summary
from tests.helpers import aten_graph, candidates_of as _compile, moe_block_fn as _moe
from tests.runtime.pick_fakes import Cand, FakeCap, FakeExecutor, fake_picker

# -- the choice and the budget ----------------------------------------------------------------------


def test_fastest_median_wins_and_ties_go_to_one_lane():
    assert pick.choose([100.0, 80.0, 90.0], [3, 1, 2]) == 1
    assert pick.choose([80.0, 100.0, 90.0], [3, 1, 2]) == 0
    assert pick.choose([100.0, 100.0], [3, 1]) == 1  # a tie: one lane
    assert pick.choose([98.5, 100.0], [3, 1]) == 1  # within 2%: one lane
    assert pick.choose([97.0, 100.0], [3, 1]) == 0  # 3% faster: the lanes pay
    assert pick.choose([98.5, 100.0], [3, 1], tie=0.01) == 0
    # Between candidates with side lanes the faster wins, however close (the H100's Qwen2-MoE
    # decode graph: its three lanes 1.9% faster than two, one lane 6.7% slower).
    assert pick.choose([625.8, 667.8, 637.8], [3, 1, 2]) == 0
    assert pick.choose([637.8, 667.8, 625.8], [2, 1, 3]) == 2
    assert pick.choose([100.0, 100.0, 110.0], [3, 2, 1]) == 1  # equal: fewer lanes
    # One lane within the tie still wins over the fastest, and a program of its own over a map.
    assert pick.choose([98.5, 99.0, 100.0, 100.0], [3, 2, 1, 1], mapped=[False, True, True, False]) == 3
    assert pick.choose([None, 120.0, 110.0], [3, 1, 2]) == 2  # not measured: left out
    with pytest.raises(ValueError):
        pick.choose([None], [1])


@pytest.mark.parametrize("budget_ms, per_sample, rounds",
                         [(2.0, 1, 6), (0.0, 1, 1), (1000.0, 1, pick.MAX_ROUNDS), (2.0, 2, 2)])
def test_budget_bounds_the_timed_replays(budget_ms, per_sample, rounds):
    """A round of one replay per sample: 230 us, two warm-up rounds 460 us. With two replays a
    sample (a lead-in and one timed) a round costs 460 us, the warm-up 920."""
    times = [100e-6, 50e-6, 80e-6]
    calls = []

    def measure(order):
        calls.append(list(order))
        return [times[i] for i in order]

    samples, replays = pick.time_rounds(3, measure, budget_ms / 1e3, per_sample=per_sample)
    assert [len(s) for s in samples] == [rounds] * 3
    assert replays == 3 * per_sample * (pick.WARMUP_ROUNDS + rounds) == per_sample * sum(len(c) for c in calls)
    assert calls[:2] == [[0, 1, 2], [0, 1, 2]]
    assert calls[2:5] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]][: len(calls) - 2]  # rotated: interleaved fairly
    if budget_ms:
        assert per_sample * sum(sum(times[i] for i in c) for c in calls) <= budget_ms / 1e3


# -- the picker with a fake executor and timer (tests/runtime/pick_fakes.py) ----------------------


def test_picker_measures_keeps_the_fastest_and_releases_the_others(tmp_path, caplog):
    p, timer, picked, cands = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0})
    mib = 2**20
    ex = FakeExecutor({"model": 96 * mib, "one_lane": 32 * mib, "aux1": 64 * mib + 3 * mib // 10})
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        cap, out = p.capture(ex, [x], real=True)
    # The cost model's candidate warms up on the call itself; the others on copies.
    assert [(c.name, real) for c in cands for prog, real in ex.captured if prog is c.program] == [
        ("model", True), ("one_lane", False), ("aux1", False)]
    assert ex.names == [None, "one_lane", "aux1"]  # owners: g.m.c0, g.m.c0.one_lane, g.m.c0.aux1
    assert cap.program is cands[1].program and not cap.owner.closed
    assert out == ("warm-up of", cands[0].program)  # the call's results: the model's warm-up
    # 240 us a round, 480 us warm-up, 1520 // 240 = 6 timed rounds.
    assert timer.replays == 3 * (2 + 6)
    (record,) = picked
    assert record.to_json() == {
        "graph": "inference", "shape": "(float32[4, 8])", "device": "FakeGPU sm90", "choice": "one_lane",
        "cached": False, "budget_ms": 2.0, "rounds": 6, "replays": 24, "scale": 1.7647, "unsteady": [],
        "candidates": [
            {"name": "model", "lanes": 3, "estimate_us": 20.0, "measured_us": 100.0, "fastest_us": 100.0,
             "workspace_mib": 96.0, "note": None},
            {"name": "one_lane", "lanes": 1, "estimate_us": 34.0, "measured_us": 60.0, "fastest_us": 60.0,
             "workspace_mib": 32.0, "note": None},
            {"name": "aux1", "lanes": 2, "estimate_us": 22.0, "measured_us": 80.0, "fastest_us": 80.0,
             "workspace_mib": 64.3, "note": None},
        ]}
    assert record.text() == (
        "schedule for (float32[4, 8]) on FakeGPU sm90: one_lane (1 lane(s)), measured fastest (6 round(s), 24 "
        "replays); model 3 lane(s): estimate 20.0 us, measured 100.0 us, cuBLAS workspaces 96 MiB; one_lane 1 "
        "lane(s): estimate 34.0 us, measured 60.0 us, cuBLAS workspaces 32 MiB; aux1 2 lane(s): estimate 22.0 us, "
        "measured 80.0 us, cuBLAS workspaces 64.3 MiB; cost model scale (one lane, measured/estimate) 1.76")
    lines = [r.getMessage() for r in caplog.records if "schedule" in r.getMessage()]
    assert lines == [
        "capturepass: inference graph, shape (float32[4, 8]): schedule candidate model (3 lane(s)): estimate 20.0 us, "
        "measured 100.0 us, cuBLAS workspaces 96 MiB",
        "capturepass: inference graph, shape (float32[4, 8]): schedule candidate one_lane (1 lane(s)): estimate "
        "34.0 us, measured 60.0 us, cuBLAS workspaces 32 MiB",
        "capturepass: inference graph, shape (float32[4, 8]): schedule candidate aux1 (2 lane(s)): estimate 22.0 us, "
        "measured 80.0 us, cuBLAS workspaces 64.3 MiB",
        "capturepass: inference graph, shape (float32[4, 8]): chose schedule one_lane (1 lane(s)), measured 60.0 us "
        "over 6 round(s)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if "schedule" in r.getMessage())


class _DroppingCap(FakeCap):
    """A capture that lets go of its outputs when asked, as a real one-segment capture does."""

    def drop_outputs(self):
        self.outputs_dropped = True
        return True


class _DroppingExecutor(FakeExecutor):
    def __init__(self):
        super().__init__()
        self.caps = []

    def _warm_program(self, program, args, real, candidate, lane_map=None):
        self.captured.append((program, real))
        self.names.append(candidate)
        self.caps.append(_DroppingCap(program, name=candidate or "model"))
        return self.caps[-1], ("warm-up of", program)


def test_measuring_holds_one_set_of_outputs_and_one_lane_chosen_needs_no_second_capture(tmp_path):
    """The candidates are only timed: before each capture the one captured before it drops its
    outputs, so measuring holds one set. One lane's own program is captured last and keeps its
    outputs: chosen, it is the call's capture as it is."""
    p, timer, picked, cands = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0})
    ex = _DroppingExecutor()
    cap, out = p.capture(ex, [torch.randn(4, 8)], real=True)
    model, one_lane, aux1 = ex.caps
    assert model.outputs_dropped and aux1.outputs_dropped and not one_lane.outputs_dropped
    assert model.owner.closed and aux1.owner.closed
    assert cap is one_lane and not cap.owner.closed
    assert ex.names == [None, "one_lane", "aux1"]  # warmed up once each, nothing captured again
    assert out == ("warm-up of", cands[0].program)
    assert picked[0].choice == "one_lane" and timer.replays == 3 * (2 + 6)


def test_a_chosen_candidate_that_dropped_its_outputs_is_captured_again(tmp_path):
    p, _, picked, cands = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 30.0})
    ex = _DroppingExecutor()
    cap, out = p.capture(ex, [torch.randn(4, 8)], real=True)
    assert picked[0].choice == "aux1"
    assert all(c.owner.closed for c in ex.caps[:3])
    assert ex.names == [None, "one_lane", "aux1", "aux1"]
    assert ex.captured[3] == (cands[2].program, False)  # warmed up on copies: the call was the model's
    assert cap is ex.caps[3] and not cap.outputs_dropped and not cap.owner.closed
    assert out == ("warm-up of", cands[0].program)


def test_the_call_keeps_its_results_when_its_choice_fails_to_capture_again(tmp_path):
    """The cost model's program chosen, its outputs dropped while the others were measured: its
    capture again fails (the executor makes the op a break), and the failure carries the call's
    results (its warm-up was the call), which the executor returns."""
    from capturepass.runtime.replay import CaptureFailure

    class FailAgain(_DroppingExecutor):
        def _capture_program(self, program, args, real, candidate, lane_map=None):
            raise CaptureFailure(0, RuntimeError("cannot capture"), None, {}, None)

    p, _, picked, cands = fake_picker(tmp_path, {"model": 30.0, "one_lane": 60.0, "aux1": 80.0})
    with pytest.raises(CaptureFailure) as failure:
        p.capture(FailAgain(), [torch.randn(4, 8)], real=True)
    assert picked[0].choice == "model"
    assert failure.value.outputs == ("warm-up of", cands[0].program)


def test_a_lone_candidate_keeps_its_outputs(tmp_path):
    p, timer, picked, cands = fake_picker(tmp_path, {"model": 100.0}, cands=[Cand("model", 1, 20.0)])
    ex = _DroppingExecutor()
    cap, _ = p.capture(ex, [torch.randn(4, 8)], real=True)
    assert cap is ex.caps[0] and not cap.outputs_dropped and ex.names == [None]


def test_tie_keeps_fewer_lanes(tmp_path):
    p, _, picked, _ = fake_picker(tmp_path, {"model": 60.0, "one_lane": 60.0, "aux1": 60.0})
    p.capture(FakeExecutor(), [torch.randn(2)], real=True)
    assert picked[0].choice == "one_lane"


def test_timed_replays_leave_written_static_inputs_as_they_were(tmp_path):
    cache = torch.arange(4.0)
    p, timer, _, _ = fake_picker(tmp_path, {"model": 10.0, "one_lane": 20.0, "aux1": 30.0}, written=cache)
    p.capture(FakeExecutor(), [torch.randn(2), cache], real=True, protect=[cache])
    assert timer.replays == 3 * (2 + 25)  # 120 us of 2 ms: the round cap
    assert torch.equal(cache, torch.arange(4.0))


def test_second_picker_reads_the_cache_and_captures_only_the_choice(tmp_path, caplog):
    us = {"model": 100.0, "one_lane": 120.0, "aux1": 70.0}
    p, _, _, _ = fake_picker(tmp_path, us)
    p.capture(FakeExecutor({"model": 96 << 20, "one_lane": 32 << 20}), [torch.randn(4, 8)], real=True)
    (path,) = (tmp_path / "cache").iterdir()
    entry = json.loads(path.read_text())
    assert (entry["format"], entry["choice"]) == (choices.CACHE_FORMAT, "aux1")
    # A fresh picker (another process): nothing measured, only the chosen candidate captured.
    fresh, timer, picked, cands = fake_picker(tmp_path, us)
    ex = FakeExecutor()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        cap, out = fresh.capture(ex, [torch.randn(4, 8)], real=True)
    assert timer.replays == 0
    assert ex.captured == [(cands[2].program, True)] and cap.program is cands[2].program
    assert ex.names == ["aux1"]
    assert out == ("warm-up of", cands[2].program)
    (record,) = picked
    assert (record.cached, record.choice, record.rounds, record.replays) == (True, "aux1", 0, 0)
    assert [c["measured_us"] for c in record.candidates] == [100.0, 120.0, 70.0]
    # What the earlier process measured of each, its workspaces too (aux1's were not known there).
    assert [c["workspace_mib"] for c in record.candidates] == [96.0, 32.0, None]
    assert record.text().startswith("schedule for (float32[4, 8]) on FakeGPU sm90: aux1 (2 lane(s)), cached choice "
                                    "(measured 70.0 us in an earlier process); ")
    assert ("capturepass: inference graph, shape (float32[4, 8]): schedule aux1 (2 lane(s)) from the schedule cache; "
            "nothing measured") in [r.getMessage() for r in caplog.records]


class _DisturbedTimer:
    """Each candidate's replay takes a fixed time, except in the rounds another process's kernels
    share the GPU: from ``since`` on, every sample takes ``slower`` times as long."""

    def __init__(self, us, since, slower):
        self.us, self.since, self.slower, self.rounds = us, since, slower, 0

    def __call__(self, caps, order):
        self.rounds += 1
        factor = self.slower if self.rounds > self.since else 1.0
        return [self.us[caps[i].name] * factor / 1e6 for i in order]


@pytest.mark.parametrize("since, slower, rounds, steady", [
    (2 + 3, 1.5, 6, False),   # three quiet rounds of six, then the rest 1.5x: the median is the disturbed pace
    (2 + 3, 1.09, 6, True),   # 9% slower for half the rounds: within what one graph's replays may vary
    (2 + 4, 1.5, 6, True),    # four quiet rounds of six: the median is the quiet pace
    (0, 3.0, 1, True),        # disturbed from the first warm-up round on: the budget's one round shows nothing
    (0, 1.2, 4, True),        # evenly disturbed in every round: nothing shows it
])
def test_unsteady_timings_choose_for_this_process_but_are_not_cached(tmp_path, caplog, since, slower, rounds,
                                                                     steady):
    from capturepass.runtime.calibration import CalibrationStore

    us = {"model": 100.0, "one_lane": 60.0, "aux1": 80.0}
    store = CalibrationStore(tmp_path / "cache")
    p, _, picked, cands = fake_picker(tmp_path, us, calibration=store, rooflines=[(1e-6, 20), (1e-5, 2)])
    p.measure_round = _DisturbedTimer(us, since, slower)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        cap, _ = p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    (record,) = picked
    assert cap.program is cands[1].program and record.choice == "one_lane" and record.rounds == rounds
    cached = sorted(f.name for f in (tmp_path / "cache").iterdir()) if (tmp_path / "cache").exists() else []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if steady:
        assert record.unsteady == [] and "unsteady" not in record.text()
        # The choice under its key, and the device's calibration sample.
        assert [f.startswith("calibration-") for f in cached] == [False, True]
        assert store.model("FakeGPU sm90").samples == 1
        assert warned == []
        return
    assert record.unsteady == ["model", "one_lane", "aux1"]
    assert [(c["measured_us"], c["fastest_us"]) for c in record.candidates] == [(125.0, 100.0), (75.0, 60.0),
                                                                                (100.0, 80.0)]
    assert record.text().endswith(
        "; unsteady timings (model: median 125.0 us, fastest 100.0 us; one_lane: median 75.0 us, fastest 60.0 us; "
        "aux1: median 100.0 us, fastest 80.0 us): not cached")
    assert warned == [
        "capturepass: inference graph, shape (float32[4, 8]): the timings were unsteady (model: median 125.0 us, "
        "fastest 100.0 us; one_lane: median 75.0 us, fastest 60.0 us; aux1: median 100.0 us, fastest 80.0 us): "
        "other work shared the GPU with the timed replays; the choice holds for this process only, is not cached "
        "and calibrates nothing"]
    # Nothing kept for another process: neither the choice nor a calibration.
    assert cached == [] and store.model("FakeGPU sm90") is None
    # So the next process measures the shape again.
    again, timer, _, _ = fake_picker(tmp_path, us)
    again.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    assert timer.replays > 0


def test_too_few_rounds_cannot_show_unsteady_timings():
    assert not pick.unsteady_timing(200.0, 100.0, pick.UNSTEADY_ROUNDS - 1)
    assert pick.unsteady_timing(200.0, 100.0, pick.UNSTEADY_ROUNDS)
    assert not pick.unsteady_timing(None, 100.0, 25)
    assert not pick.unsteady_timing(110.0, 100.0, 25) and pick.unsteady_timing(110.1, 100.0, 25)


@pytest.mark.parametrize("change", ["device", "shape", "graph"])
def test_cache_key_includes_device_shape_and_graph(tmp_path, change):
    us = {"model": 100.0, "one_lane": 120.0, "aux1": 70.0}
    p, _, _, _ = fake_picker(tmp_path, us)
    p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    kw = {"device": "OtherGPU sm80"} if change == "device" else {"graph": "g1"} if change == "graph" else {}
    fresh, timer, picked, _ = fake_picker(tmp_path, us, **kw)
    fresh.capture(FakeExecutor(), [torch.randn(4, 9) if change == "shape" else torch.randn(4, 8)], real=True)
    assert timer.replays == 18 and not picked[0].cached
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_records_show_the_call_without_its_parameters_and_the_key_keeps_them(tmp_path):
    us = {"model": 100.0, "one_lane": 120.0, "aux1": 70.0}
    p, _, picked, _ = fake_picker(tmp_path, us)
    ex = FakeExecutor()
    ex.static_positions = (1,)  # a parameter, at a fixed address
    p.capture(ex, [torch.randn(4, 8), torch.randn(8, 8)], real=True)
    assert picked[0].shape == "(float32[4, 8])" and picked[0].text().startswith("schedule for (float32[4, 8]) on ")
    # A parameter of another shape is another key (measured again), shown the same.
    fresh, timer, again, _ = fake_picker(tmp_path, us)
    fresh.capture(ex, [torch.randn(4, 8), torch.randn(8, 9)], real=True)
    assert timer.replays == 18 and not again[0].cached and again[0].shape == "(float32[4, 8])"
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 999, "choice": "aux1"}), "[]"])
def test_corrupt_cache_warns_once_and_measures(tmp_path, caplog, content):
    us = {"model": 100.0, "one_lane": 120.0, "aux1": 70.0}
    p, _, _, _ = fake_picker(tmp_path, us)
    p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    (path,) = (tmp_path / "cache").iterdir()
    path.write_text(content)
    files._warned.clear()
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        for _ in range(2):
            path.write_text(content)
            fresh, timer, picked, _ = fake_picker(tmp_path, us)
            fresh.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
            assert timer.replays == 18 and picked[0].choice == "aux1" and not picked[0].cached
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"capturepass: the schedule cache file {path}")
    assert warnings[0].endswith("measuring the candidates again")


def test_unwritable_cache_warns_once_and_still_chooses(tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    files._warned.clear()
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        for _ in range(2):
            p, timer, picked, _ = fake_picker(tmp_path, {"model": 100.0, "one_lane": 120.0, "aux1": 70.0})
            p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
            assert picked[0].choice == "aux1" and timer.replays == 18
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write the schedule cache in" in warnings[0]


def test_candidate_that_fails_to_compile_is_left_out(tmp_path, caplog):
    class Broken:
        name, lanes, estimate_us = "aux1", 2, 22.0

        @property
        def program(self):
            raise RuntimeError("inductor said no")

    cands = [Cand("model", 3, 20.0), Cand("one_lane", 1, 34.0)]
    p, timer, picked, _ = fake_picker(tmp_path, {"model": 50.0, "one_lane": 60.0}, cands=[*cands, Broken()])
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        p.capture(FakeExecutor(), [torch.randn(2)], real=True)
    assert picked[0].choice == "model"
    assert picked[0].candidates[2] == {"name": "aux1", "lanes": 2, "estimate_us": 22.0, "measured_us": None,
                                       "fastest_us": None, "workspace_mib": None,
                                       "note": "compile failed: RuntimeError"}
    assert timer.replays == 2 * (2 + 16)  # 110 us a round: (2000 - 220) // 110 = 16 timed rounds


class _FailFirst(FakeExecutor):
    """Its first capture of ``program`` fails, as a capture of an op that calls ``.tolist()`` does."""

    def __init__(self, program):
        super().__init__()
        self.failing = program

    def _warm_program(self, program, args, real, candidate, lane_map=None):
        from capturepass.runtime.replay import CaptureFailure

        if program is self.failing:
            self.failing = None
            self.captured.append((program, real))
            self.names.append(candidate)
            failure = CaptureFailure(0, RuntimeError("cannot capture"), ("failed warm-up of", program), {}, None)
            return FakeCap(program, failure, candidate or "model"), ("failed warm-up of", program)
        return super()._warm_program(program, args, real, candidate)


def test_cached_choice_that_fails_to_capture_is_measured_again(tmp_path, caplog):
    us = {"model": 100.0, "one_lane": 120.0, "aux1": 70.0}
    p, _, _, _ = fake_picker(tmp_path, us)
    p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    fresh, timer, picked, cands = fake_picker(tmp_path, us)
    ex = _FailFirst(cands[2].program)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        cap, out = fresh.capture(ex, [torch.randn(4, 8)], real=True)
    # The failed warm-up was the call; everything after it warms up on copies.
    assert [(c.name, real) for prog, real in ex.captured for c in cands if c.program is prog] == [
        ("aux1", True), ("model", False), ("one_lane", False), ("aux1", False)]
    assert out == ("failed warm-up of", cands[2].program)
    assert timer.replays == 18 and picked[0].choice == "aux1" and not picked[0].cached
    assert any("the cached schedule aux1 failed to capture" in r.getMessage() for r in caplog.records)


def test_timing_that_fails_keeps_the_cost_models_schedule(tmp_path, caplog):
    p, _, picked, cands = fake_picker(tmp_path, {"model": 1.0, "one_lane": 1.0, "aux1": 1.0})

    def broken(caps, order):
        broken.caps = caps
        raise RuntimeError("no timer today")

    p.measure_round = broken
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        cap, out = p.capture(FakeExecutor(), [torch.randn(2)], real=True)
    assert cap.program is cands[0].program and not cap.owner.closed and out == ("warm-up of", cands[0].program)
    assert [c.owner.closed for c in broken.caps] == [False, True, True]
    assert picked == [] and not (tmp_path / "cache").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "capturepass: inference graph, shape (float32[2]): timing the schedule candidates failed (RuntimeError: no "
        "timer today); keeping the cost model's schedule (not cached)"]


def test_cost_model_candidate_that_fails_to_capture_is_the_executors(tmp_path):
    from capturepass.runtime.replay import CaptureFailure

    p, timer, picked, cands = fake_picker(tmp_path, {"model": 1.0, "one_lane": 1.0, "aux1": 1.0})
    with pytest.raises(CaptureFailure):
        p.capture(_FailFirst(cands[0].program), [torch.randn(2)], real=True)
    assert timer.replays == 0 and picked == []


def test_a_rebuilt_program_gets_the_renewed_picker(tmp_path, caplog):
    p, _, _, cands = fake_picker(tmp_path, {"model": 1.0, "one_lane": 1.0, "aux1": 1.0})
    assert p.for_program(cands[0].program) is p
    other, _, _, rebuilt = fake_picker(tmp_path, {"model": 1.0, "one_lane": 1.0, "aux1": 1.0})
    p.renew = lambda program: other if program is rebuilt[0].program else None
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert p.for_program(rebuilt[0].program) is other
        assert p.for_program(object()) is None
    assert [r.getMessage() for r in caplog.records] == [
        "capturepass: inference graph was rebuilt with a break; its schedule candidates were derived again",
        "capturepass: inference graph was rebuilt with a break and has no schedule candidates to measure; new "
        "shapes run the cost model's schedule",
    ]


# -- the option, the backend's wiring, the dump and show ---------------------------------------------


def test_pick_option_is_validated():
    assert Options().pick == "measure" and Options().pick_budget_ms == 200.0
    assert Options.from_mapping({"pick": "model"}).pick == "model"
    with pytest.raises(OptionError, match=r"option 'pick' must be one of 'measure', 'model'; got 'modle' "
                                          r"\(did you mean 'model'\?\)"):
        Options.from_mapping({"pick": "modle"})
    with pytest.raises(OptionError, match="option 'pick_budget_ms' must be a finite non-negative number, got -1"):
        Options.from_mapping({"pick_budget_ms": -1})
    with pytest.raises(OptionError, match="option 'pick_cache_dir' must be a directory path or None, got ''"):
        Options.from_mapping({"pick_cache_dir": ""})
    assert Options().pick_predict is False and Options.from_mapping({"pick_predict": True}).pick_predict is True
    with pytest.raises(OptionError, match="option 'pick_predict' must be True or False, got 'no'"):
        Options.from_mapping({"pick_predict": "no"})
    # Which schedule runs is no part of what a pass compiles; the backward graph measures nothing.
    assert Options(pick="model").key() == Options().key() == Options(pick_budget_ms=5).key() \
        == Options(pick_predict=False).key()
    assert Options().for_graph("backward", True).pick == "model"


def test_the_backend_measures_only_captured_cuda_graphs_with_pick_measure(tmp_path):
    compiled, pristine, opts, plan_with = _compile(*_moe())
    graph_opts = opts.for_graph("inference", True)
    assert dynamo._picker("inference", compiled, pristine, dataclasses.replace(graph_opts, pick="model"),
                          plan_with, None, None, on_cuda=True) is None
    assert dynamo._picker("inference", compiled, pristine, graph_opts, plan_with, None, None, on_cuda=False) is None
    assert dynamo._picker("inference", compiled, pristine, dataclasses.replace(graph_opts, cudagraphs="none"),
                          plan_with, None, None, on_cuda=True) is None
    p = dynamo._picker("inference", compiled, pristine, graph_opts, plan_with, None, None, on_cuda=True)
    assert [c.name for c in p.candidates] == ["model", "one_lane", "aux1"]


def test_cpu_compile_measures_nothing(caplog):
    torch._dynamo.reset()
    f, inputs = _moe()
    with caplog.at_level(logging.DEBUG, logger="capturepass"), torch.no_grad():
        out = torch.compile(f, backend="capturepass", options={"inner": "eager"})(*inputs)
    torch.testing.assert_close(out, f(*inputs))
    assert not [r for r in caplog.records if "schedule" in r.getMessage()]
    torch._dynamo.reset()


def test_measured_choices_are_summed_up_for_the_graphs_next_compile(tmp_path, monkeypatch, caplog):
    """The picker adds each measured choice to a summary kept under the graph's hash before its
    schedule; a later compile of the graph reads it before compiling anything: a graph of one
    shape takes that shape's choice; a graph with a symbolic size takes one lane only when every
    shape measured of it chose one lane."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    compiled, pristine, opts, plan_with = _compile(*_moe())
    graph_opts = dataclasses.replace(opts.for_graph("inference", True), pick_cache_dir=str(tmp_path))
    monkeypatch.setattr(dynamo, "cuda_device", lambda examples: torch.device("cuda", 0))
    monkeypatch.setattr(choices, "device_name", lambda device: "FakeGPU sm90")
    args = [torch.randn(16, 64), *_moe()[1][1:]]
    other = [torch.randn(8, 64), *args[1:]]
    dynamic = [args[0], FakeTensorMode(shape_env=ShapeEnv()).shape_env.create_unbacked_symint(), *args[1:]]
    hint_key, hinted = dynamo._cached_choice("inference", pristine, graph_opts, args)
    assert hint_key == candidates.graph_key(pristine, graph_opts, ()) and hinted is None
    assert dynamo._cached_choice("inference", pristine, graph_opts, dynamic) == (hint_key, None)
    p = dynamo._picker("inference", compiled, pristine, graph_opts, plan_with, None, None, on_cuda=True,
                       hint_key=hint_key)
    us = {"model": 30.0, "one_lane": 25.0, "aux1": 40.0}
    p.measure_round = lambda caps, order: [us[caps[i].name] / 1e6 for i in order]
    p.device_name = choices.device_name
    p.capture(FakeExecutor(), args, real=True)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert dynamo._cached_choice("inference", pristine, graph_opts, args) == (hint_key, "one_lane")
        assert dynamo._cached_choice("inference", pristine, graph_opts, dynamic) == (hint_key, "one_lane")
    messages = [r.getMessage() for r in caplog.records]
    assert any("schedule one_lane from the schedule cache" in m for m in messages), messages
    assert any("every shape earlier processes measured of it (1) chose one_lane" in m for m in messages), messages
    assert dynamo._cached_choice("inference", pristine, graph_opts, other) == (hint_key, None)
    # A second shape that kept the cost model's lanes: the symbolic graph measures again.
    us["model"] = 10.0
    p.capture(FakeExecutor(), other, real=True)
    summary = ScheduleCache(tmp_path).get(ScheduleCache.graph_summary_key("FakeGPU sm90", hint_key))
    assert summary["choice"] == choices.MIXED and summary["record"]["shapes"] == {
        choices.shape_text(args): "one_lane", choices.shape_text(other): "model"}
    assert dynamo._cached_choice("inference", pristine, graph_opts, other) == (hint_key, "model")
    assert dynamo._cached_choice("inference", pristine, graph_opts, dynamic) == (hint_key, None)
    # Each shape where both the lanes and one lane were measured is a lane sample of the device:
    # 30/25 measured against 18.09/34.0 estimated, then 10/25 against the same.
    from capturepass.runtime.calibration import CalibrationStore

    assert CalibrationStore(tmp_path).lane_factor("FakeGPU sm90") == pytest.approx(
        ((30 / 25) / (18.09 / 34.0) + (10 / 25) / (18.09 / 34.0)) / 2, rel=1e-3)
    # A shape served from the cache is summed up too (a summary lost to two processes writing it).
    os.remove(ScheduleCache(tmp_path).path(ScheduleCache.graph_summary_key("FakeGPU sm90", hint_key)))
    p.capture(FakeExecutor(), args, real=True)
    assert p.records[-1].cached
    assert dynamo._cached_choice("inference", pristine, graph_opts, dynamic) == (hint_key, "one_lane")
    # Nothing is measured with pick="model", or without a pristine copy (nothing captured).
    assert dynamo._cached_choice("inference", pristine, dataclasses.replace(graph_opts, pick="model"), args) == (None, None)
    assert dynamo._cached_choice("inference", None, graph_opts, args) == (None, None)


def test_lanes_predicted_no_faster_than_one_lane_compile_one_lane_alone(tmp_path, monkeypatch, caplog):
    """With ``pick_predict`` on, once the device has lane samples, a graph whose estimated lanes,
    times the device's lane factor, are no faster than one lane is compiled with one lane and not
    measured; below 1 its lanes are compiled and measured as before. The MoE block's lanes:
    18.09 us against 34.17 on one stream (0.530)."""
    from capturepass.runtime.calibration import CalibrationStore

    monkeypatch.setattr(dynamo, "cuda_device", lambda examples: torch.device("cuda", 0))
    monkeypatch.setattr(choices, "device_name", lambda device: "FakeGPU sm90")
    compiled, pristine, opts, plan_with = _compile(*_moe())
    graph_opts = dataclasses.replace(opts.for_graph("inference", True), pick_cache_dir=str(tmp_path),
                                     pick_predict=True)
    args = [torch.randn(16, 64), *_moe()[1][1:]]
    assert candidates.estimated_lane_ratio(compiled.graph) == pytest.approx(18.09 / 34.17, rel=1e-3)
    assert dynamo._lanes_predicted_slower("inference", plan_with, graph_opts, args) is None  # no sample yet
    store = CalibrationStore(tmp_path)
    store.add_lanes("FakeGPU sm90", "g0", 0.6, 0.9)  # factor 1.5: 0.530 x 1.5 = 0.79, the lanes may pay
    assert dynamo._lanes_predicted_slower("inference", plan_with, graph_opts, args) is None
    store.add_lanes("FakeGPU sm90", "g1", 0.4, 1.0)  # factor 2.0: 1.06
    with caplog.at_level(logging.INFO, logger="capturepass"):
        why = dynamo._lanes_predicted_slower("inference", plan_with, graph_opts, args)
    assert why == ("lanes predicted no faster than one lane on this device (cost model 0.530 x lane factor 2.000 "
                   "= 1.059): compiled with one lane, not measured")
    assert any(r.getMessage() == f"capturepass: inference graph: 3 lanes {why}" for r in caplog.records)
    for off in ({"pick": "model"}, {"pick_predict": False}):
        assert dynamo._lanes_predicted_slower("inference", plan_with, dataclasses.replace(graph_opts, **off),
                                              args) is None, off


def test_choice_goes_into_the_graph_record_the_dump_and_show(tmp_path, capsys):
    compiled, pristine, opts, plan_with = _compile(*_moe())
    folder = tmp_path / "dump" / "000_inference"
    folder.mkdir(parents=True)
    (folder / "graph.json").write_text(__import__("capturepass.ir.printer", fromlist=["x"]).dumps_json(compiled.graph))
    p = dynamo._picker("inference", compiled, pristine, opts.for_graph("inference", True), plan_with, None,
                       str(folder), on_cuda=True)
    p.cache = ScheduleCache(tmp_path / "cache")
    us = {"model": 30.0, "one_lane": 25.0, "aux1": 40.0}
    p.measure_round = lambda caps, order: [us[caps[i].name] / 1e6 for i in order]
    p.per_sample = 1  # the fake's sample is one replay
    p.device_name = lambda d: "FakeGPU sm90"
    p.capture(FakeExecutor({"model": 64 << 20, "one_lane": 32 << 20, "aux1": 64 << 20}), [torch.randn(16, 64)],
              real=True)
    text = meta.graph_info(compiled.graph).decisions[-1]
    assert text.startswith("schedule for (float32[16, 64]) on FakeGPU sm90: one_lane (1 lane(s)), measured fastest")
    assert "model 3 lane(s): estimate 18.09 us, measured 30.0 us, cuBLAS workspaces 64 MiB; one_lane 1 lane(s): " \
           "estimate 34.0 us, measured 25.0 us, cuBLAS workspaces 32 MiB; aux1 2 lane(s): estimate 22.1 us, " \
           "measured 40.0 us, cuBLAS workspaces 64 MiB; cost model scale (one lane, measured/estimate) 0.74" in text
    doc = json.loads((folder / choices.PICKS_FILE).read_text())
    assert [e["choice"] for e in doc["picks"]] == ["one_lane"]
    # show: the plain line and the JSON decision with each candidate's estimate against its measurement.
    assert cli.main(["show", str(tmp_path / "dump")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  pick: {text}" in lines
    assert cli.main(["show", str(tmp_path / "dump"), "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    (d,) = [d for d in graph["decisions"] if d["kind"] == "pick"]
    assert {k: d[k] for k in ("shape", "device", "choice", "cached", "rounds", "replays", "scale")} == {
        "shape": "(float32[16, 64])", "device": "FakeGPU sm90", "choice": "one_lane", "cached": False,
        "rounds": 25, "replays": 81, "scale": 0.7353}
    assert [(c["name"], c["lanes"], c["estimate_us"], c["measured_us"], c["workspace_mib"])
            for c in d["candidates"]] == [
        ("model", 3, 18.09, 30.0, 64.0), ("one_lane", 1, 34.0, 25.0, 32.0), ("aux1", 2, 22.1, 40.0, 64.0)]
    assert d["text"] == f"pick: {text}"


def test_malformed_schedules_file_names_the_field(tmp_path):
    (tmp_path / choices.PICKS_FILE).write_text(json.dumps({"picks": [{"graph": "inference", "shape": "()",
                                                                   "device": "x", "choice": "a", "cached": False,
                                                                   "rounds": "many"}]}))
    with pytest.raises(DumpError, match=r"picks\[0\]\.rounds: expected int, got 'many'"):
        show_summary.pick_decisions(str(tmp_path))
    cand = {"name": "a", "lanes": 1, "estimate_us": 1.0, "measured_us": 2.0, "workspace_mib": "32 MiB"}
    (tmp_path / choices.PICKS_FILE).write_text(json.dumps({"picks": [{"graph": "inference", "shape": "()",
                                                                   "device": "x", "choice": "a", "cached": False,
                                                                   "rounds": 1, "replays": 2, "candidates": [cand]}]}))
    with pytest.raises(DumpError, match=r"picks\[0\]\.candidates\[0\]\.workspace_mib: expected a finite number"):
        show_summary.pick_decisions(str(tmp_path))
    cand = {"name": "a", "lanes": 1, "estimate_us": 1.0, "measured_us": 2.0}
    for field, value, message in (("fastest_us", None, r"candidates\[0\]\.fastest_us: expected a finite number"),
                                  ("unsteady", "a", r"picks\[0\]\.unsteady: expected a list of candidate names")):
        entry = {"graph": "inference", "shape": "()", "device": "x", "choice": "a", "cached": False, "rounds": 3,
                 "replays": 9, "candidates": [dict(cand, fastest_us="fast") if value is None else cand]}
        if value is not None:
            entry[field] = value
        (tmp_path / choices.PICKS_FILE).write_text(json.dumps({"picks": [entry]}))
        with pytest.raises(DumpError, match=message):
            show_summary.pick_decisions(str(tmp_path))
    # A record of an older format (no fastest sample, no unsteady list) still reads.
    (tmp_path / choices.PICKS_FILE).write_text(json.dumps({"picks": [{
        "graph": "inference", "shape": "()", "device": "x", "choice": "a", "cached": False, "rounds": 3,
        "replays": 9, "candidates": [cand]}]}))
    (read,) = show_summary.pick_decisions(str(tmp_path))
    assert read["unsteady"] == [] and read["text"].endswith("a 1 lane(s): estimate 1.0 us, measured 2.0 us")
    (tmp_path / choices.PICKS_FILE).write_text("[1]")
    with pytest.raises(DumpError, match="cannot be read"):
        show_summary.pick_decisions(str(tmp_path))


def test_the_executor_hands_the_picker_its_parameters_positions():
    """What the executor passes the picker knows the parameters (the record leaves them out)."""
    import types

    from capturepass.runtime.executor import Executor

    def fn(x, w):
        return (torch.relu(x @ w),)

    gm = aten_graph(fn, torch.randn(4, 8), torch.randn(8, 8), static_inputs=(1,))
    program = compile_graph(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"],
                            {"inner": "eager"}, record=False).program
    seen = []

    class Picker:
        def for_program(self, program):
            return self

        def capture(self, executor, args, real, protect, device):
            seen.append((executor.static_positions, choices.shape_text(args, executor.static_positions)))
            return types.SimpleNamespace(owner=None), ("out",)

    ex = Executor(program, picker=Picker())
    try:
        args = [torch.randn(4, 8), torch.randn(8, 8)]
        assert ex._pick_new(args, (ex._instance(args), ()), real=True)[1] == ("out",)
    finally:
        ex._captures.clear()
        ex.close()
    assert seen == [((1,), "(float32[4, 8])")]


@pytest.mark.parametrize("cpp_check", [False, True])
def test_a_model_instance_is_its_parameters_addresses(monkeypatch, cpp_check):
    """The instance key, with and without torch's C++ address check (a Python stand-in for it
    where this build lacks it): the same parameters give the same key, a moved one another."""
    from capturepass.runtime import executor as executor_mod
    from capturepass.runtime.executor import Executor

    def equal(tensors, ptrs, indices):  # what torch._C._tensors_data_ptrs_at_indices_equal checks
        return all(tensors[i].data_ptr() == ptrs[i] for i in indices)

    monkeypatch.setattr(executor_mod, "_ptrs_equal", equal if cpp_check else None)
    gm = aten_graph(lambda x, w, b: (torch.relu(x @ w) + b,), torch.randn(4, 8), torch.randn(8, 8), torch.randn(8),
                    static_inputs=(1, 2))
    program = compile_graph(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"],
                            {"inner": "eager"}, record=False).program
    ex = Executor(program)
    try:
        w, b = torch.randn(8, 8), torch.randn(8)
        first = ex._instance([torch.randn(4, 8), w, b])
        assert first == (w.data_ptr(), b.data_ptr())
        assert ex._instance([torch.randn(4, 8), w, b]) == first
        w2 = w.clone()
        assert ex._instance([torch.randn(4, 8), w2, b]) == (w2.data_ptr(), b.data_ptr())
        assert ex._instance([torch.randn(4, 8), w, 3]) == (w.data_ptr(),)  # not a tensor: left out
    finally:
        ex.close()


def test_one_lanes_measured_replay_calibrates_the_devices_cost_model(tmp_path, caplog):
    from capturepass.runtime.calibration import CalibrationStore

    store = CalibrationStore(tmp_path / "cache")
    graph = [(1e-6, 20), (1e-5, 2)]  # 40 us nominal: one lane measured at 60 us
    p, _, picked, _ = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0},
                              calibration=store, rooflines=graph)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    model = store.model("FakeGPU sm90")
    assert model.samples == 1 and model.launch_floor_s == 2e-6
    assert sum(c * max(model.scale * r, 2e-6) for r, c in graph) == pytest.approx(60e-6, rel=0.04)
    assert any(r.getMessage().startswith("capturepass: inference graph, shape (float32[4, 8]): cost model: "
                                         "calibrated on FakeGPU sm90 from 1 measured graph(s)") for r in caplog.records)
    # A choice read from the schedule cache measures nothing, so it adds no sample.
    again, _, _, _ = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0},
                             calibration=store, rooflines=[(1e-6, 1)])
    again.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    assert store.model("FakeGPU sm90") == model


def test_every_candidate_warms_up_before_any_is_captured(tmp_path, caplog):
    """So that all of them warm up while no graph lives in the model's pool; a candidate whose
    capture then fails is left out and released, the others measured."""
    from capturepass.runtime.replay import CaptureFailure

    events = []

    class Recording(FakeExecutor):
        def _warm_program(self, program, args, real, candidate, lane_map=None):
            cap, out = super()._warm_program(program, args, real, candidate)
            name = candidate or "model"
            events.append(("warm", name))
            if name == "aux1":
                cap.failure = CaptureFailure(0, RuntimeError("cannot capture"), None, {}, None)
            cap.capture_warmed = lambda a, c=cap, n=name: (events.append(("capture", n)), FakeCap.capture_warmed(c, a))
            return cap, out

    p, _, picked, cands = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0})
    ex = Recording()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        cap, out = p.capture(ex, [torch.randn(4, 8)], real=True)
    # One lane's own program is captured last (it keeps its outputs: no second capture if chosen).
    assert events == [("warm", "model"), ("warm", "one_lane"), ("warm", "aux1"),
                      ("capture", "model"), ("capture", "aux1"), ("capture", "one_lane")]
    assert picked[0].choice == "one_lane" and cap.program is cands[1].program
    assert [c["note"] for c in picked[0].candidates] == [None, None, "capture failed: RuntimeError"]
    assert any("schedule candidate aux1 failed to capture" in r.getMessage() for r in caplog.records)
