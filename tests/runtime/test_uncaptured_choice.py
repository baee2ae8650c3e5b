"""The measured choice of uncaptured calls between the cost model's lanes and one stream.

On the CPU there are no streams to choose between, so :class:`UncapturedChoice` runs here with
fake programs (each "runs" for a fixed time on an injected clock) and a fake device
synchronisation that counts: every count and choice below is exact. The executor's use of it on
a GPU is ``tests/runtime/test_uncaptured_choice_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from capturepass.runtime import choices, uncaptured
from capturepass.runtime.uncaptured import MODEL, ONE_STREAM, SAMPLES, UncapturedChoice
from capturepass.show import summary as show_summary


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Harness:
    """Two fake programs with fixed call times (microseconds), the calls they ran and the syncs."""

    def __init__(self, model_us: float, one_us: float, **kwargs) -> None:
        self.clock = _Clock()
        self.ran: list[str] = []
        self.syncs = 0
        self.us = {MODEL: model_us, ONE_STREAM: one_us}
        self.records: list[choices.PickRecord] = []

        def sync() -> None:
            self.syncs += 1

        self.choice = UncapturedChoice("inference graph g1", {MODEL: MODEL, ONE_STREAM: ONE_STREAM}, 3,
                                       torch.device("cuda", 0), on_choice=self.records.append,
                                       shape_of=lambda args: choices.shape_text(args), sync=sync,
                                       clock=self.clock, **kwargs)
        self.choice.device = torch.device("cpu")  # device_name() reads no CUDA device

    def run(self, program: str) -> tuple[str, int]:
        self.ran.append(program)
        self.clock.now += self.us[program] / 1e6
        return program, len(self.ran)

    def call(self, key, args=(torch.zeros(2, 3),)):
        return self.choice.call(key, list(args), self.run)


def test_first_calls_warm_each_schedule_then_alternate_timed_then_keep_the_faster():
    h = _Harness(model_us=1500.0, one_us=1000.0)
    outs = [h.call("s") for _ in range(2 + 2 * SAMPLES)]
    # Every call's own results come back, timed or not.
    assert outs == [(p, i + 1) for i, p in enumerate(h.ran)]
    assert h.ran == [ONE_STREAM, MODEL] + [MODEL, ONE_STREAM] * SAMPLES
    assert h.syncs == 2 * 2 * SAMPLES  # before and after each timed call, none for the warm ones
    assert h.choice.chosen == {"s": ONE_STREAM}
    for _ in range(3):
        h.call("s")
    assert h.ran[-3:] == [ONE_STREAM] * 3 and h.syncs == 2 * 2 * SAMPLES
    [record] = h.records
    assert record.uncaptured and record.choice == ONE_STREAM and record.rounds == SAMPLES
    assert record.replays == 2 + 2 * SAMPLES
    assert [(c["name"], c["lanes"], c["measured_us"]) for c in record.candidates] == [
        (MODEL, 3, 1500.0), (ONE_STREAM, 1, 1000.0)]


@pytest.mark.parametrize("model_us, chosen", [
    (970.0, MODEL),  # 3% faster: the lanes pay for themselves
    (985.0, ONE_STREAM),  # 1.5% faster: within the tie, one stream (no events, no side streams)
    (1000.0, ONE_STREAM),
    (1300.0, ONE_STREAM),
])
def test_the_lanes_are_kept_only_when_faster_by_more_than_the_tie(model_us, chosen):
    h = _Harness(model_us=model_us, one_us=1000.0)
    for _ in range(2 + 2 * SAMPLES):
        h.call(("s",))
    assert h.choice.chosen == {("s",): chosen}
    assert h.records[0].choice == chosen


def test_each_shape_is_measured_and_chosen_on_its_own():
    h = _Harness(model_us=800.0, one_us=1000.0)
    for _ in range(2 + 2 * SAMPLES):
        h.call("decode")
        h.call("prefill")
    assert h.choice.chosen == {"decode": MODEL, "prefill": MODEL}
    assert len(h.records) == 2


def test_a_shape_seen_once_runs_one_stream_untimed():
    h = _Harness(model_us=800.0, one_us=1000.0)
    for n in range(5):
        h.call(("prefill", n))
    assert h.ran == [ONE_STREAM] * 5 and h.syncs == 0 and not h.records


def test_shapes_being_measured_and_shapes_chosen_are_bounded(monkeypatch):
    monkeypatch.setattr(uncaptured, "MAX_SHAPES", 2)
    h = _Harness(model_us=800.0, one_us=1000.0)
    for key in ("a", "b", "c"):
        h.call(key)
    assert list(h.choice._trials) == ["b", "c"]
    for key in ("d", "e", "f"):
        for _ in range(2 + 2 * SAMPLES):
            h.call(key)
    assert list(h.choice.chosen) == ["e", "f"]


def test_the_choice_is_logged_and_reads_back_through_show(tmp_path, caplog):
    h = _Harness(model_us=1234.5, one_us=1000.0)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(2 + 2 * SAMPLES):
            h.call("s", (torch.zeros(8, 1, dtype=torch.long),))
    [record] = h.records
    text = record.text()
    assert text == (f"uncaptured calls of (int64[8, 1]) on cpu: one_stream (1 lane(s)), measured fastest "
                    f"({SAMPLES} synchronised call(s) each, {2 + 2 * SAMPLES} calls); model 3 lane(s): measured "
                    "1234.5 us; one_stream 1 lane(s): measured 1000.0 us")
    assert f"capturepass: inference graph g1: {text}" in caplog.messages
    choices.append_record(str(tmp_path), record)
    [entry] = show_summary.pick_decisions(str(tmp_path))
    assert entry["uncaptured"] is True and entry["text"] == f"pick: {text}"


def test_a_captured_choice_reads_as_before():
    record = choices.PickRecord("inference", "()", "gpu", "model", False, 5.0, 1, 5,
                                [{"name": "model", "lanes": 2, "estimate_us": 1.0, "measured_us": 1.0}])
    assert "uncaptured" not in record.to_json()
    assert record.text().startswith("schedule for () on gpu: model (2 lane(s))")


def test_past_its_choices_an_owner_runs_new_shapes_as_most_chose(monkeypatch, caplog):
    monkeypatch.setattr(uncaptured, "MAX_MEASURED", 3)
    h = _Harness(model_us=800.0, one_us=1000.0)
    for key in ("a", "b", "c"):
        for _ in range(2 + 2 * SAMPLES):
            h.call(key)
    syncs, ran = h.syncs, len(h.ran)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(2 + 2 * SAMPLES):
            h.call("d")
        h.call("e")
    assert h.ran[ran:] == [MODEL] * (3 + 2 * SAMPLES) and h.syncs == syncs and len(h.records) == 3
    # Kept as chosen, unmeasured: their next calls take the executor's short path.
    assert h.choice.chosen["d"] == h.choice.chosen["e"] == MODEL
    assert [m for m in caplog.messages if "measured" in m] == [
        "capturepass: inference graph g1: 3 shapes of its uncaptured calls measured; new shapes run model from "
        "now on (what 3 of them chose), unmeasured"]
