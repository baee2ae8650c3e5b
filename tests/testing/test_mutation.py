"""Mutation testing, the CI version: every single removal of an inserted guarantee is caught.

The corpus is every graph of ``tests/passes/cases.py`` plus random graphs of the property-test
strategy. Each wait, record, deferred release, retained value or resource and lease scope is
removed one at a time (``capturepass.testing.mutate``); the verifier must reject every mutant.
The simulator catches what it can observe; on the curated cases its figures are pinned, so that a
weaker simulator fails here. ``bench/fuzz_sync.py --mutation`` runs the large corpus.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings

from capturepass.testing.mutate import KINDS, Mutant, apply, judge, mutants, score
from capturepass.ir.verify import verify
from tests.passes.cases import CASES, build, fused_declared, world_for
from tests.passes.test_properties import _compile, _inputs, cases


def _runnable() -> list[str]:
    """The cases this torch can run: those with collectives need gloo (a one-rank world)."""
    from capturepass.testing import parallel

    gloo = parallel.gloo_unavailable() is None
    return [name for name in sorted(CASES) if gloo or not CASES[name].needs_world]


def _corpus():
    return [(build(name, "verify")[0], CASES[name].inputs(seed=1)) for name in _runnable()]


@pytest.fixture(scope="module")
def case_score():
    corpus = _corpus()
    # The resources case's op keeps its workspace while judged; the collective case's all-reduce
    # runs on a one-rank world.
    with fused_declared(), world_for(*_runnable()):
        return score(corpus, seeds=range(12))


def test_the_verifier_rejects_every_mutant_of_the_cases(case_score):
    rows = case_score.by_kind()
    assert set(rows) == set(KINDS), rows  # every kind of removal occurs in the corpus
    assert case_score.escaped == [], [str(o.mutant) for o in case_score.escaped]


def test_the_simulator_catches_every_removed_wait_record_and_lease_of_the_cases(case_score):
    for o in case_score.outcomes:
        if o.mutant.kind in ("wait", "record", "lease"):
            assert o.observed or o.races, str(o.mutant)


def test_the_simulator_observes_the_removals_it_can_see(case_score):
    """Pinned figures: a removed release whose block is reused before the last read changes the
    result, as does a retained static input dropped before a replay. The rest of the releases
    are conservative (the allocating lane waits for the reader before it allocates again), and
    a resource's retention has no data to poison."""
    rows = case_score.by_kind()
    assert rows["release"]["simulator"] >= 2
    assert rows["retain"]["simulator"] >= 1
    assert rows["wait"]["simulator"] >= rows["wait"]["mutants"] * 3 // 4


def test_a_mutant_leaves_the_original_graph_alone():
    gm, _ = build("deferred_release", "verify")
    before = [(n.name, n.args) for n in gm.graph.nodes]
    for mutant in mutants(gm):
        apply(gm, mutant)
    assert [(n.name, n.args) for n in gm.graph.nodes] == before
    verify(gm)


def test_an_unknown_kind_is_refused():
    gm, _ = build("fork_join", "verify")
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    with pytest.raises(ValueError, match="kinds are"):
        apply(gm, Mutant("nothing", node.name))


@settings(max_examples=25, deadline=None)
@given(case=cases(policies=("auto", "hints"), min_aux_lanes=1))
def test_the_verifier_rejects_every_mutant_of_random_graphs(case):
    gm, _ = _compile(case, upto="verify")
    outcomes = list(judge(gm, _inputs(case, salt=3), seeds=range(6)))
    for o in outcomes:
        assert o.verifier is not None, f"the verifier accepts {o.mutant}"
    event(f"mutants: {'0' if not outcomes else '1-5' if len(outcomes) <= 5 else '6+'}")
