"""A decode loop written as gpt-fast and Meta's Llama write theirs, through host captures.

The model keeps its KV cache in module buffers and writes it with ``index_put`` at a position
tensor (``k_cache[:, :, input_pos] = k``), rotates queries and keys with complex numbers
(``torch.polar`` frequencies in a buffer, ``view_as_complex``), and selects its mask rows from a
boolean buffer by position. One ``fullgraph`` compile serves the prefill and every decode step
(two graphs: the prompt's length and one token). The captures run on host graphs
(``tests.helpers.capture_on_host``); the tokens and the caches must be eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import capture_on_host

DIM, HEADS, LAYERS, VOCAB, MAX_SEQ, BATCH = 64, 4, 2, 128, 32, 2
HEAD_DIM = DIM // HEADS
PROMPT, NEW_TOKENS = 6, 12


def _freqs_cis(seq: int, head_dim: int) -> torch.Tensor:
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(seq, head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis.view(1, xc.size(1), 1, xc.size(3))).flatten(3).type_as(x)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("k_cache", torch.zeros(BATCH, HEADS, MAX_SEQ, HEAD_DIM))
        self.register_buffer("v_cache", torch.zeros(BATCH, HEADS, MAX_SEQ, HEAD_DIM))

    def forward(self, x, freqs_cis, mask, input_pos):
        b, t, _ = x.shape
        q, k, v = (a.view(b, t, HEADS, HEAD_DIM) for a in self.wqkv(x).split(DIM, -1))
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, freqs_cis, mask, input_pos):
        h = x + self.attention(self.norm1(x), freqs_cis, mask, input_pos)
        y = self.norm2(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(MAX_SEQ, HEAD_DIM))
        self.register_buffer("causal", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)))

    def forward(self, idx, input_pos):
        mask, freqs_cis = self.causal[None, None, input_pos], self.freqs_cis[input_pos]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, input_pos)
        return self.output(x)


def _generate(model: _Transformer, forward, prompt: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the prompt at ``positions`` (a tensor the caller keeps, as the prompt), then
    one token a step at a position tensor of its own. Every step's tensors stay alive to the end,
    so no step finds one at the address of the last (where the allocator may hand a freed block
    back: a whole read-only input found where the last call had it is captured in place, a
    capture more that the allocator would decide)."""
    for layer in model.layers:
        layer.attention.k_cache.zero_()
        layer.attention.v_cache.zero_()
    steps = [torch.tensor([PROMPT + step]) for step in range(NEW_TOKENS - 1)]
    token = forward(prompt, positions)[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    for position in steps:
        token = forward(token, position)[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, 1)


def _caches(model: _Transformer) -> list[torch.Tensor]:
    return [b.clone() for name, b in model.named_buffers() if name.endswith("_cache")]


@torch.no_grad()
@pytest.mark.parametrize("options", [{}, {"regions": "lanes"}, {"inner": "eager", "policy": "off"}],
                         ids=["default", "lanes", "eager-off"])
def test_a_decode_loop_with_its_cache_in_module_buffers_equals_eager(options, monkeypatch):
    log = capture_on_host(monkeypatch.setattr)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Transformer().eval()
    prompt, positions = torch.randint(0, VOCAB, (BATCH, PROMPT)), torch.arange(PROMPT)
    want = _generate(model, model, prompt, positions)
    want_caches = _caches(model)
    compiled = torch.compile(model, backend="capturepass", fullgraph=True,
                             options={**options, "cudagraphs": "monolithic"})
    counts = []
    for generation in range(3):
        del log[:]
        got = _generate(model, compiled, prompt, positions)
        assert torch.equal(got, want), f"generation {generation}: {got.tolist()} != {want.tolist()}"
        for cache, expected in zip(_caches(model), want_caches):
            torch.testing.assert_close(cache, expected)
        kinds = [k for k, _ in log]
        counts.append((kinds.count("capture"), kinds.count("replay")))
    # The first generation captures the prefill and the first step, and every later step
    # replays. The second finds the prompt and its positions where the first had them: its
    # prefill captures them in place (a capture more), and from then on every call replays.
    assert counts == [(2, NEW_TOKENS - 2), (1, NEW_TOKENS - 1), (0, NEW_TOKENS)]
