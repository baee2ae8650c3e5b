"""Capability-gated overlap: launch-plan answers per shape decide serialization and enqueue order.

The example op ``capturepass_examples::global_normalize`` (``capturepass.testing.kernels``)
plans a barrier-free single-CTA launch for small inputs and a grid-barrier launch for
large ones; its launch-plan callable answers accordingly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import capturepass
from capturepass.ir.capabilities import REGISTRY
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.passes.annotate_capabilities import AnnotateCapabilities
from capturepass.runtime.executor import Executor
from capturepass.testing import kernels
from helpers import aten_graph, dump, run_passes




def _graph(tokens: int, d: int = 64):
    args = [torch.randn(tokens, d), torch.randn(128, d), torch.randn(128, d), torch.randn(d, 128), torch.randn(d, d)]
    # The shared branch comes after the routed launch in program order, as a model would write it.
    def fn(x, wg, wu, wd, wr):
        routed = torch.ops.capturepass_examples.global_normalize(F.linear(x, wr).relu())
        with capturepass.lane("shared"):
            shared = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        return shared + routed

    return aten_graph(fn, *args), args, fn


def _op_node(gm):
    return next(n for n in gm.graph.nodes if "global_normalize" in str(n.target))


def test_small_shape_is_barrier_free_and_safe_work_is_enqueued_first():
    gm, args, fn = _graph(tokens=16)
    run_passes(gm, upto="insert_syncs", policy="hints")
    op = _op_node(gm)
    cap = meta.info(op).capability
    assert cap.source == "launch-plan" and cap.overlap == "safe"
    assert cap.resident_grid and cap.barrier_free and cap.ctas == 1
    order = list(gm.graph.nodes)
    shared_mms = [n for n in order if meta.info(n).hint == "shared" and "mm" in str(n.target)]
    assert shared_mms and all(order.index(n) < order.index(op) for n in shared_mms)
    decisions = meta.graph_info(gm).decisions
    assert any(f"%{op.name}" in d and "enqueued" in d and "before it" in d for d in decisions), decisions


def test_large_shape_has_a_grid_barrier_and_is_serialized():
    gm, args, fn = _graph(tokens=4096)
    run_passes(gm, upto="partition", policy="hints")
    op = _op_node(gm)
    cap = meta.info(op).capability
    assert cap.overlap == "serialize" and cap.resident_grid and not cap.barrier_free
    assert cap.ctas == kernels.DEFAULT_SMS
    decisions = meta.graph_info(gm).decisions
    assert any(f"%{op.name}" in d and "serialized" in d for d in decisions), decisions
    # Nothing on the shared lane may run beside it: the shared lane's first node after the op
    # waits for it (the verifier's serialize rule checks the same from the sync nodes).
    order = list(gm.graph.nodes)
    i = order.index(op)
    shared = meta.graph_info(gm).lanes.index("shared")
    first = next(j for j in range(i + 1, len(order))
                 if meta.effect_of(order[j]) is Effect.COMPUTE and meta.lane_of(order[j]).index == shared)
    waits = [n for n in order[i + 1:first] if meta.effect_of(n) is Effect.WAIT and meta.lane_of(n).index == shared]
    assert waits, "the shared lane must wait for the serialized op"


def test_results_equal_eager_for_both_shapes():
    for tokens in (16, 4096):
        gm, args, fn = _graph(tokens=tokens)
        ctx = run_passes(gm, upto="emit", policy="hints")
        got = Executor(ctx.artifacts["program"])(list(args))
        torch.testing.assert_close(got, fn(*args))


def test_cache_key_changes_with_the_capability():
    before = AnnotateCapabilities(REGISTRY.key()).uuid()
    try:
        capturepass.register_capability(kernels.global_normalize, overlap="serialize")
        after = AnnotateCapabilities(REGISTRY.key()).uuid()
        assert after != before
    finally:
        capturepass.register_capability(kernels.global_normalize, overlap=kernels.capability_of)
    assert AnnotateCapabilities(REGISTRY.key()).uuid() == before


# -- the third level: enqueue before, join before the launch ------------------------------------


@torch.library.custom_op("cptest_gate::resident_join", mutates_args=())
def _resident_join(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_resident_join.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_gate::resident_join", overlap="join")


def _join_fn(x, wg, wd, wr):
    routed = torch.ops.cptest_gate.resident_join(torch.mm(x, wr))
    with capturepass.lane("shared"):
        shared = torch.mm(torch.mm(x, wg).relu(), wd)
    after = torch.mm(x, wg).sin()  # on main after the launch: may run beside other lanes again
    with capturepass.lane("shared"):
        late = torch.mm(routed, wd)  # reads the launch's output: stays after it
    return shared + routed + after + late


def _join_graph():
    args = [torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 16)]
    return aten_graph(_join_fn, *args), args


def test_join_level_enqueues_before_and_joins_before_the_launch():
    gm, args = _join_graph()
    run_passes(gm, upto="insert_syncs", policy="hints")
    assert_expected_inline(dump(gm), """\
