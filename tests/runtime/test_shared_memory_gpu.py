"""The capture shapes of one model share one memory pool and its lanes' streams; two models never do.

Every test is marked ``gpu`` and skipped without CUDA. Sharing is only sound if each
capture's outputs and buffers stay out of the memory the others are handed, so the
tests replay the shapes interleaved with new values and compare every result, and
held results, with eager.
"""

from __future__ import annotations

import gc

import pytest
import torch

from capturepass.backends.compile import last_compiled
from capturepass.testing.models import MoEBlock
from tests.helpers import compiled_since

pytestmark = pytest.mark.gpu

TOL = dict(atol=1e-4, rtol=1e-4)


def _executor():
    return [g for g in last_compiled() if g.name == "inference"][-1].executor


def _captures(ex):
    return {key[1]: cap for key, cap in ex._captures.items()}


def _held_calls(fn, model, sizes, hidden=256):
    """Calls ``fn`` at each batch size of ``sizes`` with new values, each result equal to eager,
    and compares every result with eager again after all the calls (the sizes' replays write
    memory their captures share: a result still held is copied out before that)."""
    held = []
    for t in sizes:
        x = torch.randn(t, hidden, device="cuda")
        got = fn(x)
        torch.testing.assert_close(got, model(x), **TOL)
        held.append((x, got))
    torch.cuda.synchronize()
    for x, got in held:
        torch.testing.assert_close(got, model(x), **TOL)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["auto", "off"])
def test_shapes_of_one_model_share_a_pool_and_streams(policy):
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"capture_sizes": [4, 8, 16], "policy": policy, "verify": True})
    x = torch.randn(8, 256, device="cuda")
    torch.testing.assert_close(compiled(x), model(x), **TOL)
    ex = _executor()
    caps = list(ex._captures.values())
    assert len(caps) == 3
    owners = [c.owner for c in caps]
    assert len({o.pool for o in owners}) == 1, [o.pool for o in owners]
    assert len({id(o.shared) for o in owners}) == 1 and owners[0].shared is not None
    assert owners[0].shared.users == 3
    assert len({id(o.capture_stream) for o in owners}) == 1
    # The side streams are the model's, by role: stream k of every capture is one stream
    # (cuBLAS keeps one workspace per stream), whichever lanes each shape's measured schedule
    # put on it (a lane map sends some to the caller's stream: None).
    sides = owners[0].shared.streams[1:]
    for o in owners:
        assert len(o.streams) == len(o.lane_map) - 1
        for k, stream in zip(o.lane_map[1:], o.streams):
            assert stream is (sides[k - 1] if k else None), (o.name, o.lane_map)
    assert len({o.lock for o in owners}) == 1


@torch.no_grad()
def test_interleaved_shapes_and_held_results_stay_equal_to_eager():
    """A shape's replay writes temporaries that other shapes' captures reuse; never their outputs."""
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"capture_sizes": [4, 8, 16], "verify": True})
    _held_calls(compiled, model, (16, 4, 8, 16, 8, 4, 4, 16))
    assert _executor().num_captures == 3


@torch.no_grad()
def test_two_models_never_share_and_a_closed_pool_is_renewed():
    torch._dynamo.reset()
    torch.manual_seed(0)
    a = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    b = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = {m: torch.compile(m, backend="capturepass", options={"verify": True}) for m in (a, b)}
    for m in (a, b, a, b):  # one graph serves the class: two model instances of one executor
        x = torch.randn(8, 256, device="cuda")
        torch.testing.assert_close(compiled[m](x), m(x), **TOL)
    ex = _executor()
    caps = list(ex._captures.values())
    assert len(caps) == 2
    assert caps[0].owner.pool != caps[1].owner.pool
    assert caps[0].owner.shared is not caps[1].owner.shared
    shared = caps[0].owner.shared
    pool = caps[0].owner.pool
    ex.release_captures()
    gc.collect()
    assert shared.users == 0
    x = torch.randn(8, 256, device="cuda")
    torch.testing.assert_close(compiled[a](x), a(x), **TOL)
    again = [c for c in ex._captures.values()]
    assert len(again) == 1 and again[0].owner.shared is shared and again[0].owner.pool != pool


