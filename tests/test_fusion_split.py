"""scripts/fusion_split.py: what it counts in the code Inductor generates for a graph's lanes."""

from __future__ import annotations

import torch

import capturepass
from tests.helpers import load_script


def _load():
    return load_script("scripts/fusion_split.py")


def _code(fn, *args, **options):
    compiled = torch.compile(fn, backend="capturepass", options={"regions": "segments", **options})
    with torch._inductor.config.patch(fx_graph_cache=False):  # the code is generated, not read back
        out, codes = torch._inductor.utils.run_and_get_code(compiled, *args)
    return out, codes[0]


def _f(x, w):
    a = torch.sin(x) * 2
    with capturepass.lane("aux"):
        z = torch.exp(x) * 5
        c = torch.cos(a) + 1
    return (torch.tanh(c) * 3) @ w, z


def test_counts_the_kernels_a_lane_cut_splits():
    """With the side lane, the lane's work is kernels of its own beside ``sin`` (three kernels,
    four sync points); on one lane Inductor fuses every pointwise op into one
    kernel (both its outputs written by it) and no sync point is left."""
    split = _load()
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    out, code = _code(_f, x, w)
    torch.testing.assert_close(out, _f(x, w))
    assert split.counts(code) == {"kernels": 3, "library": 1, "syncs": 4, "buffers": 6}
    torch._dynamo.reset()
    out, code = _code(_f, x, w, policy="off")
    torch.testing.assert_close(out, _f(x, w))
    assert split.counts(code) == {"kernels": 1, "library": 1, "syncs": 0, "buffers": 3}
