"""FlexAttention through capturepass on the host: ``flex_attention`` is a higher-order op whose
score and mask functions are subgraphs of the graph, and whose block mask reaches the graph as
tensors (block counts and indices) beside the query, key and value.

Two attentions of one layer (different score functions over one block mask) are independent
branches: each goes to a lane of its own, both are captured (on host graphs:
``tests.helpers.capture_on_host``), and every replay equals eager. Inductor compiles the op with
its own fused kernel on the CPU, eager runs it unfused; both agree within float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

flex = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.slow

B, H, S, D = 2, 4, 64, 16


def _causal(b, h, q, kv):
    return q >= kv


def _distance_bias(score, b, h, q, kv):
    return score - (q - kv).to(score.dtype) * 0.05


class _TwoAttentions(torch.nn.Module):
    """One block mask, two projections and score functions (plain, and biased by distance)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(H * D, 3 * H * D) for _ in range(2))
        self.out = torch.nn.Linear(2 * H * D, H * D)

    def forward(self, x, block_mask):
        heads = []
        for proj, score_mod in zip(self.qkv, (None, _distance_bias)):
            q, k, v = proj(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
            y = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
            heads.append(y.transpose(1, 2).reshape(B, S, H * D))
        return self.out(torch.cat(heads, -1))


@torch.no_grad()
@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_two_flex_attention_branches_take_two_lanes_and_replay_equal_to_eager(inner, monkeypatch):
    from capturepass.ir import meta
    from tests.backends.e2e_util import new_compiles
    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TwoAttentions().eval()
    block_mask = flex.create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")
    compiled = torch.compile(model, backend="capturepass",
                             options={"inner": inner, "regions": "lanes", "cudagraphs": "monolithic"})
    xs = [torch.randn(B, S, H * D) for _ in range(4)]  # alive to the end: each call's x at its own address
    with new_compiles() as records:
        for x in xs:
            torch.testing.assert_close(compiled(x, block_mask), model(x, block_mask))
    (record,) = [r for r in records if r.name == "inference"]
    gm, gi = record.graph, meta.graph_info(record.graph)
    attentions = [n for n in gm.graph.nodes if str(n.target) == "flex_attention"]
    assert len(attentions) == 2
    assert sorted(gi.lane_name(meta.lane_of(n)) for n in attentions) == ["aux0", "main"]
    for node in attentions:
        cap = meta.info(node).capability
        assert cap.capturable is True, cap.reason
    assert gi.cudagraphs == "monolithic" and not gi.breaks
    # The block mask's tensors are the same at every call: read where they are once the second
    # call found them there again (a capture more); x is copied into its buffer.
    assert [k for k, _ in log] == ["capture", "capture", "replay", "replay"]
