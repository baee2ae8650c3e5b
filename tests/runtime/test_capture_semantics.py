"""Captures without surprises, on a real GPU: failed captures become breaks, writes reach the
caller once, failures end cleanly, other threads work during a capture, outer captures are
used by uncaptured callables, and owners die with their model.

Every test is marked ``gpu`` and skipped without CUDA. The host halves are in
``test_capture_semantics_cpu.py``.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir.capabilities import REGISTRY
from capturepass.ir import meta
from capturepass.runtime import capture, capture_failures
from capturepass.runtime.events import POOL
from capturepass.testing.models import MoEBlock

pytestmark = pytest.mark.gpu

NS = "cptest_sem_gpu"


@pytest.fixture(autouse=True)
def _fresh_learning():
    REGISTRY.forget_learned()
    capture_failures._warned_ops.clear()
    yield
    REGISTRY.forget_learned()


def _graphs(kind: str | None = None):
    return [g for g in last_compiled() if kind is None or g.name == kind]


def _executor(kind: str = "inference"):
    return _graphs(kind)[-1].executor


def _capturing(stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


# -- 1. an op that fails under capture becomes a break ----------------------------------------------

def _moe_model(family: str):
    transformers = pytest.importorskip("transformers")
    if family == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.Qwen2MoeForCausalLM(config)


@torch.no_grad()
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_moe_captures_with_its_tolist_op_as_a_break(family, caplog, monkeypatch):
    """transformers' MoE integration calls ``.tolist()`` inside the opaque custom op
    ``transformers::grouped_mm_fallback``: the first capture fails on it, the probe finds it,
    and the graph is rebuilt with it as a break. Default options."""
    probes = []
    seen = {id(g) for g in last_compiled()}
    real_probe = capture.first_failing_node
    monkeypatch.setattr(capture, "first_failing_node", lambda *a: probes.append(a[1]) or real_probe(*a))
    torch.manual_seed(0)
    model = _moe_model(family).to("cuda").eval()
    compiled = torch.compile(model, backend="capturepass")
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 8), device="cuda")
            got = compiled(ids, use_cache=False).logits
            want = model(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    op = "transformers::grouped_mm_fallback"
    mine = [g for g in last_compiled() if id(g) not in seen]
    graphs = [g for g in mine if any(op in b.reason for b in meta.graph_info(g.graph).breaks)]
    assert graphs, [meta.graph_info(g.graph).breaks for g in mine]
    for g in graphs:
        gi = meta.graph_info(g.graph)
        assert gi.cudagraphs == "breakable"
        assert all(b.reason.startswith(f"{op} failed under CUDA graph capture (") for b in gi.breaks if op in b.reason)
        assert g.executor.num_captures == 1 and g.executor.uncaptured_reason is None
        assert g.executor.owners[0].graphs  # captured: segments around the breaks
    assert op in REGISTRY.learned()
    named = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and "cannot be captured" in r.getMessage()]
    assert len(named) == 1 and f"{op} cannot be captured (RuntimeError: " in named[0]
    # A second instance of the class: a new owner of the same callable, with the break from the start.
    before = len(probes)
    twin = _moe_model(family).to("cuda").eval()
    compiled_twin = torch.compile(twin, backend="capturepass")
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8), device="cuda")
        torch.testing.assert_close(compiled_twin(ids, use_cache=False).logits, twin(ids, use_cache=False).logits,
                                   atol=1e-4, rtol=1e-4)
    assert len(probes) == before


# -- 2. writes reach the caller, once -----------------------------------------------------------------

COUNT = {"break": 0}


@torch.library.custom_op(f"{NS}::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@_scale_.register_fake
def _(x, s):
    return None


@torch.library.custom_op(f"{NS}::counted_round", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _counted_round(x: torch.Tensor) -> torch.Tensor:
    COUNT["break"] += 1  # a visible effect of the break itself
    return (torch.round(x.cpu() * 64.0) / 64.0).to(x.device)


@_counted_round.register_fake
def _(x):
    return torch.empty_like(x)


class _Writes(torch.nn.Module):
    """One write of every kind: an input, a view of an input, a module buffer (a step counter),
    a KV cache passed as input and written at positions (index_copy_, index_put_: the decode
    pattern), and a custom op's mutates_args; optionally a break in the middle."""

    def __init__(self, with_break: bool) -> None:
        super().__init__()
        self.with_break = with_break
        self.register_buffer("step", torch.zeros((), device="cuda"))
        self.w = torch.nn.Parameter(torch.randn(3, 3, device="cuda"), requires_grad=False)

    def forward(self, x, y, cache, pos, z):
        self.step.add_(1)
        h = x @ self.w
        if self.with_break:
            h = torch.ops.cptest_sem_gpu.counted_round(h)
        x.add_(1)
        y[1:3].mul_(2)
        cache.index_copy_(0, pos, h[:2])
        cache[pos + 1] = y[:2]
        torch.ops.cptest_sem_gpu.scale_(z, 3.0)
        return h * 2 + self.step


