"""Zero-copy calls on a real GPU: replayed outputs are aliases of the pool, copied out only while
the caller holds them; a KV cache at a fixed address is written in place.

Every test is marked ``gpu`` and skipped without CUDA. The first call of a shape is its
capture (its results are the warm-up's own); replays start at the second call, so the
counters below count from there. The host half is ``test_outputs_cpu.py``.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from capturepass.backends.compile import last_compiled
from capturepass.runtime import in_place, outputs
import tests.helpers  # noqa: F401 - registers torch.ops.cptest.host_round
from tests.helpers import compiled_since

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(outputs.UNSUPPORTED is not None, reason=str(outputs.UNSUPPORTED)),
]


def _compile(model, **options):
    options.setdefault("verify", True)
    options.setdefault("inner", "eager")  # the kernels eager runs: results equal eager's exactly
    return torch.compile(model, backend="capturepass", options=options)


def _executor():
    return [g for g in last_compiled() if g.name == "inference"][-1].executor


def _only_capture(ex):
    caps = list(ex._captures.values())
    assert len(caps) == 1, ex._captures.keys()
    return caps[0]


def _assert_all_close(got, want, **tol) -> None:
    assert len(got) == len(want)
    for i in range(len(want)):
        torch.testing.assert_close(got[i], want[i], **tol)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64, device="cuda")
        self.b = torch.nn.Linear(64, 64, device="cuda")

    def forward(self, x):
        h = self.a(x).relu()
        y = self.b(h)
        return y, y[:, :8], h.tanh()


@torch.no_grad()
def test_a_held_output_keeps_its_values_after_the_next_calls():
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    xs = [torch.randn(4, 64, device="cuda") for _ in range(4)]
    got = [compiled(x) for x in xs]  # every call's outputs held
    for x, out in zip(xs, got):
        for g, w in zip(out, model(x)):
            torch.testing.assert_close(g, w)
    y, head, _ = got[-1]
    assert head.untyped_storage()._cdata == y.untyped_storage()._cdata  # views of one buffer share it
    cap = _only_capture(_executor())
    assert cap.outputs is not None
    # Calls 2..4 replay (3 outputs each); calls 3 and 4 found the previous replay's two
    # storages (y with its view, and the tanh) held.
    assert (cap.outputs.aliased, cap.outputs.rescues, cap.outputs.copies) == (9, 4, 0)


@torch.no_grad()
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_dropped_output_costs_no_copy(inner):
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model, inner=inner)
    tol = {} if inner == "eager" else dict(atol=1e-4, rtol=1e-4)
    for _ in range(5):
        x = torch.randn(4, 64, device="cuda")
        # Consumed before the next call, as a serving loop does: no name keeps an output.
        _assert_all_close(compiled(x), model(x), **tol)
    cap = _only_capture(_executor())
    assert cap.outputs.rescues == 0 and cap.outputs.copies == 0
    assert cap.outputs.aliased == 4 * 3


class _Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, device="cuda")

    def forward(self, h):
        return self.lin(h).tanh() + h


@torch.no_grad()
def test_an_output_fed_back_as_the_next_input_gives_eagers_result():
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model)
    h0 = torch.randn(2, 32, device="cuda")
    h, want = h0, h0
    for _ in range(4):
        h = compiled(h)
        want = model(want)
        torch.testing.assert_close(h, want)
    cap = _only_capture(_executor())
    # Calls 3 and 4 read the previous replay's output: copied out before it is overwritten.
    assert cap.outputs.rescues == 2
    assert cap.input_copies == 3  # h into its buffer at each replay


@torch.no_grad()
def test_an_output_fed_back_call_after_call_is_never_read_in_place():
    """The output of each call lies at one address in the pool, call after call: it is handed back
    over an alias of the graph's memory, which the replay first copies out (it is held), so it is
    never captured in place, however long it stays there."""
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model)
    h = want = torch.randn(2, 32, device="cuda")
    calls = in_place.STEADY_CALLS + 7
    for _ in range(calls):
        h = compiled(h)
        want = model(want)
        torch.testing.assert_close(h, want)
    cap = _only_capture(_executor())
    assert cap.in_place_ptrs == {} and cap.input_copies == calls - 1


@torch.no_grad()
def test_a_whole_input_refilled_at_one_address_is_read_there_without_a_copy(caplog):
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model)
    h = torch.empty(2, 32, device="cuda")
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(in_place.STEADY_CALLS + 5):
            h.normal_()  # refilled at its address, as a caller's input buffer
            torch.testing.assert_close(compiled(h), model(h))
    assert f"stayed at one address for {in_place.STEADY_CALLS + 1} calls; captured in place" in caplog.text
    cap = _only_capture(_executor())
    assert list(cap.in_place_ptrs.values()) == [h.data_ptr()]
    assert cap.input_copies == 0 and cap.watchers == []


@torch.no_grad()
def test_a_capture_in_place_on_a_dead_tensor_replays_for_the_next_tensor_at_its_address():
    """A caller that makes its input per call, freeing the last first: the caching allocator hands
    the same block back, the capture is made in place on it, and serves every later tensor there."""
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model)
    ptrs = []
    for _ in range(3 * in_place.STEADY_CALLS + 5):
        x = torch.randn(2, 32, device="cuda")
        ptrs.append(x.data_ptr())
        torch.testing.assert_close(compiled(x), model(x))
        del x
    assert len(set(ptrs[-3 * in_place.STEADY_CALLS:])) == 1, f"the allocator gave the freed block back: {ptrs}"
    cap = _only_capture(_executor())
    assert list(cap.in_place_ptrs.values()) == [ptrs[-1]] and cap.input_copies == 0 and cap.watchers == []


class _SliceAcrossABreak(torch.nn.Module):
    """Graph 1 returns a slice of its own result; graph 2, after the break, reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64, device="cuda")
        self.b = torch.nn.Linear(32, 32, device="cuda")

    def forward(self, x, y):
        s = self.a(x).relu()[:, 16:48]
        torch._dynamo.graph_break()
        return self.b(s).tanh() + s * 2 + y.sum()


