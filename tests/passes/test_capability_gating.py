"""Capability-gated overlap: launch-plan answers per shape decide serialization and enqueue order.

The example op ``capturepass_examples::global_normalize`` (``capturepass.testing.kernels``)
plans a barrier-free single-CTA launch for small inputs and a grid-barrier launch for
large ones; its launch-plan callable answers accordingly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import capturepass
from capturepass.capabilities import REGISTRY
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.passes.annotate_capabilities import AnnotateCapabilities
from capturepass.runtime.executor import Executor
from capturepass.testing import kernels
from helpers import aten_graph, run_passes




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
