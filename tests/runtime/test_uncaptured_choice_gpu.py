"""The measured choice of uncaptured calls on a real GPU: lanes or one stream, per shape.

Every test here is marked ``gpu`` and skipped without CUDA. The choice's own rules (order of the
calls, timing, the tie, bounds) are ``tests/runtime/test_uncaptured_choice.py``; here the
executor runs it on real streams: every call equals eager, measuring or not, a graph that
writes its inputs runs each call once, and the choice reaches the record and the dump.
"""

from __future__ import annotations

import pytest
import torch

from capturepass.backends.compile import last_compiled
from capturepass.runtime.uncaptured import MODEL, ONE_STREAM, SAMPLES
from capturepass.show import summary as show_summary
from capturepass.testing.models import MoEBlock

pytestmark = pytest.mark.gpu

BF16 = dict(atol=3e-2, rtol=3e-2)
MEASURING = 2 + 2 * SAMPLES  # the calls of a shape until its choice


def _executor():
    return [g for g in last_compiled() if g.name == "inference"][-1].executor


@torch.no_grad()
def test_uncaptured_calls_measure_lanes_against_one_stream_then_keep_one(tmp_path):
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass",
                             options={"cudagraphs": "none", "dump_dir": str(tmp_path), "verify": True})
    for _ in range(MEASURING + 3):
        x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), model(x), **BF16)
    ex = _executor()
    (rec,) = ex._eager_owners.values()
    assert len(rec.owner.side_streams) >= 1
    (record,) = ex.schedule_choices
    assert record.uncaptured and record.replays == MEASURING
    assert [c["name"] for c in record.candidates] == [MODEL, ONE_STREAM]
    assert all(c["measured_us"] > 0 for c in record.candidates)
    (chosen,) = rec.choice.chosen.values()
    assert chosen is rec.choice.programs[record.choice]
    (folder,) = tmp_path.glob("*_inference")
    (entry,) = [e for e in show_summary.pick_decisions(str(folder)) if e.get("uncaptured")]
    assert entry["choice"] == record.choice


@torch.no_grad()
def test_each_shape_chooses_and_a_new_shape_still_equals_eager():
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True, options={"cudagraphs": "none"})
    for tokens in (8, 24):
        for _ in range(MEASURING):
            x = torch.randn(tokens, 256, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    x = torch.randn(40, 256, device="cuda")
    torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    (rec,) = _executor()._eager_owners.values()
    assert len(rec.choice.chosen) == 2 and len(rec.choice.records) == 2


class _Counting(torch.nn.Module):
    """An MoE block (its shared expert on a side lane) and a buffer written in place at every
    call: a call run twice would count twice."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoEBlock(256, 512, 4, 128, 2, device="cuda")
        self.register_buffer("calls", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.calls.add_(1)
        return self.moe(x)


@torch.no_grad()
def test_measuring_runs_each_call_once_on_a_graph_that_writes_its_inputs():
    torch.manual_seed(0)
    model = _Counting()
    compiled = torch.compile(model, backend="capturepass", options={"cudagraphs": "none"})
    for n in range(1, MEASURING + 3):
        x = torch.randn(16, 256, device="cuda")
        torch.testing.assert_close(compiled(x), model.moe(x), atol=1e-4, rtol=1e-4)
        assert model.calls.item() == n
    (rec,) = _executor()._eager_owners.values()
    assert rec.owner.side_streams and len(rec.choice.records) == 1


@torch.no_grad()
def test_pick_model_keeps_the_lanes_on_every_uncaptured_call():
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", options={"cudagraphs": "none", "pick": "model"})
    for _ in range(MEASURING + 1):
        x = torch.randn(16, 256, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    ex = _executor()
    (rec,) = ex._eager_owners.values()
    assert rec.choice is None and ex.schedule_choices == []
    assert len(rec.owner.side_streams) >= 1
