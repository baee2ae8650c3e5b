"""Engine resources on a real GPU: channels and workspaces per owner, profiling captures, external
streams, the "join" overlap level, weak arguments of breaks and the replay check.

Every test here is marked ``gpu`` and skipped without CUDA; the bookkeeping halves run on the
host in ``test_resources_cpu.py`` and ``tests/passes/test_external_streams.py``.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir import meta, printer
from capturepass.ir.meta import Effect
from capturepass.runtime import pools
from capturepass.runtime.owner import WARM_UP

pytestmark = pytest.mark.gpu


def _executor():
    return last_compiled()[-1].executor


# -- a stateful channel op: out = x @ w + (what this channel saw last call) ---------------------------

CHANNELS = "cptest_gpu_channels"


def _pool():
    return {p.name: p for p in pools.registered_pools()}[CHANNELS]


@torch.library.custom_op("cptest_res_gpu::carry", mutates_args=())
def _carry(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ch = _pool().channel()
    scratch = capturepass.workspace("carry", tuple(x.shape), x.dtype, x.device)
    torch.mm(x, w, out=scratch)
    out = scratch + ch.prev[: x.shape[0]]
    ch.prev[: x.shape[0]].copy_(x)  # the channel carries state from one call to the next
    return out


@_carry.register_fake
def _(x, w):
    return torch.empty_like(x)


capturepass.register_capability("cptest_res_gpu::carry", overlap="safe", resources=("channel", "carry"))


class _Target(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d, device="cuda") / d)

    def forward(self, x):
        return torch.ops.cptest_res_gpu.carry(x.relu(), self.w).sin()


class _Draft(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d, device="cuda") / d)

    def forward(self, x):
        return torch.ops.cptest_res_gpu.carry(x.tanh(), self.w).cos()


@pytest.fixture
def channels():
    pool = capturepass.resource_pool(
        CHANNELS, lambda key: types.SimpleNamespace(key=key, prev=torch.zeros(64, 32, device="cuda"))
    )
    yield pool
    pools.unregister_pool(CHANNELS)


@torch.no_grad()
def test_target_and_draft_own_channels_and_workspaces_replayed_interleaved(channels):
    torch.manual_seed(0)
    target, draft = _Target(32), _Draft(32)
    ct, cd = torch.compile(target, backend="capturepass"), torch.compile(draft, backend="capturepass")
    # The first call of each warms up (one eager call through its channel), captures and replays.
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
    ct(x), cd(y)
    prev_t, prev_d = x.relu(), y.tanh()
    for _ in range(5):
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
        got_t, got_d = ct(x), cd(y)
        # Each model sees only its own previous input through its channel.
        torch.testing.assert_close(got_t, (x.relu() @ target.w + prev_t).sin())
        torch.testing.assert_close(got_d, (y.tanh() @ draft.w + prev_d).cos())
        prev_t, prev_d = x.relu(), y.tanh()
    owners = [g.executor.owners for g in last_compiled() if g.executor is not None][-2:]
    (ot,), (od,) = owners
    assert ot.graphs and od.graphs and ot.name != od.name
    keys = {str(k) for k in channels.channels()}
    assert f"{ot.name}/s0" in keys and f"{od.name}/s0" in keys
    assert channels.channel(owner=ot.name) is not channels.channel(owner=od.name)
    ws_t = {t.data_ptr() for t in ot.workspaces.buffers().values()}
    ws_d = {t.data_ptr() for t in od.workspaces.buffers().values()}
    assert ws_t and ws_d and not ws_t & ws_d


@torch.no_grad()
def test_workspace_growth_under_capture_raises():
    @torch.library.custom_op("cptest_res_gpu::grows", mutates_args=())
    def grows(x: torch.Tensor) -> torch.Tensor:
        n = x.numel() * (2 if torch.cuda.is_current_stream_capturing() else 1)
        ws = capturepass.workspace("grows", (n,), x.dtype, x.device)
        ws[: x.numel()].copy_(x.flatten())
        return ws[: x.numel()].view_as(x) * 2

    @grows.register_fake
    def _(x):
        return torch.empty_like(x)

    capturepass.register_capability("cptest_res_gpu::grows", overlap="safe")
    compiled = torch.compile(lambda x: torch.ops.cptest_res_gpu.grows(x + 1), backend="capturepass")
    with pytest.raises(capturepass.ResourceError, match=r"workspace 'grows' .* would grow from 256 to 512 bytes "
                                                        r"while locked \(capture of g\d+\.m0\.c0\)"):
        compiled(torch.randn(64, device="cuda"))


@torch.no_grad()
def test_profiling_capture_then_real_capture_returns_to_baseline(channels):
    torch.manual_seed(0)
    model = _Target(32)
    x = torch.randn(16, 32, device="cuda")
    compiled = torch.compile(model, backend="capturepass")
    channels.channel(owner="engine")
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    with capturepass.profiling_capture() as prof:
        out = compiled(x)
        del out
        executor = _executor()
        (throwaway,) = executor.owners
        assert throwaway.profiling and throwaway.graphs
    gc.collect()
    torch.cuda.synchronize()
    assert prof.owners == [throwaway.name] and prof.graphs == 1 and prof.retained > 0
    assert prof.pool_bytes > 0 and prof.peak_bytes > 0 and prof.leaked_bytes == 0
    assert throwaway.closed and executor.num_captures == 0
    assert torch.cuda.memory_allocated() == baseline
    # The throwaway owner's channel went with it; the rollback found nothing more to release.
    assert [str(k) for k in channels.channels()] == ["engine/s0"]
    assert channels.counters["released"] == 1 and prof.rolled_back == {}
    # The real capture afterwards: a new owner (its channel starts afresh), results as expected.
    compiled(x)
    prev = x.relu()
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        torch.testing.assert_close(compiled(x), (x.relu() @ model.w + prev).sin())
        prev = x.relu()
    (real,) = executor.owners
    # A new owner; it may bear the closed one's name (names are unique among open owners).
    assert not real.profiling and real.graphs and real is not throwaway and not real.closed


# -- external streams ----------------------------------------------------------------------------------


class _ReadsWeights(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(d, d, device="cuda"))

    def forward(self, x):
        a = x @ self.w
        with capturepass.lane("aux"):
            b = (x * 2) @ self.w
        return a + b


@torch.no_grad()
def test_external_stream_joined_under_capture_and_at_replay():
    """An offload stream writes the weights right before each call, behind a long sleep: the graph
    must wait for it (relation "before"), or it reads the old weights."""
    torch.manual_seed(0)
    model = _ReadsWeights(256)
    offload = torch.cuda.Stream()
    capturepass.external_stream("offload", offload)
    try:
        compiled = torch.compile(model, backend="capturepass", options={
            "external_streams": {"offload": "before"}, "verify": True})
        # Inputs at new addresses: the shape keeps one capture (an input refilled in place would be
        # captured again on its address at the second call).
        xs = [torch.randn(64, 256, device="cuda") for _ in range(4)]
        for x in xs:
            new = torch.randn(256, 256, device="cuda")
            torch.cuda.current_stream().synchronize()
            with torch.cuda.stream(offload):
                torch.cuda._sleep(20_000_000)  # ~10 ms: without the join the replay runs first
                model.w.copy_(new)
            got = compiled(x)
            torch.testing.assert_close(got, 3 * (x @ new), atol=1e-3, rtol=1e-3)
        ex = _executor()
        assert ex.num_captures == 1
        (owner,) = ex.owners
        # One join a call: the first call is the warm-up (its lanes' own scope, every lane on one
        # stream), then 3 replays (the capture waits none).
        assert owner.lanes(WARM_UP).counters["external_in:offload"] == 1
        assert owner.lanes("eager").counters["external_in:offload"] == 3
        dump = printer.dump(last_compiled()[-1].graph)
        assert "capturepass.join_external(0, 0, True)  {lane=s0, external=offload, role=in" in dump
    finally:
        capturepass.external_stream("offload", None)


@torch.no_grad()
def test_external_stream_outside_an_outer_capture_is_refused():
    model = _ReadsWeights(64)
    offload = torch.cuda.Stream()
    capturepass.external_stream("offload", offload)
    try:
        compiled = torch.compile(model, backend="capturepass", options={
            "external_streams": {"offload": "before"}, "cudagraphs": "monolithic"})
        x = torch.randn(8, 64, device="cuda")
        compiled(x)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(capturepass.ResourceError, match="external stream 'offload' is not part of the capture"):
            with torch.cuda.graph(graph):
                compiled(x)
    finally:
        capturepass.external_stream("offload", None)


# -- the third overlap level on CUDA -------------------------------------------------------------------


@torch.library.custom_op("cptest_res_gpu::resident", mutates_args=())
def _resident(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


@_resident.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_res_gpu::resident", overlap="join")


class _JoinModel(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.wr = torch.nn.Parameter(torch.randn(d, d, device="cuda") / d)
        self.ws = torch.nn.Parameter(torch.randn(d, d, device="cuda") / d)

    def forward(self, x):
        routed = torch.ops.cptest_res_gpu.resident(x @ self.wr)
        with capturepass.lane("shared"):
            shared = torch.relu(x @ self.ws) @ self.ws
        return routed + shared


@torch.no_grad()
def test_join_level_enqueue_order_in_dump_and_equal_to_eager():
    torch.manual_seed(0)
    model = _JoinModel(256)
    compiled = torch.compile(model, backend="capturepass", options={"verify": True, "policy": "hints"})
    for _ in range(3):
        x = torch.randn(32, 256, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    gm = last_compiled()[-1].graph
    order = list(gm.graph.nodes)
    op = next(n for n in order if "resident" in str(n.target))
    shared = [n for n in order if meta.info(n).hint == "shared" and meta.effect_of(n) is Effect.COMPUTE]
    assert shared and all(order.index(n) < order.index(op) for n in shared)
    waits = [n for n in order[: order.index(op)]
             if meta.effect_of(n) is Effect.WAIT and meta.info(n).why == f"join %{op.name}"]
    assert len(waits) == 1
    assert any("joined; enqueued" in d for d in meta.graph_info(gm).decisions)


# -- replay check ---------------------------------------------------------------------------------------


SCRATCH: dict[str, torch.Tensor] = {}


@torch.library.custom_op("cptest_res_gpu::bound", mutates_args=())
def _bound(x: torch.Tensor) -> torch.Tensor:
    """Bakes a binding's scratch into the graph and retains it (seed 003)."""
    scratch = SCRATCH.setdefault("s", torch.empty(4096, device=x.device))
    capturepass.retain(scratch)
    scratch[: x.numel()].copy_(x.reshape(-1))
    return scratch[: x.numel()].view_as(x) * 2


