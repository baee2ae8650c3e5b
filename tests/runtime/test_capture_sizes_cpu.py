"""Which sizes ``capture_sizes`` captures, and what the log says when it cannot, on the host.

Nothing is captured without CUDA: the executor's capture class is replaced by
``tests.helpers.HostCapture``, which runs the program eagerly and logs each "capture" and
"replay". The GPU half is ``test_cuda_runtime.py``'s ``capture_sizes`` tests.
"""

from __future__ import annotations

import logging

import pytest
import torch

from capturepass.backends.compile import last_compiled
from tests.helpers import capture_on_host, compiled_since


@pytest.fixture
def host_captures(monkeypatch):
    return capture_on_host(monkeypatch.setattr)  # as on a GPU: graphs compiled from now on capture and replay


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _compiled(capture_sizes):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Mlp()
    return model, torch.compile(model, backend="capturepass", dynamic=True,
                                options={"inner": "eager", "cudagraphs": "monolithic", "capture_sizes": capture_sizes})


def _executors():
    return [g.executor for g in last_compiled() if g.name == "inference"]


def _batch_size(key):
    """The batch size of a capture's key: dim 0 of the first tensor in its shape key."""
    return next(e[0][0] for e in key[1] if isinstance(e, tuple))


def _batch_sizes(ex):
    """The batch size of each capture."""
    return sorted(_batch_size(key) for key in ex._captures)


@torch.no_grad()
def test_sizes_outside_the_graphs_batch_range_are_left_to_the_graph_that_serves_them(host_captures, caplog):
    model, compiled = _compiled([1, 4, 8])
    with caplog.at_level(logging.INFO, logger="capturepass"):
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(x), model(x))
    before = last_compiled()
    ex = _executors()[-1]
    assert _batch_sizes(ex) == [4, 8]  # 1 is specialized by Dynamo: that call compiles (and captures) another graph
    said = [r.getMessage() for r in caplog.records if "outside the batch sizes" in r.getMessage()]
    assert len(said) == 1 and "capture_sizes 1 are outside" in said[0] and "(2 to any;" in said[0]
    assert [k for k, _ in host_captures] == ["capture", "capture", "replay"]  # 8 then 4, then the call
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        x = torch.randn(1, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert [g.name for g in compiled_since(before)] == ["inference"]  # the graph for batch 1


@torch.no_grad()
def test_a_first_call_at_batch_one_says_why_the_graph_has_no_dynamic_batch(host_captures, caplog):
    model, compiled = _compiled([2, 4])
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        x = torch.randn(1, 8)
        torch.testing.assert_close(compiled(x), model(x))
    said = [r.getMessage() for r in caplog.records if "no dynamic batch dimension" in r.getMessage()]
    assert len(said) == 1
    assert "first call had batch size 1, which Dynamo specializes" in said[0]
    # The next size compiles the graph with a dynamic batch, which captures capture_sizes.
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x))
    ex = _executors()[-1]
    assert _batch_sizes(ex) == [2, 3, 4]


@torch.no_grad()
def test_an_input_buffer_at_a_captured_size_is_read_in_place_once_it_stays_put(host_captures, caplog):
    """``capture_sizes`` captures on tensors made for each size, copied in at every call; the
    caller's own buffer, refilled at one address, is then captured in place at its second call."""
    model, compiled = _compiled([4, 8])
    x = torch.randn(4, 8)
    compiled(x)  # captures 8 then 4 on tensors of their own, then replays 4
    ex = _executors()[-1]
    buf = torch.empty(8, 8)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(4):
            buf.normal_()
            torch.testing.assert_close(compiled(buf), model(buf))
    said = [r.getMessage() for r in caplog.records if "stayed at one address" in r.getMessage()]
    assert len(said) == 1
    assert [k for k, _ in host_captures] == ["capture", "capture", "replay", "replay", "capture", "replay", "replay"]
    in_place = {_batch_size(key): list(cap.in_place_ptrs.values()) for key, cap in ex._captures.items()}
    assert in_place == {4: [], 8: [buf.data_ptr()]}



class _Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(32, 8)

    def forward(self, x, positions):
        return x + self.table(positions).sum(1)


@torch.no_grad()
def test_sizes_captured_ahead_keep_the_layout_of_the_callers_inputs(host_captures):
    """Position ids expanded over the batch (stride 0): the inputs of the sizes captured ahead are
    laid out as the call's (``sizes.zeros_laid_out_as``), so a later call at such a size replays
    (a contiguous stand-in gave another capture key: the call captured again)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Positions()
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"inner": "eager", "cudagraphs": "monolithic", "capture_sizes": [2, 4]})

    kept = []  # each call's inputs at addresses of their own (see the cache test below)

    def call(batch):
        x, positions = torch.randn(batch, 8), torch.arange(5).unsqueeze(0).expand(batch, 5)
        kept.append((x, positions))
        torch.testing.assert_close(compiled(x, positions), model(x, positions))

    call(4)  # captures 4 then 2, then replays 4
    call(2)
    call(4)
    assert [k for k, _ in host_captures] == ["capture", "capture", "replay", "replay", "replay"]
    assert _batch_sizes(_executors()[-1]) == [2, 4]


class _CacheArgument(torch.nn.Module):
    """A decode step that writes a cache passed as an argument (``[max_batch, slots, width]``, not
    sized by the batch) at one slot of the call's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache, slot):
        cache[: x.shape[0]].index_copy_(1, slot, self.proj(x).unsqueeze(1))
        return cache[: x.shape[0]].sum(1)


@torch.no_grad()
def test_a_cache_passed_as_an_argument_is_captured_in_place_at_every_size_ahead(host_captures):
    """Sizes captured ahead take the caller's tensors that the batch does not size as they are:
    the cache is captured in place at each size (zeros of its size gave each captured size a
    buffer of the cache's size, and each call two copies of the whole cache, in and back), and
    the captures ahead leave it as it was."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CacheArgument()
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"inner": "eager", "cudagraphs": "monolithic", "capture_sizes": [4, 8]})
    cache, expected = torch.zeros(16, 32, 8), torch.zeros(16, 32, 8)
    # Every call's inputs live to the end, at addresses of their own: a tensor made per call and
    # freed later lands where the allocator puts it, and two calls of one size that find an input
    # at one address capture it in place (a whole read-only input that stayed put), a capture more.
    calls = [(torch.randn(batch, 8), torch.tensor([step])) for step, batch in enumerate([4, 8, 4, 8, 8])]
    for x, slot in calls:
        torch.testing.assert_close(compiled(x, cache, slot), model(x, expected, slot))
        torch.testing.assert_close(cache, expected)
    assert [k for k, _ in host_captures] == ["capture", "capture"] + ["replay"] * 5
    ex = _executors()[-1]
    assert _batch_sizes(ex) == [4, 8]
    for cap in ex._captures.values():
        assert list(cap.in_place_ptrs.values()) == [cache.data_ptr()]
        assert all(buf.shape != cache.shape for buf in cap.inputs.values())