def _writes_args():
    return [torch.randn(4, 3, device="cuda"), torch.randn(4, 3, device="cuda"), torch.zeros(8, 3, device="cuda"),
            torch.randperm(3, device="cuda")[:2] * 2, torch.randn(2, device="cuda")]


@torch.no_grad()
@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("with_break", [False, True], ids=["monolithic", "breakable"])
def test_every_kind_of_write_reaches_the_caller_once_per_call(inner, with_break):
    torch.manual_seed(0)
    model = _Writes(with_break)
    twin = _Writes(with_break)
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="capturepass", options={"inner": inner, "verify": True})
    for call in range(1, 5):
        args = _writes_args()
        ref = [a.clone() for a in args]
        before = COUNT["break"]
        got = compiled(*args)
        ran = COUNT["break"] - before
        want = twin(*ref)
        torch.testing.assert_close(got, want)
        for name, a, r in zip(("x", "y", "cache", "pos", "z"), args, ref):
            torch.testing.assert_close(a, r, msg=f"{name} after call {call}")
        assert model.step.item() == call  # bumped once per call, the first (capturing) call included
        assert ran == (1 if with_break else 0)  # a break runs once per call
    ex = _executor()
    assert ex.num_captures == 1
    gi = meta.graph_info(_graphs("inference")[-1].graph)
    assert gi.cudagraphs == ("breakable" if with_break else "monolithic")


@torch.no_grad()
@pytest.mark.parametrize("how", ["dynamo-streams", "hints"])
def test_an_input_mutated_in_nested_stream_contexts_reaches_the_caller(how):
    """Adapted from torch's test_streams.py test_stream_with_mutation: x is written inside
    nested stream contexts while other work runs on a third stream."""

    if how == "dynamo-streams":
        def fn(x, y):
            s2 = torch.Stream(device="cuda")
            s1 = torch.Stream(device="cuda")
            s0 = torch.Stream(device="cuda")
            with s1:
                with s2:
                    x.add_(y)
            with s0:
                z1 = torch.add(y, y)
                z0 = torch.add(z1, y)
                with s2:
                    y = 2 + z1
            return z0, y
    else:
        def fn(x, y):
            with capturepass.lane("s1"):
                with capturepass.lane("s2"):
                    x.add_(y)
            with capturepass.lane("s0"):
                z1 = torch.add(y, y)
                z0 = torch.add(z1, y)
                with capturepass.lane("s2"):
                    y = 2 + z1
            return z0, y

    compiled = torch.compile(fn, backend="capturepass", options={"inner": "eager", "max_aux_lanes": 3,
                                                                   "verify": True})
    for _ in range(4):
        x, y = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
        want_x, want = x + y, (3 * y, 2 + 2 * y)
        got = compiled(x, y)
        torch.cuda.synchronize()
        torch.testing.assert_close(x, want_x)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


# -- 3. failures end cleanly ----------------------------------------------------------------------------

