"""The pass route on a GPU: ``capturepass.post_grad_pass`` as Inductor's post-grad custom pass
under plain ``torch.compile`` writes the lanes into the graph Inductor compiles, and the lanes
run, uncaptured, under PyTorch's cudagraph trees and in a CUDA graph the caller captures (as
vLLM's piecewise graphs are)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import capturepass
from capturepass.testing.models import MoEBlock
from capturepass.backends import post_grad
from tests.helpers import overlapping, profiled_kernels, two_lanes, written_lanes

pytestmark = pytest.mark.gpu

BF16 = dict(atol=3e-2, rtol=3e-2)


@pytest.fixture(autouse=True)
def _pass_route(monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"verify": true}')
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(post_grad_custom_post_pass=capturepass.post_grad_pass, fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def _written(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "sync points written" in r.getMessage()]


@torch.no_grad()
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_pass_route_moe_block_equals_eager(mode, caplog):
    """Uncaptured and under cudagraph trees: lanes written, three calls with new inputs equal
    eager, the caller's stream current after each, and no cudagraph skipped."""
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, mode=mode)
    caller = torch.cuda.current_stream()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(3):
            x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x), **BF16)
            assert torch.cuda.current_stream() == caller
    assert len(_written(caplog)) == 1, [r.getMessage() for r in caplog.records]
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@torch.no_grad()
def test_pass_route_runs_the_shared_experts_down_projection_beside_the_experts(monkeypatch):
    """Inductor fuses the shared expert's down projection and its sum with the routed experts
    into one ``addmm`` on the GPU; the pass splits the product off, runs it on another lane
    than the sum, and the result equals eager."""
    written = []

    def apply_lanes(graph, *args, **kwargs):
        applied = apply(graph, *args, **kwargs)
        written.append((applied, graph))
        return applied

    apply = post_grad.apply_lanes
    monkeypatch.setattr(post_grad, "apply_lanes", apply_lanes)
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model)
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(x), model(x), **BF16)
    ((applied, graph),) = written
    assert applied.lanes >= 2, applied
    assert graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default) == []
    (out,) = graph.output_node().args[0]
    assert out.target is torch.ops.aten.add.Tensor, out.format_node()
    product = next(a for a in out.args if a.target is torch.ops.aten.mm.default)
    lanes = written_lanes(graph)
    assert lanes[product] != lanes[out]


@torch.no_grad()
def test_pass_route_lanes_overlap_in_a_captured_graph(tmp_path, caplog):
    """The compiled function captured into a CUDA graph by its caller (as vLLM captures its
    pieces): replays equal eager with new inputs, and kernels of the two lanes overlap in time."""
    w = torch.randn(512, 512, device="cuda") / 23
    x = torch.randn(512, 512, device="cuda")
    compiled = torch.compile(two_lanes)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        compiled(x, w)  # compile and warm up, uncaptured
    assert len(_written(caplog)) == 1, [r.getMessage() for r in caplog.records]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, w)
    for _ in range(3):
        x.copy_(torch.randn(512, 512, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, two_lanes(x, w), atol=1e-2, rtol=1e-3)
    kernels = profiled_kernels(graph.replay, 10, tmp_path)
    assert len(kernels) >= 10 * 8 and overlapping(kernels) >= 1, (len(kernels), overlapping(kernels))