@_bound.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_res_gpu::bound", overlap="safe")


@torch.no_grad()
def test_check_replay_names_a_retained_buffer_that_moved():
    SCRATCH.clear()
    compiled = torch.compile(lambda x: torch.ops.cptest_res_gpu.bound(x.sin()), backend="capturepass",
                             options={"check_replay": True})
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(compiled(x), x.sin() * 2)
    torch.testing.assert_close(compiled(x), x.sin() * 2)
    SCRATCH["s"].resize_(1 << 20)  # reallocated under the captured graph
    # The error names the owner as the dump and capturepass show do: graph gN, model 0, capture shape 0.
    graph = last_compiled()[-1]
    owner = f"{graph.executor.graph_owner}.m0.c0"
    assert graph.executor.graph_owner == str(meta.graph_info(graph.graph).owner)
    assert [o.name for o in graph.executor.owners] == [owner]
    with pytest.raises(capturepass.ResourceError, match=rf"check_replay: retained Tensor \d+ of segment 0 of "
                                                        rf"{owner} changed storage since capture"):
        compiled(x)


@torch.no_grad()
def test_a_moved_parameter_gets_its_own_capture():
    model = _ReadsWeights(64)
    compiled = torch.compile(model, backend="capturepass", options={"check_replay": True})
    x = torch.randn(8, 64, device="cuda")
    model.w.copy_(torch.randn(64, 64, device="cuda"))
    torch.testing.assert_close(compiled(x), 3 * (x @ model.w), atol=1e-3, rtol=1e-3)
    model.w.data = torch.randn(64, 64, device="cuda")  # the parameter now lives elsewhere
    torch.testing.assert_close(compiled(x), 3 * (x @ model.w), atol=1e-3, rtol=1e-3)
    assert _executor().num_captures == 2