@torch.no_grad()
def test_memory_held_grows_with_the_largest_shape_not_the_number_of_shapes():
    """Eight sizes captured into one pool hold less than twice what the largest alone holds."""
    torch.manual_seed(0)
    model = MoEBlock(512, 2048, 8, 512, 2, device="cuda")
    sizes = [64, 56, 48, 40, 32, 24, 16, 8]

    def held(capture_sizes):
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        fn = torch.compile(model, backend="capturepass", dynamic=True,
                           options={"capture_sizes": capture_sizes, "policy": "off"})
        x = torch.randn(capture_sizes[0], 512, device="cuda")
        torch.testing.assert_close(fn(x), model(x), **TOL)
        torch.cuda.synchronize()
        gc.collect()
        grown = torch.cuda.memory_reserved() - before
        _executor().release_captures()
        del fn
        return grown

    one = held(sizes[:1])
    many = held(sizes)
    assert many < 2 * one, (many / 2**20, one / 2**20)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["auto", "off"])
def test_no_cublas_workspace_stays_allocated_after_a_capture(policy):
    """A capture's cuBLAS workspaces are the graphs' memory once it ends: they are freed into the
    pool (as cudagraph trees do), not kept allocated in cuBLAS's cache, where the next shape's
    warm-up would peak with them beside its own. Dropping the cache after the call frees nothing."""
    torch.manual_seed(0)
    model = MoEBlock(512, 2048, 8, 512, 2, device="cuda")
    fn = torch.compile(model, backend="capturepass", dynamic=True,
                       options={"capture_sizes": [16, 8], "policy": policy})
    x = torch.randn(16, 512, device="cuda")
    want = model(x)
    torch.cuda.synchronize()
    from capturepass.runtime import capture

    capture.clear_cublas_workspaces()  # eager's workspace on this stream: not the capture's
    got = fn(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    capture.clear_cublas_workspaces()
    assert torch.cuda.memory_allocated() == held, (held - torch.cuda.memory_allocated()) / 2**20
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(fn(x), want, **TOL)  # the graph replays over the workspace it was given


class _ThreeProducts(torch.nn.Module):
    """A matrix product on each of three hinted lanes."""

    def __init__(self, d: int = 512) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, d, d, device="cuda") * d**-0.5, requires_grad=False)

    def forward(self, x):
        import capturepass

        with capturepass.lane("a"):
            a = torch.relu(x @ self.w[1])
        with capturepass.lane("b"):
            b = torch.tanh(x @ self.w[2])
        return torch.sigmoid(x @ self.w[0]) + a + b


@torch.no_grad()
def test_a_capture_on_three_streams_holds_a_divided_cublas_workspace_where_torch_can_set_its_size(tmp_path):
    """Each stream that runs a matrix product in a capture holds a cuBLAS workspace. Where torch can
    set the size at run time, a capture on three streams divides the process's size among them
    (``capture.split_cublas_workspace``); where it reads the size once, each holds a whole one.
    One lane's capture holds one whole workspace either way."""
    from capturepass.runtime import capture

    torch.manual_seed(0)
    model = _ThreeProducts()
    x = torch.randn(64, 512, device="cuda")
    held = {}
    for policy in ("off", "hints"):
        torch._dynamo.reset()
        fn = torch.compile(model, backend="capturepass",
                           options={"policy": policy, "pick": "model", "pick_cache_dir": str(tmp_path)})
        torch.testing.assert_close(fn(x), model(x), **TOL)
        torch.testing.assert_close(fn(x + 1), model(x + 1), **TOL)  # replayed over its workspaces
        (cap,) = _executor()._captures.values()
        held[policy] = (1 + len({id(s) for s in cap.owner.streams if s is not None}), cap.workspace_bytes)
    (one, whole), (three, divided) = held["off"], held["hints"]
    assert (one, three) == (1, 3) and whole > 0
    with capture.split_cublas_workspace(3) as share:  # None where torch reads the size once
        pass
    assert divided == 3 * (share or whole), (divided, whole, share)
    api = capture.workspace_size_setter()
    assert api is None or api[0]() == whole  # the process's size is set back


