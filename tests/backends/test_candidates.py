"""Schedule candidates (``backends.candidates``): what the measured choice captures and times.

Candidate counts, derived by hand from the cost model (a nominal H200; every kernel
at least the 2 us launch floor):

- the showcase MoE block at its CPU size: the scheduler uses 3 lanes (busy 8, 18 and
  8 us); no lane is below 20% of the busiest (3.6 us), so there is no merged variant:
  ``model`` (3 lanes), ``one_lane``, ``aux1`` (2 lanes);
- a chain of four 2048-wide matmuls with a one-matmul branch and a 2-kernel branch:
  3 lanes busy 141.5, 51.9 and 4.0 us; the 4 us lane is below 20% of 141.5 us, so
  ``merged`` exists and differs from ``aux1`` (which reschedules both branches on
  one lane): 4 candidates;
- the chain with only the tiny branch: 2 lanes; merging its short lane is one lane,
  the same assignment as ``one_lane``: 2 candidates.

The picker that measures them is ``tests/runtime/test_pick.py``.
"""

from __future__ import annotations

import torch

from capturepass.backends import candidates
from capturepass.backends.compile import compile_regions
from tests.helpers import candidates_of as _compile, moe_block_fn as _moe

N = 2048


def _chain(x, w, v):
    a = torch.relu(x @ w)
    a = torch.relu(a @ w)
    a = torch.relu(a @ w)
    a = torch.relu(a @ w)
    b = torch.tanh((x @ v) @ v.t())  # a branch of two matmuls
    c = torch.sigmoid(x[:, :4]).sum()  # a tiny branch
    return a + b + c


def _chain_tiny(x, w):
    a = torch.relu(x @ w)
    a = torch.relu(a @ w)
    a = torch.relu(a @ w)
    c = torch.sigmoid(x[:, :4]).sum()
    return a + c


def _derive(fn, inputs, **options):
    compiled, _, opts, plan_with = _compile(fn, inputs, **options)
    return candidates.derive(compiled.graph, compiled.plan, compiled.program, opts, plan_with, compile_regions)


def _summary(cands):
    return [(c.name, c.lanes, c.compiled) for c in cands]


def test_moe_block_candidates_one_lane_compiled_lazily_the_others_lane_maps():
    """``one_lane`` is a program of its own, compiled on first use; ``aux1`` runs the cost
    model's program with its lanes merged (the busiest aux lane kept, the other on the main one)."""
    cands = _derive(*_moe())
    assert _summary(cands) == [("model", 3, True), ("one_lane", 1, False), ("aux1", 2, True)]
    assert [c.overrides for c in cands] == [{}, {"policy": "off", "max_aux_lanes": 0}, {}]
    assert [c.lane_map for c in cands] == [None, None, (0, 1, 0)]
    assert [round(c.estimate_us, 2) for c in cands] == [18.09, 34.0, 22.1]
    assert cands[2].program is cands[0].program
    program = cands[1].program  # compiled on first use, once
    assert cands[1].compiled and cands[1].program is program
    assert len(program.info.lanes) == 1


def test_lane_maps_keep_the_busiest_lanes_and_merge_the_short_ones():
    """On a chain with a two-matmul branch (lane 1) and a tiny one (lane 2): ``aux1`` keeps lane 1,
    ``merged`` puts the tiny lane on the main stream (the same map: one candidate)."""
    w = torch.randn(N, N)
    compiled, _, opts, _ = _compile(_chain, (torch.randn(N, N), w, torch.randn(N, N)))
    busy = candidates.lane_busy_us(compiled.graph)
    assert busy[1] > candidates.SHORT_FRACTION * max(busy.values()) > busy[2], busy
    assert candidates.lane_maps(compiled.graph, opts) == [("aux1", (0, 1, 0)), ("merged", (0, 1, 0))]
    cands = _derive(_chain, (torch.randn(N, N), w, torch.randn(N, N)))
    assert _summary(cands) == [("model", 3, True), ("one_lane", 1, False), ("aux1", 2, True)]
    # Lanes merged share a clock: the estimate of a map lies between the model's and one stream's.
    assert cands[0].estimate_us < cands[2].estimate_us < candidates.estimate_us(cands[0].graph, (0, 0, 0))


