"""Lanes after fusion on a GPU (``regions="fused"``, the default on CUDA).

One lane's plan is compiled once; each fused kernel's lane is written into its generated code
(``capturepass.backends.fused_lanes``). These check what only a GPU shows: one Inductor compile
serves every schedule candidate, captured and uncaptured calls equal eager with new inputs,
kernels of a side lane run on another stream and overlap the main lane's when captured, and
the caller's stream is current again after a call.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.graph import GraphLowering

from capturepass.backends.compile import last_compiled
from capturepass.testing.models import MoEBlock
from tests.helpers import overlapping, profiled_kernels, two_lanes

pytestmark = pytest.mark.gpu

BF16 = dict(atol=3e-2, rtol=3e-2)


@pytest.fixture
def inductor_modules(monkeypatch):
    """The modules Inductor generates while the test runs (one per compile)."""
    made: list[object] = []
    real = GraphLowering.compile_to_module

    def counted(self, *a, **k):
        mod = real(self, *a, **k)
        made.append(mod)
        return mod

    monkeypatch.setattr(GraphLowering, "compile_to_module", counted)
    return made


@torch.no_grad()
@pytest.mark.parametrize("cudagraphs", ["monolithic", "none"])
def test_moe_block_is_one_compile_with_its_lanes(cudagraphs, inductor_modules):
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass",
                             options={"regions": "fused", "cudagraphs": cudagraphs, "pick": "model", "verify": True})
    caller = torch.cuda.current_stream()
    for _ in range(3):
        x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), model(x), **BF16)
        assert torch.cuda.current_stream() == caller
    graph = last_compiled()[-1]
    assert graph.program.code_lanes >= 2
    assert len(inductor_modules) == 1
    (module,) = inductor_modules
    with open(module.__file__) as f:
        code = f.read()
    assert "def _cp_lanes_call(" in code and "def _cp_one_call(" in code


@torch.no_grad()
def test_measured_choice_costs_one_compile(inductor_modules, tmp_path):
    """The default (``pick="measure"``): every candidate is the one compile, and the result
    equals eager over new inputs whichever is chosen."""
    torch.manual_seed(0)
    model = MoEBlock(1024, 2048, 8, 512, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass", options={"pick_cache_dir": str(tmp_path)})
    for _ in range(3):
        x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), model(x), **BF16)
    assert len(inductor_modules) == 1
    assert last_compiled()[-1].executor.schedule_choices, "no schedule was measured"


@torch.no_grad()
def test_side_lane_kernels_overlap_when_captured(tmp_path):
    w = torch.randn(512, 512, device="cuda") / 23
    compiled = torch.compile(two_lanes, backend="capturepass", options={"regions": "fused", "pick": "model"})
    for _ in range(3):
        x = torch.randn(512, 512, device="cuda")
        torch.testing.assert_close(compiled(x, w), two_lanes(x, w), atol=1e-2, rtol=1e-3)
    assert last_compiled()[-1].program.code_lanes == 2
    kernels = profiled_kernels(lambda: compiled(x, w), 10, tmp_path)
    assert len(kernels) >= 10 * 8 and overlapping(kernels) >= 1, (len(kernels), overlapping(kernels))


@torch.no_grad()
def test_each_fused_kernel_runs_on_its_lanes_stream(tmp_path):
    """Uncaptured, so that the profiler sees each launch: the side lane's matrix products run on
    another stream than the main lane's kernels. ``exp(x) * 5`` (hinted onto the side lane)
    reads what ``sin(x)`` reads: Inductor fuses the two into one kernel, which stays on the main
    lane with ``tanh`` (one lane's fusion is kept; the side lane waits for it)."""
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 23
    # pick="model": every uncaptured call on the lanes (a measured choice runs some on one stream).
    compiled = torch.compile(two_lanes, backend="capturepass", options={"regions": "fused", "cudagraphs": "none",
                                                                        "pick": "model"})
    for _ in range(2):
        out = compiled(x, w)
    torch.testing.assert_close(out, two_lanes(x, w), atol=1e-2, rtol=1e-3)
    kernels = profiled_kernels(lambda: compiled(x, w), 5, tmp_path)
    triton = {e["tid"] for e in kernels if "triton" in e["name"]}
    others = {e["tid"] for e in kernels if "triton" not in e["name"]}
    assert len(triton) == 1 and len(others) == 2 and triton < others, (triton, others)


class _Branches(torch.nn.Module):
    """``depth`` layers of two products side by side on one input (one hinted onto a side lane),
    joined by a product of their activations: each layer's side-lane result is read on the main lane, and the next layer's
    side lane reads the main lane's join."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(depth, width, width, device="cuda") / width**0.5)
        self.b = torch.nn.Parameter(torch.randn(depth, width, width, device="cuda") / width**0.5)

    def forward(self, x):
        import capturepass

        for a, b in zip(self.a, self.b):
            with capturepass.lane("aux"):
                y = x @ b
            x = torch.relu(x @ a) * torch.sigmoid(y)
        return x


@torch.no_grad()
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_captured_graph_of_lanes_frees_each_layers_blocks_within_the_layer(dynamic):
    """A block made on one lane and read on another goes back to its lane's stream once that lane
    waits for the read (the next layer's wait), not at the end of the graph: the capture's peak
    does not grow with the number of layers. Held to the join, each layer would keep its
    side-lane product (16 MiB here) to the end: 12 layers more, 192 MiB more. With dynamic shapes
    Inductor's code binds the sizes before its device block, and the frees move inside it too."""
    torch.manual_seed(0)
    width, rows = 2048, 2048
    layer = rows * width * 4
    peaks = {}
    for depth in (4, 16):
        model = _Branches(depth, width)
        compiled = torch.compile(model, backend="capturepass", dynamic=dynamic,
                                 options={"regions": "fused", "pick": "model", "verify": True})
        x = torch.randn(rows, width, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = compiled(x)
        torch.cuda.synchronize()
        peaks[depth] = torch.cuda.max_memory_allocated() - base
        torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-4)
        graph = last_compiled()[-1]
        assert graph.program.code_lanes == 2, graph.program.code_lanes
        torch._dynamo.reset()
        del compiled, model, got
    assert peaks[16] - peaks[4] < 2 * layer, {d: p / 2**20 for d, p in peaks.items()}