def _trace() -> list[dict]:
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


@torch.no_grad()
def test_a_warm_up_runs_every_lane_on_one_stream(monkeypatch):
    """A multi-lane graph's warm-up runs its side lanes on the capture stream: it allocates
    nothing on a side stream (no cuBLAS workspace per side stream beside the L2-sized buffer
    Triton's tuning flushes with). Its capture runs them on their streams, and the graph
    replays equal to eager."""
    from capturepass.runtime import capture

    torch.manual_seed(0)
    model = MoEBlock(512, 2048, 8, 512, 2, device="cuda")
    fn = torch.compile(model, backend="capturepass", options={"pick": "model", "verify": True})
    x = torch.randn(16, 512, device="cuda")
    want = model(x)
    cut: list[int] = []  # trace entries before the capture's first clear: the warm-up's
    clear = capture.clear_cublas_workspaces

    def marked() -> None:
        if not cut:
            cut.append(len(_trace()))
        clear()

    monkeypatch.setattr(capture, "clear_cublas_workspaces", marked)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        got = fn(x)
        torch.cuda.synchronize()
        trace = _trace()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    torch.testing.assert_close(got, want, **TOL)
    (cap,) = _executor()._captures.values()
    sides = {s.cuda_stream for s in cap.owner.side_streams}
    assert sides  # the cost model's schedule has side lanes
    assert cut and len(trace) > cut[0]

    def on_sides(entries: list[dict]) -> list[tuple[str, int]]:
        return [(e["action"], e["size"]) for e in entries if e["action"] == "alloc" and e["stream"] in sides]

    assert on_sides(trace[:cut[0]]) == []
    assert on_sides(trace[cut[0]:])  # the capture's side lanes allocate on their streams, in the pool
    x2 = torch.randn(16, 512, device="cuda")
    torch.testing.assert_close(fn(x2), model(x2), **TOL)


@torch.no_grad()
def test_replays_of_two_shapes_on_two_streams_run_one_after_the_other():
    """Two micro-batches of one model on two streams, as dual-batch overlap runs them: the second
    replay waits for the first (they share the pool's temporaries), and both equal eager."""
    torch.manual_seed(0)
    model = MoEBlock(1024, 4096, 8, 1024, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"capture_sizes": [64, 32], "policy": "off", "verify": True})
    main = torch.cuda.current_stream()
    x = torch.randn(48, 1024, device="cuda")
    torch.testing.assert_close(compiled(x), model(x), **TOL)  # compiles and captures 64 and 32
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(10):
        xa, xb = torch.randn(64, 1024, device="cuda"), torch.randn(32, 1024, device="cuda")
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            ya = compiled(xa)
        with torch.cuda.stream(s2):
            yb = compiled(xb)
        main.wait_stream(s1)
        main.wait_stream(s2)
        torch.testing.assert_close(ya, model(xa), **TOL)
        torch.testing.assert_close(yb, model(xb), **TOL)
    ex = _executor()
    assert ex.num_captures == 3  # 64 and 32 up front, 48 at the first call
    (shared,) = {id(c.owner.shared): c.owner.shared for c in ex._captures.values()}.values()
    assert shared.last_raw == s2.cuda_stream  # the last replay ran on s2, after waiting for s1


def _in(t: torch.Tensor, segs: list[dict]) -> bool:
    return any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segs)