# graph inference: lanes s0=main s1=shared; cudagraphs=none
owner g0:
  %x_1 : f32[8,16] = input  {lane=s0}
  %wg_1 : f32[16,16] = input  {lane=s0}
  %wd_1 : f32[16,16] = input  {lane=s0}
  %wr_1 : f32[16,16] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm : f32[8,16] = aten.mm.default(%x_1, %wr_1)  {lane=s0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm_1 : f32[8,16] = aten.mm.default(%x_1, %wg_1)  {lane=s1, hint=shared}
  %relu : f32[8,16] = aten.relu.default(%mm_1)  {lane=s1, hint=shared}
  %mm_2 : f32[8,16] = aten.mm.default(%relu, %wd_1)  {lane=s1, hint=shared}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=join %resident_join}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=join %resident_join}
  %resident_join : f32[8,16] = cptest_gate.resident_join.default(%mm)  {lane=s0, overlap=join}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, by=insert_syncs, why=%resident_join->%mm_4}
  %mm_3 : f32[8,16] = aten.mm.default(%x_1, %wg_1)  {lane=s0}
  %sin : f32[8,16] = aten.sin.default(%mm_3)  {lane=s0}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, by=insert_syncs, why=%resident_join->%mm_4}
  %mm_4 : f32[8,16] = aten.mm.default(%resident_join, %wd_1)  {lane=s1, hint=shared}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, by=insert_syncs, why=%mm_4->%add_2}
  %add : f32[8,16] = aten.add.Tensor(%mm_2, %resident_join)  {lane=s0}
  %add_1 : f32[8,16] = aten.add.Tensor(%add, %sin)  {lane=s0}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=%mm_4->%add_2}
  %add_2 : f32[8,16] = aten.add.Tensor(%add_1, %mm_4)  {lane=s0}
  %release_default : () = capturepass.release([%resident_join], 0)  {lane=s0, by=insert_syncs, why=read by %mm_4}
  return %add_2  {lane=s0}
# decision: %resident_join: declared overlap=join: joined; enqueued 3 node(s) of other lanes before it (%mm_1, %relu, %mm_2); every lane joins before it starts
""")
    decisions = meta.graph_info(gm).decisions
    assert any("%resident_join" in d and "joined; enqueued 3 node(s) of other lanes before it" in d
               and "every lane joins before it starts" in d for d in decisions), decisions


def test_join_level_verifies_and_equals_eager():
    gm, args = _join_graph()
    ctx = run_passes(gm, upto="emit", policy="hints")
    got = Executor(ctx.artifacts["program"])(list(args))
    torch.testing.assert_close(got, _join_fn(*args))


def test_join_level_verifier_rejects_a_launch_that_does_not_join():
    from capturepass.errors import VerificationError
    from capturepass.ir import verify

    gm, args = _join_graph()
    run_passes(gm, upto="partition", policy="hints")
    wait = next(n for n in gm.graph.nodes if meta.info(n).why == "join %resident_join"
                and meta.effect_of(n) is Effect.WAIT)
    gm.graph.erase_node(wait)
    with pytest.raises(VerificationError, match=r"%resident_join.*must start with every lane joined \(declared overlap=join\) but lane s1 "
                                                r"may still be running"):
        verify.verify(gm)


def test_join_level_from_a_launch_plan_with_a_grid_barrier_is_serialized():
    from capturepass.ir.capabilities import _Declaration, _to_capability

    decl = _Declaration(True, lambda call: None, ())
    cap = _to_capability({"overlap": "join", "resident_grid": True, "barrier_free": False}, "ns::op", decl)
    assert cap.overlap == "serialize" and "grid barrier: serialized" in cap.reason
    cap = _to_capability({"overlap": "join", "resident_grid": True}, "ns::op", decl)
    assert cap.overlap == "join"


# -- ops that need the whole forward in one graph ------------------------------------------------


@torch.library.custom_op("cptest_gate::whole_graph_comm", mutates_args=())
def _whole_graph_comm(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_whole_graph_comm.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_gate::whole_graph_comm", monolithic=True)


def test_monolithic_requirement_refuses_a_break():
    def fn(x):
        y = torch.ops.cptest_gate.whole_graph_comm(x.relu())
        return y * y.sum().item()

    gm = aten_graph(fn, torch.randn(4), cudagraphs="breakable")
    with pytest.raises(capturepass.CapturePassError,
                       match=r"%whole_graph_comm \(cptest_gate.whole_graph_comm.default\) requires the whole "
                             r"forward in one monolithic CUDA graph, but %_local_scalar_dense .* is not capturable"):
        run_passes(gm, upto="assign_streams", policy="hints")


def test_monolithic_requirement_switches_a_breakable_graph_without_breaks():
    def fn(x):
        return torch.ops.cptest_gate.whole_graph_comm(x.relu()) * 2

    gm = aten_graph(fn, torch.randn(4), cudagraphs="breakable")
    run_passes(gm, upto="partition", policy="hints")
    gi = meta.graph_info(gm)
    assert gi.cudagraphs == "monolithic" and len(gi.segments) == 1
    assert any("cudagraphs=breakable switched to monolithic: %whole_graph_comm requires" in d for d in gi.decisions)
    assert "monolithic" in dump(gm).split("whole_graph_comm.default")[1].splitlines()[0]


def test_monolithic_requirement_must_be_capturable():
    with pytest.raises(capturepass.CapabilityError, match="cannot require a monolithic graph"):
        capturepass.register_capability("cptest_gate::nothing", capturable=False, monolithic=True)


def test_join_level_is_race_free_in_every_interleaving_and_lanes_resume_beside_it():
    from capturepass.testing.simulate import explore

    gm, args = _join_graph()
    run_passes(gm, upto="verify", policy="hints")
    report = explore(gm, args, range(20), replay=True)
    assert report.ok, report.describe()
    # No barrier after the launch: the shared lane's later work waits only for the data it reads.
    order = list(gm.graph.nodes)
    i = order.index(next(n for n in order if "resident_join" in str(n.target)))
    after_waits = [meta.info(n).why for n in order[i + 1:] if meta.effect_of(n) is Effect.WAIT]
    assert not any(w.startswith(("join %", "serialize %")) for w in after_waits), after_waits
