"""The CUDA runtime on a real GPU: streams, events, monolithic and breakable capture, owners.

Every test here is marked ``gpu`` and skipped without CUDA. Hazard tests first
reproduce the failure in plain PyTorch, then show it absent through capturepass;
each docstring states the failure mechanism.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir import meta
from capturepass.runtime import capture
from capturepass.runtime.events import POOL
from capturepass.testing.models import AttnIndexer, MoEBlock
import tests.helpers  # noqa: F401 - registers torch.ops.cptest.host_round

pytestmark = pytest.mark.gpu

BF16 = dict(atol=3e-2, rtol=3e-2)


def _compile(model, **options):
    options.setdefault("verify", True)
    return torch.compile(model, backend="capturepass", options=options)


def _executor(kind: str = "inference"):
    graphs = [g for g in last_compiled() if g.name == kind]
    return graphs[-1].executor


@torch.no_grad()
@pytest.mark.parametrize("cudagraphs", ["monolithic", "none"])
def test_moe_equals_eager_and_replays_new_values(cudagraphs):
    torch.manual_seed(0)
    model = MoEBlock(512, 1024, 8, 256, 2, device="cuda", dtype=torch.bfloat16)
    compiled = _compile(model, cudagraphs=cudagraphs)
    for _ in range(4):
        x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), model(x), **BF16)
    gi = meta.graph_info(last_compiled()[-1].graph)
    assert len(gi.lanes) >= 2
    ex = _executor()
    assert ex.num_captures == (1 if cudagraphs == "monolithic" else 0)


@torch.no_grad()
def test_attention_indexer_equals_eager():
    torch.manual_seed(0)
    model = AttnIndexer(4, 8, 512, 64, 256, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    compiled = _compile(model)
    for _ in range(3):
        q, x = model.example_inputs()
        torch.testing.assert_close(compiled(q, x), model(q, x), **BF16)


class _WithBreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64, device="cuda")
        self.b = torch.nn.Linear(64, 64, device="cuda")

    def forward(self, x):
        h = self.a(x).relu()
        with capturepass.lane("aux"):
            side = (x * 2).sin()
        h = torch.ops.cptest.host_round(h)
        return self.b(h) * 0.5 + side


@torch.no_grad()
def test_breakable_capture_segments_and_replays():
    torch.manual_seed(0)
    model = _WithBreak()
    compiled = _compile(model, cudagraphs="breakable")
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(compiled(x), model(x))
    gi = meta.graph_info(last_compiled()[-1].graph)
    assert len(gi.segments) == 2
    assert [b.source for b in gi.breaks] == ["partition"]
    assert "cudagraph_unsafe" in gi.breaks[0].reason
    owner = _executor().owners[0]
    assert sorted(owner.graphs) == [0, 1]


@torch.no_grad()
def test_monolithic_with_a_break_switches_and_says_why():
    torch.manual_seed(0)
    model = _WithBreak()
    compiled = _compile(model, cudagraphs="monolithic")
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(compiled(x), model(x))
    gi = meta.graph_info(last_compiled()[-1].graph)
    assert gi.cudagraphs == "breakable"
    assert any("switched to breakable" in d for d in gi.decisions)


@torch.no_grad()
def test_capture_sizes_precaptures_and_bound_falls_back(caplog):
    torch.manual_seed(0)
    model = MoEBlock(128, 256, 4, 64, 2, device="cuda")
    compiled = torch.compile(
        model, backend="capturepass", dynamic=True, options={"capture_sizes": [4, 8, 16], "max_captures": 3}
    )
    x = torch.randn(8, 128, device="cuda")
    torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    ex = _executor()
    assert ex.num_captures == 3
    for t in (4, 16):
        x = torch.randn(t, 128, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert ex.num_captures == 3
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        x = torch.randn(5, 128, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert "max_captures=3" in caplog.text
    assert ex.num_captures == 3


@torch.no_grad()
def test_close_returns_memory_to_baseline():
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    x = torch.randn(16, 256, device="cuda")
    torch.cuda.synchronize()
    gc.collect()
    # cuBLAS's workspaces are the process's cache, which every capture clears: an earlier test's
    # eager matmul may have left one (32 MiB on an H200), which is not the baseline's to count.
    capture.clear_cublas_workspaces()
    baseline = torch.cuda.memory_allocated()
    compiled = _compile(model)
    compiled(x)
    ex = _executor()
    names = [o.name for o in ex.owners]
    assert all(POOL.live(n) > 0 for n in names)
    assert torch.cuda.memory_allocated() > baseline
    ex.close()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    assert all(POOL.live(n) == 0 for n in names)
    with pytest.raises(capturepass.CapturePassError, match="closed"):
        compiled(x)


@torch.no_grad()
def test_h3_no_event_serves_two_captures_or_capture_and_eager():
    """H3: an event recorded by eager code (or another capture) while a captured graph
    still refers to it aliases the graph's dependency (seed 000). Every lease key
    (owner, scope, role) must own its event objects alone."""
    torch.manual_seed(0)
    model = MoEBlock(128, 256, 4, 64, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True, options={"capture_sizes": [4, 8]})
    compiled(torch.randn(8, 128, device="cuda"))
    eager = torch.compile(MoEBlock(128, 256, 4, 64, 2, device="cuda"), backend="capturepass",
                          options={"cudagraphs": "none"})
    eager(torch.randn(8, 128, device="cuda"))
    leases = POOL.leases()
    ids = [lease[3] for lease in leases]
    assert len(ids) == len(set(ids)), "an event object serves two lease keys"
    scopes = {(owner, scope) for owner, scope, _, _ in leases}
    owners_with_capture = {o for o, s in scopes if s.startswith("capture")}
    owners_with_eager = {o for o, s in scopes if s == "eager"}
    assert len(owners_with_capture) >= 2
    for o in owners_with_capture & owners_with_eager:
        cap = {i for ow, s, _, i in leases if ow == o and s.startswith("capture")}
        eag = {i for ow, s, _, i in leases if ow == o and s == "eager"}
        assert not cap & eag


# -- H1: owners dropped after capture --------------------------------------------------------------

_BINDINGS: dict = {}
_RETAIN = {"on": True}


# The scratch is larger than any tensor the graphs allocate (2 MiB: the caching allocator's
# large pool), so that only the scratch block itself can satisfy a victim of its size: what a
# victim shares with the graph is then the scratch, not one of the graph's freed intermediates
# (a pool shared with an unrelated graph hands those out too, by the pool's own contract).
_SCRATCH_FACTOR = 8


class _Binding:
    """Owns scratch storage whose address a captured kernel bakes in."""

    def __init__(self, n: int, device) -> None:
        self.scratch = torch.empty(n * _SCRATCH_FACTOR, device=device)
        self.used = self.scratch[:n]


@torch.library.custom_op("cptest_gpu::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    key = (x.numel(), str(x.device))
    b = _BINDINGS.get(key)
    if b is None or torch.cuda.is_current_stream_capturing():
        # Bound at capture time, as kernels whose pointers are baked into a graph are:
        # the scratch comes from the capturing graph's pool.
        b = _BINDINGS[key] = _Binding(x.numel(), x.device)
    if _RETAIN["on"]:
        capturepass.retain(b)
    torch.mul(x.reshape(-1), 3.0, out=b.used)
    return b.used.view_as(x) + 1.0


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_gpu::scaled", overlap="safe")


def _second_graph_clobbered(pool, n: int, stream=None, outputs: int = 1):
    """Captures a second graph into ``pool`` (on ``stream``) whose ``outputs`` outputs (all 7.0)
    may reuse freed blocks; returns those outputs (one tensor when one) and the graph."""
    src = torch.full((n,), 7.0, device="cuda")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=pool, stream=stream):
        ys = [src * 1.0 for _ in range(outputs)]
    g2.replay()
    torch.cuda.synchronize()
    return (ys[0] if outputs == 1 else ys), g2


@torch.no_grad()
def test_h1_plain_pytorch_reproduces_clobbering():
    """H1 in plain PyTorch: the binding's scratch is allocated during capture of g1 and
    its last Python reference dies afterwards; the block returns to the pool, g2
    (same pool) allocates its output there, and every replay of g1 overwrites it."""
    n = 1 << 16
    x = torch.randn(n, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    g1 = torch.cuda.CUDAGraph()
    holder = []
    with torch.cuda.graph(g1, pool=pool):
        b = _Binding(n, "cuda")
        holder.append(b)
        torch.mul(x, 3.0, out=b.used)
        y1 = b.used + 1.0
    scratch_ptr = holder[0].scratch.data_ptr()
    holder.clear()
    del b
    gc.collect()
    y2, g2 = _second_graph_clobbered(pool, n * _SCRATCH_FACTOR)
    assert y2.data_ptr() == scratch_ptr, "the pool did not hand the freed scratch block to g2"
    assert torch.all(y2 == 7.0)
    g1.replay()
    torch.cuda.synchronize()
    assert not torch.all(y2 == 7.0), "replaying g1 should clobber g2's output (the hazard)"
    del y1


@torch.no_grad()
@pytest.mark.parametrize("retain", [True, False])
def test_h1_through_capturepass(retain):
    """H1 through capturepass: the op retains its binding during capture, so the owner
    keeps the scratch alive for the graph's life and neither a second graph in the
    owner's pool nor an eager allocation receives it. Without the retain call the
    evicted block is handed out again and the next replay clobbers its new user."""
    _BINDINGS.clear()
    _RETAIN["on"] = retain
    try:
        n = 1 << 16
        compiled = torch.compile(lambda x: torch.ops.cptest_gpu.scaled(x) * 2.0, backend="capturepass",
                                 options={"cudagraphs": "monolithic", "inner": "eager"})
        x = torch.randn(n, device="cuda")
        torch.testing.assert_close(compiled(x), (x * 3.0 + 1.0) * 2.0)
        owner = _executor().owners[0]
        scratch_ptr = next(iter(_BINDINGS.values())).scratch.data_ptr()
        assert (owner.num_retained > 0) == retain
        _BINDINGS.clear()  # the op's cache evicts the binding
        gc.collect()
        # The engine captures its next graph into the same pool on the same stream. Two outputs of
        # the scratch's size: the pool also holds the block of the warm-up's binding (the warm-up
        # runs in the pool too, and the capture bound a new one), which one of them may take.
        ys, g2 = _second_graph_clobbered(owner.pool, n * _SCRATCH_FACTOR, owner.capture_stream, outputs=2)
        eager_victim = torch.full((n * _SCRATCH_FACTOR,), 7.0, device="cuda")
        victims = [*ys, eager_victim]
        x2 = torch.randn(n, device="cuda")
        torch.testing.assert_close(compiled(x2), (x2 * 3.0 + 1.0) * 2.0)
        torch.cuda.synchronize()
        aliased = [v for v in victims if v.data_ptr() == scratch_ptr]
        if retain:
            assert not aliased
            assert all(torch.all(v == 7.0) for v in victims)
        else:
            assert aliased, "the evicted scratch block was not handed out again"
            assert not torch.all(aliased[0] == 7.0), "the replay should clobber the block's new user"
    finally:
        _RETAIN["on"] = True


# -- H2: cross-stream frees --------------------------------------------------------------------------

@torch.library.custom_op("cptest_gpu::slow_copy", mutates_args=())
def _slow_copy(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(2_000_000)  # ~1 ms: the read below starts late
    return x.clone()


@_slow_copy.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_gpu::slow_copy", overlap="safe")


def test_h2_plain_pytorch_reproduces_cross_stream_free():
    """H2 in plain PyTorch: t is allocated on the main stream and read late on an
    auxiliary stream; main drops t, the allocator hands its block to the next
    allocation on main, which overwrites it before the auxiliary read runs."""
    n = 1 << 20
    main = torch.cuda.current_stream()
    aux = torch.cuda.Stream()
    bad = 0
    for _ in range(5):
        t = torch.full((n,), 1.0, device="cuda")
        aux.wait_stream(main)
        with torch.cuda.stream(aux):
            torch.cuda._sleep(2_000_000)
            seen = t * 1.0
        del t
        u = torch.full((n,), 5.0, device="cuda")  # reuses t's block on main
        main.wait_stream(aux)
        torch.cuda.synchronize()
        bad += int(not torch.all(seen == 1.0))
        del u, seen
    assert bad > 0, "the hazard did not reproduce"


@pytest.mark.parametrize("cudagraphs", ["none", "monolithic"])
def test_h2_deferred_release_prevents_reuse(cudagraphs):
    """Through capturepass the same pattern gets a deferred release: t stays alive
    until main has waited for the auxiliary read."""

    def f(x):
        t = x + 1.0  # allocated on main
        with capturepass.lane("aux"):
            seen = torch.ops.cptest_gpu.slow_copy(t)  # read late on aux
        u = torch.full_like(x, 5.0) * x  # main allocates again right away
        return seen * 2.0, u

    # pick="model": every uncaptured call on the lanes (a measured choice runs some on one stream).
    compiled = torch.compile(f, backend="capturepass", options={"cudagraphs": cudagraphs, "inner": "eager",
                                                                  "policy": "hints", "verify": True, "pick": "model"})
    for _ in range(4):
        x = torch.randn(1 << 20, device="cuda")
        got = compiled(x)
        want = f(x)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    counters = last_compiled()[-1].counters
    assert counters["insert_syncs"]["releases"] >= 1


# -- two owners: target and draft -------------------------------------------------------------------

@torch.library.custom_op("cptest_gpu::with_workspace", mutates_args=())
def _with_workspace(x: torch.Tensor) -> torch.Tensor:
    ws = capturepass.workspace("scratch", (x.numel(),), x.dtype, x.device)
    _WS_PTRS.add(ws.data_ptr())
    torch.mul(x.reshape(-1), 2.0, out=ws)
    return ws.view_as(x) + 0.5


_WS_PTRS: set = set()


@_with_workspace.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_gpu::with_workspace", overlap="safe", resources=("scratch",))


@torch.no_grad()
def test_target_and_draft_owners_are_disjoint():
    torch.manual_seed(0)
    target = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    draft = MoEBlock(256, 256, 4, 64, 2, device="cuda")

    def with_ws(m):
        return lambda x: m(torch.ops.cptest_gpu.with_workspace(x))

    # The cost model's lanes (a measured choice of one lane would lease no event to compare).
    ct = torch.compile(with_ws(target), backend="capturepass", options={"verify": True, "pick": "model"})
    cd = torch.compile(with_ws(draft), backend="capturepass", options={"verify": True, "pick": "model"})
    _WS_PTRS.clear()
    xs = [torch.randn(16, 256, device="cuda") for _ in range(6)]
    for i, x in enumerate(xs):  # interleaved replays
        m, c = (target, ct) if i % 2 == 0 else (draft, cd)
        torch.testing.assert_close(c(x), m(x * 2.0 + 0.5), atol=1e-4, rtol=1e-4)
    owners = [g.executor.owners[0] for g in last_compiled() if g.executor is not None][-2:]
    a, b = owners
    assert a.name != b.name
    assert a.pool != b.pool
    lease_owners = {o for o, _, _, _ in POOL.leases()}
    assert a.name in lease_owners and b.name in lease_owners
    ids_a = {i for o, _, _, i in POOL.leases() if o == a.name}
    ids_b = {i for o, _, _, i in POOL.leases() if o == b.name}
    assert not ids_a & ids_b
    ws_a = {t.data_ptr() for t in a.workspaces.buffers().values()}
    ws_b = {t.data_ptr() for t in b.workspaces.buffers().values()}
    assert ws_a and ws_b and not ws_a & ws_b


@torch.no_grad()
def test_soak_capture_replay_close_is_flat():
    """1000 cycles of capture, replay and release keep memory, leases and retained objects flat:
    memory allocated, and memory reserved (a released pool is returned to the device, not kept
    until the allocator runs out)."""
    torch.manual_seed(0)
    model = MoEBlock(64, 128, 4, 32, 2, device="cuda")
    compiled = _compile(model, cudagraphs="monolithic", verify=False)
    x = torch.randn(8, 64, device="cuda")
    want = model(x)
    compiled(x)
    ex = _executor()
    ex.release_captures()
    gc.collect()
    torch.cuda.synchronize()
    base_mem, base_reserved, base_leases = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), POOL.live()
    for i in range(1000):
        out = compiled(x)  # captures, replays
        assert ex.num_captures == 1
        assert sum(o.num_retained for o in ex.owners) > 0
        ex.release_captures()
        if i % 100 == 0:
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        del out
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base_mem
    assert torch.cuda.memory_reserved() <= base_reserved
    assert POOL.live() == base_leases
    assert sum(o.num_retained for o in ex.owners) == 0


@torch.no_grad()
def test_inside_an_outer_capture_emits_into_it():
    """An engine captures around the compiled model: capturepass starts no capture of
    its own and forks its lanes from the capturing stream."""
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = _compile(model)
    x = torch.randn(16, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled(x)  # warm-up (captures its own graph outside the engine's capture)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ex = _executor()
    before = ex.num_captures
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = compiled(x)
    assert ex.num_captures == before
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    scopes = {scope for owner, scope, _, _ in POOL.leases() if owner == ex.owners[-1].name}
    assert "outer" in scopes


def test_training_step_forward_captured_backward_eager():
    """Training: the forward graph is captured, the backward runs uncaptured on one lane;
    gradients and the updated weights equal eager's."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 64, device="cuda")
            self.b = torch.nn.Linear(64, 64, device="cuda")

        def forward(self, x):
            with capturepass.lane("aux"):
                side = self.b(x).tanh()
            return (self.a(x).relu() + side).pow(2).mean()

    ref = Net()
    net = Net()
    net.load_state_dict(ref.state_dict())
    compiled = torch.compile(net, backend="capturepass", options={"verify": True})
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(16, 64, device="cuda")
        for m, o, f in ((ref, opt_ref, ref), (net, opt, compiled)):
            o.zero_grad()
            f(x).backward()
            o.step()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    kinds = {g.name for g in last_compiled()}
    assert {"forward", "backward"} <= kinds
    fwd = [g for g in last_compiled() if g.name == "forward"][-1]
    assert meta.graph_info(fwd.graph).cudagraphs == "monolithic"
    bwd = [g for g in last_compiled() if g.name == "backward"][-1]
    assert meta.graph_info(bwd.graph).cudagraphs == "none"