def _other_model():
    """Another compiled model, captured and replaying, to check the process stays usable."""
    torch.manual_seed(1)
    model = MoEBlock(64, 128, 4, 32, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", options={"inner": "eager"})
    x = torch.randn(8, 64, device="cuda")
    compiled(x)
    compiled(x)
    return model, compiled, _executor()


def _still_usable(other) -> None:
    model, compiled, ex = other
    torch.randn(16, device="cuda")  # the CUDA generator is out of capture mode
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the allocator still serves
    del big
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert ex.num_captures == 1
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()


@torch.no_grad()
@pytest.mark.parametrize("op", ["item", "tolist", "python"])
def test_a_failed_capture_with_a_fork_raises_the_ops_own_error(op):
    """A capture that fails while an auxiliary stream is forked: ending it as torch.cuda.graph
    does raises cudaErrorStreamCaptureUnjoined (hiding the op's error) and, when the capture
    was invalidated, leaves the CUDA generator in capture mode. capture.segment joins the fork,
    ends and discards the capture, and raises the op's own error."""
    other = _other_model()
    x = torch.randn(64, device="cuda")
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    stream, aux = torch.cuda.Stream(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    expected = {"item": RuntimeError, "tolist": RuntimeError, "python": ValueError}[op]
    with pytest.raises(expected) as info:
        with capture.segment(graph, pool, stream, [aux]):
            aux.wait_stream(stream)  # fork
            with torch.cuda.stream(aux):
                y = x * 2
                torch.randn(8, device="cuda")  # the generator takes part in the capture
            if op == "item":
                y.sum().item()  # a synchronization: invalidates the capture
            elif op == "tolist":
                y.tolist()  # a copy to pageable memory: refused before anything is enqueued
            else:
                raise ValueError("the model's own error")
    assert "Unjoined" not in str(info.value)
    if op == "tolist":
        assert "during CUDA graph capture" in str(info.value)
    assert not _capturing(stream) and not _capturing(aux)
    _still_usable(other)


@torch.library.custom_op(f"{NS}::syncs", mutates_args=())
def _syncs(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item() > -1.0)  # a host sync inside an opaque op


@_syncs.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability(f"{NS}::syncs", overlap="safe")


@torch.library.custom_op(f"{NS}::grows", mutates_args=())
def _grows(x: torch.Tensor) -> torch.Tensor:
    n = x.numel() * (2 if torch.cuda.is_current_stream_capturing() else 1)
    ws = capturepass.workspace("grows", (n,), x.dtype, x.device)  # grows during the capture: refused
    return x + ws[: x.numel()].view_as(x).zero_()


@_grows.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability(f"{NS}::grows", overlap="safe", resources=("grows",))


@torch.no_grad()
def test_an_op_failing_under_capture_beside_a_forked_lane_becomes_a_break():
    other = _other_model()

    def f(x):
        with capturepass.lane("aux"):
            side = (x * 3).sin()
        h = torch.ops.cptest_sem_gpu.syncs(x.cos())
        return h + side

    compiled = torch.compile(f, backend="capturepass", options={"inner": "eager", "policy": "hints", "verify": True})
    for _ in range(3):
        x = torch.randn(32, 32, device="cuda")
        torch.testing.assert_close(compiled(x), f(x))
    ex = _executor()
    assert ex.uncaptured_reason is None and ex.num_captures == 1
    assert list(ex.not_capturable) == ["syncs"]
    breaks = meta.graph_info(_graphs("inference")[-1].graph).breaks
    assert [b.node for b in breaks] == ["syncs"]
    assert breaks[0].reason.startswith(f"{NS}::syncs failed under CUDA graph capture (")
    _still_usable(other)


@torch.no_grad()
def test_an_error_of_capturepass_during_capture_is_raised_and_the_process_stays_usable():
    other = _other_model()

    def f(x):
        with capturepass.lane("aux"):
            side = (x * 3).sin()
        return torch.ops.cptest_sem_gpu.grows(x.cos()) + side

    compiled = torch.compile(f, backend="capturepass", options={"inner": "eager", "policy": "hints"})
    x = torch.randn(32, 32, device="cuda")
    with pytest.raises(capturepass.ResourceError, match="grows"):
        compiled(x)
    _still_usable(other)


# -- 4. other threads during a capture --------------------------------------------------------------------

@torch.no_grad()
def test_eager_work_on_another_thread_neither_breaks_a_capture_nor_is_broken_by_it():
    """In the global capture mode another thread's allocation or synchronization during the
    capture fails (cudaErrorStreamCaptureUnsupported) and invalidates it; captures run in the
    thread-local mode."""
    assert capture.MODE_KWARGS == {"capture_error_mode": "thread_local"}
    stop, errors, done = threading.Event(), [], [0]

    def worker():
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                n = 0
                while not stop.is_set() and n < 20000:
                    block = torch.empty((n % 512 + 1) << 20, dtype=torch.uint8, device="cuda")  # new sizes
                    # Not torch.randn: torch 2.11 keeps the default CUDA generator's capture flag
                    # process-wide, so any thread's random op fails while a capture is underway.
                    a = torch.full((128, 128), float(n % 7), device="cuda")
                    if not torch.isfinite((a @ a.T).sum()).item():  # a synchronization
                        errors.append("not finite")
                    del block
                    n += 1
                    done[0] = n
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    seen = {id(g) for g in last_compiled()}
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        while done[0] < 5 and not errors:
            pass
        torch.manual_seed(0)
        models = [MoEBlock(64, 128, 4, 32, 2, device="cuda") for _ in range(3)]
        for model in models:  # three instances: three captures while the worker runs
            compiled = torch.compile(model, backend="capturepass", options={"inner": "eager"})
            for _ in range(2):
                x = torch.randn(8, 64, device="cuda")
                torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert sum(g.executor.num_captures for g in last_compiled() if id(g) not in seen and g.executor) == 3


# -- 5. uncaptured callables inside an engine's capture --------------------------------------------------

RETAINED: list[bool] = []


@torch.library.custom_op(f"{NS}::retaining", mutates_args=())
def _retaining(x: torch.Tensor) -> torch.Tensor:
    RETAINED.append(capturepass.retain(torch.empty(1, device=x.device)))
    return x * 2


@_retaining.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability(f"{NS}::retaining", overlap="safe")


@torch.no_grad()
def test_an_uncaptured_callable_inside_an_outer_capture_uses_its_scope():
    def f(x):
        with capturepass.lane("aux"):
            side = (x * 3).sin()
        return torch.ops.cptest_sem_gpu.retaining(x.cos()) + side

    compiled = torch.compile(f, backend="capturepass", options={"cudagraphs": "none", "inner": "eager",
                                                                  "policy": "hints"})
    x = torch.randn(32, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled(x)  # warm-up, eager
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ex = _executor()
    RETAINED.clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = compiled(x)
    assert RETAINED == [True]
    (owner,) = ex.owners
    assert owner.num_retained == 1
    assert "outer" in {scope for o, scope, _, _ in POOL.leases() if o == owner.name}
    assert ex.num_captures == 0
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, f(x))


# -- 6. owners die with their model ------------------------------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 1024, device="cuda")
        self.b = torch.nn.Linear(1024, 256, device="cuda")

    def forward(self, x):
        with capturepass.lane("aux"):
            side = x.sin() * 2
        return self.b(self.a(x).relu()) + side


def _settle() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    capture.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


@torch.no_grad()
@pytest.mark.parametrize("how", ["collected", "released"])
def test_owners_die_with_their_model_and_memory_returns_to_baseline(how):
    other = _other_model()
    base = _settle()
    torch.manual_seed(0)
    model = _Net()
    with_model = _settle()
    compiled = torch.compile(model, backend="capturepass", options={"inner": "eager", "policy": "hints"})
    for _ in range(3):
        x = torch.randn(64, 256, device="cuda")
        out, want = compiled(x), model(x)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    del out, want, x
    ex = _executor()
    assert ex.num_captures == 1
    owner = weakref.ref(ex.owners[0])
    assert _settle() > with_model
    if how == "released":
        assert capturepass.release(compiled) == 1
        assert ex.owners == [] and _settle() == with_model
        x = torch.randn(64, 256, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)  # captures again
        assert ex.num_captures == 1
        del x
    weak_model = weakref.ref(model)
    del compiled, model
    after = _settle()
    assert weak_model() is None
    assert owner() is None or owner().closed
    assert ex.owners == [] and ex.num_captures == 0
    assert after == base
    _still_usable(other)
