"""A capture segment compiled once with its lanes inline, on a GPU (``regions="segments"``).

The host tests (``tests/backends/test_inline_segments.py``) check the generated code; these
check what only a GPU shows: the kernels after a sync point run on the stream of the lane it
makes current, captured and uncaptured calls equal eager with new inputs, and the current
stream is the caller's again after a call.
"""

from __future__ import annotations

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir import meta
from capturepass.testing.models import AttnIndexer, MoEBlock
from tests.helpers import overlapping, profiled_kernels, two_lanes

pytestmark = pytest.mark.gpu

BF16 = dict(atol=3e-2, rtol=3e-2)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize("cudagraphs", ["monolithic", "none"])
def test_moe_block_in_one_compile_equals_eager(cudagraphs):
    """Captured and uncaptured, the block is one compile with its lanes inline, equal to eager
    with new inputs at every call, and the caller's stream is current again after each."""
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass",
                             options={"regions": "segments", "cudagraphs": cudagraphs, "pick": "model",
                                      "verify": True})
    caller = torch.cuda.current_stream()
    for _ in range(3):
        x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), model(x), **BF16)
        assert torch.cuda.current_stream() == caller
    graph = last_compiled()[-1]
    assert len(meta.graph_info(graph.graph).lanes) >= 2
    (region,) = graph.program.regions
    assert region.inline is not None and len({p.lane for p in region.inline.points}) >= 2


@torch.no_grad()
def test_attention_indexer_in_one_compile_equals_eager():
    torch.manual_seed(0)
    model = AttnIndexer(4, 8, 512, 64, 256, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass",
                             options={"regions": "segments", "cudagraphs": "none", "verify": True})
    for _ in range(3):
        q, x = model.example_inputs()
        torch.testing.assert_close(compiled(q, x), model(q, x), **BF16)


@torch.no_grad()
def test_each_kernel_runs_on_its_lanes_stream(tmp_path):
    """Uncaptured, so that the profiler sees each launch: ``exp(x)`` written on a side lane reads
    only an input (Inductor would fuse it into the main lane's ``sin`` kernel if nothing pinned
    it); its kernel runs on another stream than ``sin``'s and ``tanh``'s. (Uncaptured, the host
    issues each lane's kernels after the other's: no overlap in time is asserted here.)"""

    f = two_lanes
    # Matmuls of a few blocks each: two of them fit on the GPU at once.
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 23
    # pick="model": every uncaptured call on the lanes (a measured choice runs some on one stream).
    compiled = torch.compile(f, backend="capturepass", options={"regions": "segments", "cudagraphs": "none",
                                                                "pick": "model"})
    for _ in range(2):
        out = compiled(x, w)
    torch.testing.assert_close(out, f(x, w), atol=1e-2, rtol=1e-3)
    kernels = profiled_kernels(lambda: compiled(x, w), 5, tmp_path)
    by_op = {op: {e["tid"] for e in kernels if "triton" in e["name"] and op in e["name"].split("_")}
             for op in ("sin", "exp", "tanh")}
    assert all(len(s) == 1 for s in by_op.values()), by_op
    assert by_op["exp"] != by_op["sin"] and by_op["sin"] == by_op["tanh"], by_op


@torch.no_grad()
def test_captured_inline_lanes_overlap_in_time(tmp_path):
    """Replays of a graph captured from one compile with its lanes inline: some kernel starts
    before another has ended (on one stream kernels run one after the other, so two that
    overlap in time ran on two lanes), and the result equals eager with new inputs."""
    w = torch.randn(512, 512, device="cuda") / 23
    compiled = torch.compile(two_lanes, backend="capturepass",
                             options={"regions": "segments", "pick": "model"})
    for _ in range(3):
        x = torch.randn(512, 512, device="cuda")
        torch.testing.assert_close(compiled(x, w), two_lanes(x, w), atol=1e-2, rtol=1e-3)
    (region,) = last_compiled()[-1].program.regions
    assert region.inline is not None
    kernels = profiled_kernels(lambda: compiled(x, w), 10, tmp_path)
    assert len(kernels) >= 10 * 8 and overlapping(kernels) >= 1, (len(kernels), overlapping(kernels))
