"""The parallel MoE blocks on two GPUs joined by NCCL, captured in CUDA graphs, equal to the references.

One run per capture mode (``monolithic``, ``breakable``; a module fixture) spawns two processes,
rank ``r`` on GPU ``r`` (``capturepass.testing.parallel.check_blocks`` with ``device="cuda"``),
that each compile three models with ``torch.compile(backend="capturepass")`` and Inductor:
the tensor-parallel block (``tp``, with ``max_aux_lanes=0``), the expert-parallel block
(``ep``) and a second tensor-parallel model instance written with in-place
``dist.all_reduce`` (``draft``). Each is called with 8 tokens (captured), 8 new ones (a replay
of that capture) and 5 (a second graph, captured). Every output must equal the ranks'
computation redone in one process in their op order, and the full single-GPU block computed
from the same weights, within torch's float32 tolerance (Inductor's fused kernels round
differently from eager's, and the full block sums the shared expert's down projection at once
where tensor parallelism sums two halves).

Marked ``gpu``; skipped without two CUDA devices and NCCL.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from capturepass.testing import parallel

_REASON = parallel.nccl_unavailable(2)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

TOKENS = (8, 8, 5)
MODELS = ("draft", "ep", "tp")
COLLECTIVES_PER_CALL = 2  # two all-reduces (tp, draft), two all-to-alls (ep)


@pytest.fixture(scope="module", params=["monolithic", "breakable"])
def run(request, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp(f"nccl-{request.param}")
    parallel.spawn_ranks(parallel.check_blocks, 2, str(out), {"cudagraphs": request.param},
                        {"tp": {"max_aux_lanes": 0}}, TOKENS, False, "cuda", 300, timeout=420)
    return out


def _report(run: pathlib.Path, rank: int) -> dict:
    return json.loads((run / f"rank{rank}.json").read_text())


def test_every_call_replays_a_capture_and_equals_the_references(run):
    for rank in range(2):
        report = _report(run, rank)
        assert sorted(report["errors"]) == list(MODELS)
        for model, calls in report["errors"].items():
            # Checked in the workers too (assert_close with the float32 tolerance).
            assert len(calls) == len(TOKENS)
            assert all(c["same_order"] <= 1e-5 and c["full"] <= 1e-5 for c in calls), (rank, model, calls)
        # One capture per shape (8 and 5 tokens): the second call with 8 tokens replayed the first.
        assert report["captures"] == {model: 2 for model in MODELS}, report["captures"]


def test_each_owner_posts_on_its_own_process_group(run):
    reports = [_report(run, r) for r in range(2)]
    for report in reports:
        names = [name for model in MODELS for ch in report["communicators"][model].values() for name in ch.values()]
        assert names and len(set(names)) == len(names) and "0" not in names, report["communicators"]
        for model in MODELS:
            keys = report["communicators"][model]
            assert keys and all(re.fullmatch(r"g\d+\.m\d+/s1", k) for k in keys), keys
            assert all(list(ch) == ["0"] for ch in keys.values())
        assert set(report["ranks"]) == set(names) and all(r == [0, 1] for r in report["ranks"].values())
        if report["world_posted"] is not None:
            # The graphs were traced with the world group; they posted nothing on it.
            assert report["world_posted"] == 0
    # Released by capturepass.release before the world went: none left.
    assert all(report["released"] == [] for report in reports)
    # Every rank makes its groups in the same order: the same names on both.
    assert reports[0]["communicators"] == reports[1]["communicators"]


def test_both_ranks_schedule_alike(run):
    for model in MODELS:
        dumps = [[parallel.schedule_lines(p.read_text()) for p in sorted((run / f"rank{r}" / model).glob("*/009_verify.txt"))]
                 for r in range(2)]
        assert len(dumps[0]) == 2 and dumps[0] == dumps[1]