# -- weak arguments of breaks -----------------------------------------------------------------------

STASHED: list[torch.Tensor] = []


@torch.library.custom_op("cptest_res_gpu::stash_scaled", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _stash_scaled(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    STASHED[:] = [x, n]  # an op that keeps its arguments (a cache)
    return x * int(n)


@_stash_scaled.register_fake
def _(x, n):
    return torch.empty_like(x)


@torch.no_grad()
def test_a_breaks_device_arguments_go_in_weak_and_its_host_arguments_as_they_are():
    """The activation a break reads lives in the owner's pool: the op gets a weak view of it and
    does not pin its block. A number on the host (a 0-d CPU tensor, the capture's host input
    buffer) goes in as it is: no pool keeps host memory, and a kept weak view of it would read
    or write what malloc put there since."""
    w = torch.randn(16, 16, device="cuda")

    def f(x, n):
        return torch.ops.cptest_res_gpu.stash_scaled(x @ w, n).relu()

    fn = torch.compile(f, backend="capturepass", options={"verify": True})
    for k in range(3):  # the first call captures; the others replay, the break between segments
        x, n = torch.randn(4, 16, device="cuda"), torch.tensor(k + 1)
        want = f(x, n)
        torch.testing.assert_close(fn(x, n), want, atol=1e-4, rtol=1e-4)
    kept_x, kept_n = STASHED
    assert kept_x.is_cuda and kept_n.device.type == "cpu"
    # A storage made over an address (a weak view) cannot be resized; an allocator's own can.
    assert not kept_x.untyped_storage().resizable()
    assert kept_n.untyped_storage().resizable() and int(kept_n) == 3