@torch.no_grad()
def test_a_slice_of_an_output_of_the_graph_before_a_break_is_copied_not_read_in_place():
    """The slice is an alias of graph 1's memory in the pool the model's graphs share. A new
    y recompiles graph 2 alone, whose first capture then sees the slice as a replay of graph 1
    hands it out: that replay copies it out first (it is held), and graph 2's capture and
    replays write that pool. Read in place, it would be read from where it no longer is."""
    torch.manual_seed(0)
    model = _SliceAcrossABreak()
    compiled = _compile(model)
    before = last_compiled()
    xs = [torch.randn(4, 32, device="cuda") for _ in range(6)]
    for n in (3, 5, 7):
        y = torch.randn(n, device="cuda")
        for x in xs:
            torch.testing.assert_close(compiled(x, y), model(x, y))
    def shapes(ex):  # a graph with a dynamic y takes its length as an input of its own
        return [tuple(getattr(n.meta["val"], "shape", ())) for n in ex.program.inputs]

    second = [g.executor for g in compiled_since(before) if g.executor is not None and (32, 32) in shapes(g.executor)]
    slices = [(cap, shapes(ex).index((4, 32))) for ex in second for cap in ex._captures.values()]
    assert len(second) >= 2 and slices
    assert [s in cap.in_place_ptrs for cap, s in slices] == [False] * len(slices)
    # y is a whole tensor, refilled nowhere but passed again and again at one address: in place.
    assert all(len(cap.in_place_ptrs) == 1 for cap, _ in slices)


