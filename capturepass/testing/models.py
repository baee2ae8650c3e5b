"""Reference workloads with parallel branches, written without any stream code.

- :class:`MoEBlock`: a Llama-style shared-expert MLP beside top-k routed
  experts (the full-size block is ``MoEBlock(4096, 11008, 8, 1408, 2)``).
- :class:`AttnIndexer`: single-token decode attention over a KV cache beside a
  lightning-indexer-like branch that scores the cache and gathers its top-k
  positions (full size: ``AttnIndexer(32, 32, 4096, 128, 4096, 4, 64, 512)``).

Both take ``device`` and ``dtype``; the defaults are small CPU sizes that run in
milliseconds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _param(*shape: int, scale: float, device: torch.device | str | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * scale, requires_grad=False)


class MoEBlock(nn.Module):
    """A shared expert beside ``experts`` routed experts, top-``topk``, summed.

    Args:
        d: model width.
        shared: shared-expert hidden width.
        experts: number of routed experts.
        expert_width: routed-expert hidden width.
        topk: experts per token.
        trainable: whether the weights require grad.
    """

    def __init__(
        self,
        d: int = 64,
        shared: int = 176,
        experts: int = 8,
        expert_width: int = 32,
        topk: int = 2,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        trainable: bool = False,
    ) -> None:
        super().__init__()
        self.experts, self.expert_width, self.topk = experts, expert_width, topk
        p = lambda *s, scale: _param(*s, scale=scale, device=device, dtype=dtype)  # noqa: E731
        self.wg = p(shared, d, scale=d**-0.5)
        self.wu = p(shared, d, scale=d**-0.5)
        self.wd = p(d, shared, scale=shared**-0.5)
        self.wr = p(experts, d, scale=d**-0.5)
        self.w13 = p(experts, d, 2 * expert_width, scale=d**-0.5)
        self.w2 = p(experts, expert_width, d, scale=expert_width**-0.5)
        for w in self.parameters():
            w.requires_grad_(trainable)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The Llama MLP every token goes through."""
        return F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)

    def routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Top-k routing over the experts, computed densely and combined by router weight."""
        t, d = x.shape
        logits = F.linear(x, self.wr)
        vals, idx = torch.topk(logits, self.topk, dim=-1)
        probs = torch.softmax(vals.float(), dim=-1).to(x.dtype)
        comb = torch.zeros(t, self.experts, device=x.device, dtype=x.dtype).scatter(1, idx, probs)
        h = torch.bmm(x.unsqueeze(0).expand(self.experts, t, d), self.w13)
        g, u = h.split(self.expert_width, dim=-1)
        o = torch.bmm(F.silu(g) * u, self.w2)
        return (o * comb.t().unsqueeze(-1)).sum(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x) + self.routed_experts(x)


class AttnIndexer(nn.Module):
    """Decode attention over a KV cache beside a top-k indexer branch.

    Args:
        b: batch (decode tokens).
        h: attention heads.
        s: cache length.
        dh: head dimension.
        dm: model width.
        ih: indexer heads.
        idim: indexer key width.
        k: positions the indexer selects.
    """

    def __init__(
        self,
        b: int = 2,
        h: int = 4,
        s: int = 64,
        dh: int = 16,
        dm: int = 64,
        ih: int = 2,
        idim: int = 16,
        k: int = 8,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.ih, self.idim, self.k, self.dh = ih, idim, k, dh
        p = lambda *sh, scale: _param(*sh, scale=scale, device=device, dtype=dtype)  # noqa: E731
        self.k_cache = p(b, h, s, dh, scale=1.0)
        self.v_cache = p(b, h, s, dh, scale=1.0)
        self.idx_keys = p(b, s, idim, scale=idim**-0.5)
        self.mem = p(b, s, dh, scale=1.0)
        self.wq_idx = p(ih * idim, dm, scale=dm**-0.5)
        self.w_head = p(ih, dm, scale=dm**-0.5)

    def attention(self, q: torch.Tensor) -> torch.Tensor:
        """Single-query attention over the whole cache: ``[B,H,1,Dh]``."""
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)

    def indexer(self, x: torch.Tensor) -> torch.Tensor:
        """Scores every cache position, keeps the top-k, and pools what they hold: ``[B,Dh]``."""
        b = x.shape[0]
        qi = F.linear(x, self.wq_idx).view(b, self.ih, self.idim)
        hw = F.linear(x, self.w_head)
        s = torch.bmm(qi, self.idx_keys.transpose(1, 2))
        s = (F.relu(s) * hw.unsqueeze(-1)).sum(1)
        tv, ti = torch.topk(s, self.k, dim=-1)
        p = torch.softmax(tv.float(), dim=-1).to(x.dtype)
        sel = torch.gather(self.mem, 1, ti.unsqueeze(-1).expand(b, self.k, self.dh))
        return (p.unsqueeze(-1) * sel).sum(1)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ya = self.indexer(x)
        return self.attention(q) + ya.view(ya.shape[0], 1, 1, ya.shape[1])

    def example_inputs(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A query ``[B,H,1,Dh]`` and a hidden state ``[B,Dm]`` of matching sizes."""
        b, h, _, dh = self.k_cache.shape
        dtype = self.k_cache.dtype
        device = device or self.k_cache.device
        return (
            torch.randn(b, h, 1, dh, device=device, dtype=dtype),
            torch.randn(b, self.wq_idx.shape[1], device=device, dtype=dtype),
        )