def test_identical_assignments_are_one_candidate():
    """Merging the only (short) aux lane would put every kernel on the main stream: no lane map
    (``one_lane``'s own program is that schedule, without the lanes' fusion barriers)."""
    compiled, _, opts, _ = _compile(_chain_tiny, (torch.randn(N, N), torch.randn(N, N)))
    assert [name for name, _ in candidates.variants(compiled.graph)] == ["one_lane"]
    assert candidates.lane_maps(compiled.graph, opts) == []
    cands = _derive(_chain_tiny, (torch.randn(N, N), torch.randn(N, N)))
    assert _summary(cands) == [("model", 2, True), ("one_lane", 1, False)]


def test_one_lane_graph_has_no_alternative():
    cands = _derive(*_moe(), policy="off")
    assert _summary(cands) == [("model", 1, True)]


def test_graph_key_is_stable_and_changes_with_graph_and_options():
    f, inputs = _moe()
    a, pa, oa, _ = _compile(f, inputs)
    b, pb, ob, _ = _compile(f, inputs)
    names = [candidates.Candidate(n, {}, 1, 0.0, None, None) for n in ("model", "one_lane")]
    assert candidates.graph_key(pa, oa, names) == candidates.graph_key(pb, ob, names)
    assert candidates.graph_key(pa, oa, names, breaks=["mm"]) != candidates.graph_key(pa, oa, names)
    # The same names as lanes after fusion: another route's measured choice says nothing of them.
    fused = [candidates.Candidate(n, {}, 1, 0.0, None, None, fused=True) for n in ("model", "one_lane")]
    assert candidates.graph_key(pa, oa, fused) != candidates.graph_key(pa, oa, names)
    _, pc, oc, _ = _compile(f, inputs, max_aux_lanes=1)
    assert candidates.graph_key(pa, oa, names) != candidates.graph_key(pc, oc, names)
    _, pd, od, _ = _compile(_chain_tiny, (torch.randn(8, 8), torch.randn(8, 8)))
    assert candidates.graph_key(pa, oa, names) != candidates.graph_key(pd, od, names)


def test_a_candidate_inductor_refuses_at_compile_time_is_left_out_not_the_compile(monkeypatch, caplog, tmp_path):
    """The candidates with programs of their own are compiled inside the compile; one the inner
    compiler refuses is left out, logged, and the others are measured. ``one_lane`` is one
    region, whose error comes as the compiler's own (Inductor's ``InductorError``, one of
    Dynamo's formatted errors), not as capturepass's ``EmitError``."""
    import inspect

    from torch._inductor.exc import InductorError

    from capturepass.backends import compile as driver
    from capturepass.backends import dynamo
    from capturepass.ir import meta

    compiled, pristine, opts, plan_with = _compile(*_moe(), pick_cache_dir=str(tmp_path))
    real = driver.compile_regions

    def refuses_one_lane(plan, **kwargs):
        if len(meta.graph_info(plan.graph).lanes) == 1:
            raise InductorError(ValueError("simulated: the argument '-((0))' is not comparable."),
                                inspect.currentframe())
        return real(plan, **kwargs)

    monkeypatch.setattr(driver, "compile_regions", refuses_one_lane)
    with caplog.at_level("WARNING", logger="capturepass"):
        picker = dynamo._picker("inference", compiled, pristine, opts, plan_with, None, None, on_cuda=True)
    assert "schedule candidate one_lane failed to compile (ValueError: simulated" in caplog.text, caplog.text
    assert [c.name for c in picker.candidates] == ["model", "aux1"]