@torch.no_grad()
@pytest.mark.parametrize("pick", ["measure", "model"])
def test_warm_ups_take_their_memory_from_the_models_pool(pick):
    """The warm-ups of a model's first shape (the measured choice warms all its candidates up
    before it captures any) run where the captures run: on the capture stream (every lane),
    their allocations in the model's pool. Nothing they free stays reserved in a
    stream's own cache (which no capture reuses), and the result returned does not lie in the pool."""
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True, options={"verify": True, "pick": pick})
    x = torch.randn(8, 256, device="cuda")
    # torch allocates the CUDA generator's graph seed and offset (outside any pool, on the
    # stream of the capture that registers first) whenever no graph is registered: one is.
    anchor = torch.cuda.CUDAGraph()
    with torch.cuda.graph(anchor):
        torch.ones(1, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    first = compiled(x)  # warm-up (the candidates' too), captures
    torch.cuda.synchronize()
    torch.testing.assert_close(first, model(x), **TOL)
    owner = next(iter(_executor()._captures.values())).owner
    streams = {s.cuda_stream for s in owner.shared.streams}
    assert len(streams) >= 2  # the cost model's schedule has side lanes
    segs = torch.cuda.memory_snapshot()
    outside = [(hex(s["stream"]), s["total_size"]) for s in segs
               if s["address"] not in before and tuple(s["segment_pool_id"]) == (0, 0) and s["stream"] in streams]
    assert outside == []
    pool = [s for s in segs if tuple(s["segment_pool_id"]) == tuple(owner.pool)]
    assert pool and not _in(first, pool)


@torch.no_grad()
def test_first_results_stay_equal_to_eager_while_other_shapes_replay():
    """The first call of a shape returns its warm-up's result, computed in the shared pool; the
    warm-up of shape 8 may take blocks that shape 16's graph writes as temporaries, so that
    result is copied out before the call returns."""
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True, options={"verify": True})
    held = []
    for t in (16, 8, 4):  # each first call: a warm-up and a capture
        x = torch.randn(t, 256, device="cuda")
        held.append((x, compiled(x)))
    for _ in range(3):
        for t in (16, 8, 4):
            x = torch.randn(t, 256, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    torch.cuda.synchronize()
    for x, got in held:
        torch.testing.assert_close(got, model(x), **TOL)
    assert _executor().num_captures == 3


@torch.no_grad()
def test_graphs_dynamo_compiles_for_other_shapes_of_one_model_share_its_pool():
    """Batch 1 is another Dynamo graph (0/1 specialization) of the same frame and parameters:
    its captures join the model's pool and streams; results held across both stay equal to eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    compiled = torch.compile(model, backend="capturepass", dynamic=True, options={"verify": True})
    _held_calls(compiled, model, (8, 1, 8, 1, 4, 1))
    graphs = [g for g in last_compiled() if g.name == "inference" and g.executor is not None][-2:]
    owners = [c.owner for g in graphs for c in g.executor._captures.values()]
    assert len(owners) == 3  # 8 and 4 in the dynamic graph, 1 in its own
    assert len({id(o.shared) for o in owners}) == 1 and len({o.pool for o in owners}) == 1


_TABLES: dict = {}


@torch.library.custom_op("cptest_shared::tabled", mutates_args=())
def _tabled(x: torch.Tensor) -> torch.Tensor:
    # A table made on the first call of each shape and kept (as kernels keep workspaces and
    # lookup tables): its memory must hold its values for every later call.
    key = (tuple(x.shape), str(x.device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.arange(x.numel(), device=x.device, dtype=x.dtype).view_as(x) * 0.5
    return x * 2.0 + table


@_tabled.register_fake
def _(x):
    return torch.empty_like(x)


@torch.no_grad()
def test_an_ops_cache_made_in_a_later_warm_up_is_never_another_captures_temporary():
    """Shape 32's warm-up runs while shape 64's graph lives in the model's pool, whose
    temporaries are free blocks there: the table the op keeps from that warm-up must not take
    one (64's replays would overwrite it), so that warm-up runs outside the pool."""
    import capturepass

    capturepass.register_capability("cptest_shared::tabled", overlap="safe")
    _TABLES.clear()
    torch.manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda") / 45

    def f(x):
        h = torch.relu(x @ w) @ w  # temporaries of the table's size and more
        return torch.ops.cptest_shared.tabled(h) + x

    def expected(x):
        h = torch.relu(x @ w) @ w
        return h * 2.0 + torch.arange(h.numel(), device="cuda", dtype=h.dtype).view_as(h) * 0.5 + x

    compiled = torch.compile(f, backend="capturepass", dynamic=True, options={"verify": True})
    for t in (64, 32):  # each first call: a warm-up, then a capture
        x = torch.randn(t, 2048, device="cuda")
        torch.testing.assert_close(compiled(x), expected(x), **TOL)
    owner = next(iter(_executor()._captures.values())).owner
    pool = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(owner.pool)]
    assert _in(_TABLES[((64, 2048), "cuda:0")], pool)  # the first warm-up's: in the pool, safely
    assert not _in(_TABLES[((32, 2048), "cuda:0")], pool)
    for _ in range(3):
        for t in (64, 32):
            x = torch.randn(t, 2048, device="cuda")
            torch.testing.assert_close(compiled(x), expected(x), **TOL)


@torch.no_grad()
def test_captured_outputs_and_input_buffers_go_back_to_the_pool():
    """Once captured, a capture holds its outputs and input buffers over non-owning storages:
    their blocks are free blocks of the model's pool, which its later (smaller) captures take.
    Eight sizes of a projection to 8192 logits (outputs of 16 MiB at the largest, 72 MiB over
    all) leave almost nothing allocated; the replays, called in any order with results held,
    stay equal to eager."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 8192, device="cuda")
    sizes = [512, 448, 384, 320, 256, 192, 128, 64]
    x = torch.randn(sizes[0], 256, device="cuda")
    want = model(x)  # eager's cuBLAS workspace on this stream (32 MiB on an H200): before, not grown
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fn = torch.compile(model, backend="capturepass", dynamic=True,
                       options={"capture_sizes": sizes, "policy": "off", "verify": True})
    torch.testing.assert_close(fn(x), want, **TOL)
    gc.collect()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    caps = _captures(_executor())
    assert len(caps) == len(sizes) and all(c.let_go for c in caps.values())
    largest = sizes[0] * 8192 * 4
    assert grown < largest, grown / 2**20
    calls = (64, 512, 128, 64, 448, 512)
    _held_calls(fn, model, calls)  # each rescued before another size's graph wrote its blocks
    assert sum(c.outputs.rescues for c in caps.values()) >= len(calls) - 1


@torch.library.custom_op("cptest_shared::shift_by", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _shift_by(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return x + int(n)  # n: a number on the host, read by the break at every call


@_shift_by.register_fake
def _(x, n):
    return torch.empty_like(x)


@torch.no_grad()
def test_a_host_input_buffer_keeps_its_memory_when_the_capture_lets_go():
    """Only the pool keeps a block once no tensor owns it. A per-call number on the host (a 0-d
    CPU tensor, read by a break, as transformers' generation passes one) gets a host buffer that
    the copy in writes at every call: held over a non-owning storage, its memory went back to
    malloc while every call still wrote it, corrupting the host heap. It keeps its memory; the
    device's buffers still go back to the pool; every call, with host allocations churning in
    between, equals eager."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda") / 8

    def f(x, n):
        return torch.relu(torch.ops.cptest_shared.shift_by(x @ w, n)) * 2

    fn = torch.compile(f, backend="capturepass", options={"verify": True})
    for k in range(6):
        x, n = torch.randn(16, 64, device="cuda"), torch.tensor(k)
        torch.testing.assert_close(fn(x, n), f(x, n), **TOL)
        churn = [torch.full((), -1, dtype=torch.int64) for _ in range(256)]  # blocks of n's size
        assert all(int(c) == -1 for c in churn)
    (cap,) = _captures(_executor()).values()
    assert cap.let_go and cap.uncaptured
    host = [b for b in cap.inputs.values() if b.device.type == "cpu"]
    device = [b for b in cap.inputs.values() if b.device.type == "cuda"]
    assert len(host) == 1 and device
    # A storage made over an address (non-owning) cannot be resized; the allocator's own can.
    assert host[0].untyped_storage().resizable()
    assert not any(b.untyped_storage().resizable() for b in device)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["auto", "off"])