class _Cache(torch.nn.Module):
    """A decode step: writes this step's key at ``pos`` of a cache passed in, reads the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(16, 16, device="cuda")

    def forward(self, x, cache, pos):
        cache.index_copy_(0, pos, self.k(x))
        return cache.sum(0) * 0.5


def _step_args(step: int):
    return torch.randn(1, 16, device="cuda"), torch.tensor([step], device="cuda")


@torch.no_grad()
@pytest.mark.parametrize("check_replay", [False, True])
def test_a_cache_at_a_fixed_address_is_written_in_place_without_a_copy(check_replay):
    torch.manual_seed(0)
    model = _Cache()
    compiled = _compile(model, check_replay=check_replay)
    cache, ref = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
    ptr = cache.data_ptr()
    for step in range(5):
        x, pos = _step_args(step)
        torch.testing.assert_close(compiled(x, cache, pos), model(x, ref, pos))
        torch.testing.assert_close(cache, ref)
    ex = _executor()
    cap = _only_capture(ex)
    assert list(cap.in_place_ptrs.values()) == [ptr]
    assert cache.data_ptr() == ptr
    # Calls 2..5 replay: x and pos are copied into their buffers; the cache neither in nor back.
    assert cap.input_copies == 4 * 2


@torch.no_grad()
def test_a_cache_at_another_address_is_copied_from_then_on_and_still_equals_eager(caplog):
    torch.manual_seed(0)
    model = _Cache()
    compiled = _compile(model)
    first, ref_first = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
    second, ref_second = torch.ones(8, 16, device="cuda"), torch.ones(8, 16, device="cuda")
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for step in range(6):
            cache, ref = (first, ref_first) if step % 2 == 0 else (second, ref_second)
            x, pos = _step_args(step // 2)
            torch.testing.assert_close(compiled(x, cache, pos), model(x, ref, pos))
            torch.testing.assert_close(cache, ref)
    torch.testing.assert_close(first, ref_first)
    torch.testing.assert_close(second, ref_second)
    assert "came at another address than at their capture" in caplog.text
    ex = _executor()
    cap = _only_capture(ex)  # the in-place capture was released, the copy capture replaced it
    assert cap.in_place_ptrs == {}
    # Step 1 was its capture; steps 2..5 replay it: x, pos and the cache copied in, the cache back.
    assert cap.input_copies == 4 * 4


@torch.no_grad()
def test_the_capture_made_on_a_cache_goes_when_the_cache_is_collected():
    torch.manual_seed(0)
    model = _Cache()
    compiled = _compile(model)
    cache = torch.zeros(8, 16, device="cuda")
    for step in range(2):
        x, pos = _step_args(step)
        compiled(x, cache, pos)
    ex = _executor()
    cap = _only_capture(ex)
    del cache
    gc.collect()
    fresh, ref = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
    x, pos = _step_args(0)
    torch.testing.assert_close(compiled(x, fresh, pos), model(x, ref, pos))
    torch.testing.assert_close(fresh, ref)
    assert cap.owner.closed and ex.num_captures == 1


@torch.no_grad()
def test_static_outputs_are_returned_as_they_are_and_overwritten_by_the_next_call():
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model, static_outputs=True)
    x1, x2, x3 = (torch.randn(2, 32, device="cuda") for _ in range(3))
    compiled(x1)
    out2 = compiled(x2)
    want2 = model(x2)
    torch.testing.assert_close(out2, want2)
    out3 = compiled(x3)
    assert out3.data_ptr() == out2.data_ptr()
    torch.testing.assert_close(out2, model(x3))  # the documented overwrite
    assert _only_capture(_executor()).outputs is None


class _EndsInABreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, device="cuda")

    def forward(self, x):
        y = self.lin(x)
        return torch.ops.cptest.host_round(y), y * 2


@torch.no_grad()
def test_an_output_of_a_break_is_returned_as_it_is():
    torch.manual_seed(0)
    model = _EndsInABreak()
    compiled = _compile(model, cudagraphs="breakable")
    xs = [torch.randn(2, 32, device="cuda") for _ in range(3)]
    got = [compiled(x) for x in xs]
    for x, out in zip(xs, got):
        for g, w in zip(out, model(x)):
            torch.testing.assert_close(g, w)
    cap = _only_capture(_executor())
    assert cap.outputs.aliased == 2  # y * 2 of calls 2 and 3; the break's results are its own
    assert cap.outputs.rescues == 1  # call 3 found call 2's y * 2 held


def test_an_output_held_outside_pythons_heap_raises_on_access_instead_of_being_overwritten(caplog):
    """Without ``_swap_data_ptr_`` held outputs are moved tensor by tensor; a tensor with no Python
    object (matmul's own reshape of a 3-d input, saved for the backward) cannot be, so its storage
    is expired before the replay writes the memory: the backward raises instead of reading the
    next call's values."""
    if outputs.SWAP:
        pytest.skip("this torch moves the memory under every holder (UntypedStorage._swap_data_ptr_)")
    torch.manual_seed(0)
    model = _Mlp()
    with torch.no_grad():
        compiled = _compile(model)
        xs = [torch.randn(2, 4, 64, device="cuda") for _ in range(3)]
        compiled(xs[0])
        y = compiled(xs[1])[0]
    w = torch.ones(64, 2, device="cuda", requires_grad=True)
    loss = torch.matmul(y, w).sum()
    del y
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="capturepass"):
        compiled(xs[2])
    assert "accessing it raises from now on" in caplog.text
    cap = _only_capture(_executor())
    assert cap.outputs.searches == 1 and cap.outputs.copying is not None
    # Loud either way: the output itself (alive as the base of matmul's reshape) was moved, which
    # bumps the version counter its views share, so autograd's own check may fire first.
    with pytest.raises(RuntimeError, match="was an output of a CUDA graph replay|modified by an inplace operation"):
        loss.backward()
