"""The interleaving simulator, and a fuzzer of the whole pipeline built on it.

The fuzzer draws random DAGs of real aten ops with random lane hints and options (the strategy
of ``tests/passes/test_properties.py``), compiles them, and runs each compiled graph in several
seeded adversarial interleavings: every result must equal serial execution, and the
happens-before check must find no unordered pair. ``bench/fuzz_sync.py`` runs the large budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import event, given, settings

from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.testing.simulate import Race, explore, same, seeded_rng, serial, simulate
from tests.passes.cases import CASES, build, world_for
from tests.passes.test_properties import _compile, _inputs, cases

SEEDS = range(12)


def _without(gm, name):
    out = copy.deepcopy(gm)
    out.graph.erase_node(next(n for n in out.graph.nodes if n.name == name))
    out.recompile()
    return out


def _named(gm, effect, why, lane=None):
    """The sync node with ``effect`` whose ``why`` is ``why`` (on lane number ``lane``)."""
    (node,) = [
        n
        for n in gm.graph.nodes
        if meta.effect_of(n) is effect and meta.info(n).why == why and lane in (None, meta.lane_of(n).index)
    ]
    return node.name


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_case_equals_serial_execution_in_every_interleaving(name):
    case = CASES[name]
    gm, _ = build(name, "verify")
    inputs = case.inputs(seed=3)
    with world_for(name):
        report = explore(gm, inputs, SEEDS, replay=True)
        assert report.ok, report.describe()
        # The oracle itself is the traced function (drawing from the generator state serial runs use).
        expected, _ = serial(gm, inputs)
        with seeded_rng():
            direct = case.fn(*inputs)
    assert same(expected, direct) is None


def test_the_emitted_program_is_simulated_through_its_graph():
    case = CASES["fork_join"]
    gm, ctx = build("fork_join", "emit")
    program = ctx.artifacts["program"]
    inputs = case.inputs(seed=4)
    res = simulate(program, inputs, seed=5)
    assert same(res.outputs, case.fn(*inputs)) is None
    assert res.races == []
    assert any(step.startswith("s1:%mm") for step in res.trace)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_emitted_program_equals_serial_execution_in_its_own_host_order(name):
    gm, ctx = build(name, "emit")
    with world_for(name):
        report = explore(ctx.artifacts["program"], CASES[name].inputs(seed=3), SEEDS, replay=True)
    assert report.ok, report.describe()


def test_a_release_step_issued_before_its_lane_catches_up_is_caught_in_program_order():
    """The emitted program frees in its own order (a region is issued when its lane closes it).
    Moving the release of %sin to right after the region that computes it (before %exp, the
    next allocation on main, and before aux reads it) is the kind of mistake emit must not make."""
    gm, ctx = build("deferred_release", "emit")
    program = ctx.artifacts["program"]
    inputs = CASES["deferred_release"].inputs(seed=1)
    assert explore(program, inputs, SEEDS).ok
    steps = program.pieces[0].steps
    release = next(s for s in steps if s.kind == "release")
    steps.remove(release)
    at = next(
        i for i, s in enumerate(steps)
        if s.kind == "region" and any(n.name == "sin" for n in s.payload.graph.graph.nodes if n.op == "call_function")
    )
    steps.insert(at + 1, release)
    report = explore(program, inputs, SEEDS)
    assert report.mismatches, report.describe()
    assert [(r.first, r.second, r.storage) for r in report.races] == [("cos", "exp", "sin")]


def test_a_missing_wait_gives_a_wrong_result_and_names_the_racing_pair():
    gm, _ = build("fork_join", "verify")
    bad = _without(gm, _named(gm, Effect.WAIT, "%mm->%add"))
    report = explore(bad, CASES["fork_join"].inputs(seed=1), SEEDS)
    assert report.mismatches, report.describe()
    assert [(r.first, r.second, r.storage) for r in report.races] == [("mm", "add", "mm")]
    assert "%mm and %add race on the storage of %mm" in str(report.races[0])


def test_a_missing_deferred_release_lets_the_allocator_poison_a_block_still_read():
    gm, _ = build("deferred_release", "verify")
    (release,) = [n for n in gm.graph.nodes if meta.effect_of(n) is Effect.RELEASE]
    good = explore(gm, CASES["deferred_release"].inputs(seed=1), SEEDS)
    assert good.ok, good.describe()
    report = explore(_without(gm, release.name), CASES["deferred_release"].inputs(seed=1), SEEDS)
    assert report.mismatches, report.describe()
    # %sin (main) is freed after %cos (aux) is issued; %exp, the next allocation on main, reuses it.
    assert Race("cos", "exp", "sin", "read-write") in report.races or Race("cos", "exp", "sin", "write-read") in report.races


def test_a_missing_retention_is_seen_by_a_replay():
    gm, _ = build("retention", "verify")
    (retain,) = [n for n in gm.graph.nodes if meta.effect_of(n) is Effect.RETAIN]
    bad = copy.deepcopy(gm)
    node = next(n for n in bad.graph.nodes if n.name == retain.name)
    node.args = ([], node.args[1])
    inputs = CASES["retention"].inputs(seed=1)
    assert explore(gm, inputs, SEEDS, replay=True).ok
    assert explore(bad, inputs, SEEDS, replay=True).mismatches


def test_a_missing_join_of_a_capture_is_reported():
    gm, _ = build("host_break", "verify")
    join = _named(gm, Effect.WAIT, "join k0")
    report = explore(_without(gm, join), CASES["host_break"].inputs(seed=1), SEEDS)
    assert Race("cos", "end of capture k0", "", "capture") in report.races, report.describe()


def test_a_serialized_op_overlapping_another_lane_is_reported():
    gm, _ = build("serialized", "verify")
    wait = _named(gm, Effect.WAIT, "serialize %opaque", lane=0)
    report = explore(_without(gm, wait), CASES["serialized"].inputs(seed=1), SEEDS)
    assert [(r.first, r.second, r.kind) for r in report.races] == [("cos", "opaque", "serialize")]


def test_seeds_give_different_interleavings():
    gm, _ = build("two_joins", "verify")
    traces = {tuple(simulate(gm, CASES["two_joins"].inputs(), seed).trace) for seed in range(12)}
    assert len(traces) > 1


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_random_graphs_equal_serial_execution_in_adversarial_interleavings(case):
    gm, _ = _compile(case, upto="verify")
    inputs = _inputs(case, salt=2)
    report = explore(gm, inputs, range(8), replay=True)
    assert report.ok, report.describe()
    lanes = len(meta.graph_info(gm).lanes)
    event(f"lanes: {lanes}")
    event(f"reused blocks: {'0' if report.reused == 0 else '1+'}")


def test_poison_is_visible_in_every_dtype():
    from capturepass.testing.simulate.memory import _poison

    for dtype in (torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool):
        t = torch.zeros(3, dtype=dtype)
        before = t.clone()
        _poison(t)
        assert not torch.equal(t, before), dtype


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_random_emitted_programs_equal_serial_execution(case):
    _, ctx = _compile(case, upto="emit")
    report = explore(ctx.artifacts["program"], _inputs(case, salt=4), range(6), replay=True)
    assert report.ok, report.describe()