def test_an_output_held_while_another_shape_is_captured_keeps_its_values(policy):
    """A new shape's capture moves its input buffers into the model's pool, where they may take
    the block of an output of another shape the caller holds: that output is copied out first.
    The measured choice (``auto``) times its candidates on the call's inputs, copied in again
    before each candidate's replays; each shape is captured once."""
    torch.manual_seed(0)
    model = MoEBlock(256, 512, 4, 128, 2, device="cuda")
    fn = torch.compile(model, backend="capturepass", dynamic=True, options={"policy": policy, "verify": True})
    _held_calls(fn, model, (16, 16, 8, 8, 4, 16, 4, 8))  # a replay's output held across the next size's capture
    ex = _executor()
    assert ex.num_captures == 3 and all(c.let_go for c in ex._captures.values())


def test_two_models_captured_on_two_threads_stay_equal_to_eager():
    """A target and a draft captured on two threads at once: their captures take turns
    (``capture.exclusive``: cuBLAS's workspace cache, cleared around each capture, is the
    process's), and every result equals eager."""
    import threading

    torch.manual_seed(0)
    # Two graphs (two executors), whose captures no lock of a model or executor serializes.
    models = [MoEBlock(256, 512, 4, 128, 2, device="cuda"),
              torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()]
    fns = [torch.compile(m, backend="capturepass", dynamic=True, options={"verify": True}) for m in models]
    # Inputs are drawn here: torch's CUDA generator refuses an eager draw on one thread while
    # another thread captures ("Offset increment outside graph capture"), whoever captures.
    xs = [torch.randn(t, 256, device="cuda") for t in (16, 12, 8, 4, 16, 8)]
    with torch.no_grad():
        wants = [[m(x) for x in xs] for m in models]
        # Dynamo compiles here: its FX tracing flag is the process's, so a compiled call on one
        # thread while Dynamo traces on another fails ("symbolically trace a dynamo-optimized
        # function"). The threads' sizes are new shapes of the graphs compiled here: each
        # thread's first call at one captures.
        before = last_compiled()
        for fn in fns:
            for t in (32, 24):
                fn(torch.randn(t, 256, device="cuda"))
    executors = [g.executor for g in compiled_since(before) if g.name == "inference"]
    assert [ex.num_captures for ex in executors] == [2, 2]  # one graph per model (dynamic=True): 32 and 24
    errors = []

    @torch.no_grad()
    def run(k):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for x, want in zip(xs, wants[k]):
                    torch.testing.assert_close(fns[k](x), want, **TOL)
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors
    assert [ex.num_captures for ex in executors] == [6, 6]  # 16, 12, 8 and 4 captured on the threads


