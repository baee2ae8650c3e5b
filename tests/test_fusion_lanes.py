"""scripts/fusion_lanes.py: one lane's fused kernels read against the lanes of capturepass's plan."""

from __future__ import annotations

import torch

from tests.helpers import load_script, two_lanes


def test_fused_kernels_are_counted_by_the_lanes_of_their_origins():
    """``two_lanes``: ``sin`` on main and the hinted lane's ``exp(x) * 5`` both read ``x``, and
    Inductor fuses them into one kernel (on two lanes); main's four products and ``tanh``, and
    three of the lane's four products, keep to their lane (the lane's last product becomes an
    ``addmm`` with main's sum, on main)."""
    torch.manual_seed(0)
    (graph,) = load_script("scripts/fusion_lanes.py").fused_lanes(two_lanes, torch.randn(8, 8), torch.randn(8, 8))
    assert graph["lanes"] == ["main", "aux"]
    assert (graph["nodes"], graph["extern"]) == (10, 8)
    assert dict(graph["by_lanes"]) == {("s0",): 6, ("s1",): 3, ("s0", "s1"): 1}