@torch.no_grad()
@pytest.mark.parametrize("pick", ["measure", "model"])
def test_the_first_call_of_a_recompiled_graph_releases_what_its_capture_left_cached(pick):
    """A shape Dynamo compiles again (the second shape of a frame compiled static) is the first
    call of a new compiled function, which AOT autograd runs under its custom-op aliasing mode.
    Its warm-up runs outside the model's pool (the first shape's graph lives there), and what
    the warm-up and the measured choice's other candidates left in the allocator's caches is
    released after the capture: no idle segment outside a pool stays reserved (here one of
    64 MiB made before the call, which a release takes with the rest)."""
    torch.manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda") / 45

    def f(x):
        return torch.relu(x @ w) @ w + x

    fn = torch.compile(f, backend="capturepass", options={"pick": pick, "verify": True})
    x = torch.randn(64, 2048, device="cuda")
    torch.testing.assert_close(fn(x), f(x), **TOL)
    before = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del before  # an idle 64 MiB segment of the current stream's cache
    torch.cuda.synchronize()
    def idle() -> list[float]:  # MiB of the idle segments of 64 MiB or more outside any pool
        return [s["total_size"] / 2**20 for s in torch.cuda.memory_snapshot()
                if tuple(s["segment_pool_id"]) == (0, 0) and s["allocated_size"] == 0 and s["total_size"] >= 64 * 2**20]

    assert idle()
    first = last_compiled()[-1]
    x = torch.randn(32, 2048, device="cuda")
    got = fn(x)
    assert last_compiled()[-1] is not first  # compiled again: this call is the new function's first
    assert not idle(), idle()
    torch.testing.assert_close(got, f(x), **TOL)
    for t in (64, 32, 64):
        x = torch.randn(t, 2048, device="cuda")
        torch.testing.assert_close(fn(x), f(x), **TOL)
