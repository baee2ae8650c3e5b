"""The whole capture-and-replay path of ``runtime.replay`` on the host, with CUDA graphs simulated.

A CUDA graph replays its kernels into the addresses its capture saw. The stand-in
(``capturepass.testing.host_graphs``) keeps, when a segment "captures", the tensors it read; its
replay runs the piece again on those same input tensors (so it reads what the call copied into
them, and writes what it writes in place again) and copies the results into the captured output
tensors, as a replay overwrites its pool. Everything else is the real runtime: the executor's
keys and in-place rule, the input buffers and copies, the output aliases and their rescue. The
GPU halves are in ``test_outputs_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from capturepass.backends.compile import last_compiled
from capturepass.runtime import executor as executor_module
from capturepass.runtime import outputs
from capturepass.runtime import replay as replay_module
from capturepass.testing.host_graphs import HostGraphCapture
import tests.helpers  # noqa: F401 - registers torch.ops.cptest.host_round

pytestmark = pytest.mark.skipif(outputs.UNSUPPORTED is not None, reason=str(outputs.UNSUPPORTED))


@pytest.fixture(params=["swap", "move", "environment"])
def simulated(monkeypatch, request):
    """CUDA graphs simulated on the host (``capturepass.testing.host_graphs``); held outputs
    rescued by swapping their storage's memory, or by moving their tensors (torch without
    ``_swap_data_ptr_``, as on torch 2.11); ``environment``: every replay threads the graph's
    values through its environment (the path of programs with breaks), never the direct one."""
    swap = request.param != "move"
    if swap and not outputs.SWAP:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(outputs, "SWAP", swap)
    monkeypatch.setattr(executor_module, "Capture", HostGraphCapture)
    if request.param == "environment":
        monkeypatch.setattr(replay_module._Direct, "of", classmethod(lambda cls, cap: None))
    return request.param


def _compile(model, **options):
    options.setdefault("inner", "eager")
    options.setdefault("verify", True)
    options.setdefault("cudagraphs", "monolithic")
    return torch.compile(model, backend="capturepass", options=options)


def _capturing_executor():
    ex = [g for g in last_compiled() if g.name == "inference"][-1].executor
    ex.captured = True  # as on a GPU: the calls from now on capture and replay
    return ex


def _only_capture(ex):
    caps = list(ex._captures.values())
    assert len(caps) == 1, list(ex._captures)
    return caps[0]


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x).relu()
        y = self.b(h)
        return y, y[:, :4], h.tanh()


def _prime(compiled, *args):
    """The first call compiles (and runs eagerly on the host); the executor captures from the next."""
    compiled(*args)
    return _capturing_executor()


@torch.no_grad()
def test_held_outputs_keep_their_values_across_replays(simulated):
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    xs = [torch.randn(4, 16) for _ in range(4)]
    got = [compiled(x) for x in xs]  # call 1 captures; 2..4 replay into the same memory
    for x, out in zip(xs, got):
        want = model(x)
        for i in range(3):
            assert torch.equal(out[i], want[i])
    cap = _only_capture(ex)
    assert (cap.direct is not None) == (simulated != "environment")
    y, head, _ = got[-1]
    assert head.untyped_storage()._cdata == y.untyped_storage()._cdata
    pool = {t.data_ptr() for outs in cap.seg_out.values() for t in outs}
    assert y.data_ptr() in pool  # the last call's outputs are still the pool's memory: never copied
    assert (cap.outputs.aliased, cap.outputs.rescues, cap.outputs.copies) == (9, 4, 0)


@torch.no_grad()
def test_dropped_outputs_cost_no_copy(simulated):
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    for _ in range(5):
        x = torch.randn(4, 16)
        assert all(torch.equal(g, w) for g, w in zip(compiled(x), model(x)))
    cap = _only_capture(ex)
    assert (cap.outputs.aliased, cap.outputs.rescues) == (12, 0)


class _Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h):
        return self.lin(h).tanh() + h


@torch.no_grad()
def test_an_output_fed_back_as_the_next_input_gives_eagers_result(simulated):
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(2, 8))
    h = want = torch.randn(2, 8)
    for _ in range(4):
        h = compiled(h)
        want = model(want)
        assert torch.equal(h, want)
    cap = _only_capture(ex)
    assert cap.outputs.rescues == 2 and cap.input_copies == 3


@torch.no_grad()
def test_static_outputs_are_the_pools_own_and_overwritten_by_the_next_call(simulated):
    """The hazard the aliases remove, as static_outputs documents it."""
    torch.manual_seed(0)
    model = _Step()
    compiled = _compile(model, static_outputs=True)
    ex = _prime(compiled, torch.randn(2, 8))
    x1, x2, x3 = (torch.randn(2, 8) for _ in range(3))
    compiled(x1)
    out2 = compiled(x2)
    assert torch.equal(out2, model(x2))
    out3 = compiled(x3)
    assert out3 is out2 and torch.equal(out2, model(x3))
    assert _only_capture(ex).outputs is None


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(4, 4)

    def forward(self, x, cache, pos):
        cache.index_copy_(0, pos, self.k(x))
        return cache.sum(0) * 0.5


@torch.no_grad()
def test_a_cache_at_a_fixed_address_is_written_in_place_without_a_copy(simulated):
    torch.manual_seed(0)
    model = _Cache()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(1, 4), torch.zeros(8, 4), torch.tensor([0]))
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    for step in range(5):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        assert torch.equal(compiled(x, cache, pos), model(x, ref, pos))
        assert torch.equal(cache, ref)
    cap = _only_capture(ex)
    assert list(cap.in_place_ptrs.values()) == [cache.data_ptr()]
    assert cap.input_copies == 4 * 2  # x and pos into their buffers; the cache neither in nor back


@torch.no_grad()
def test_a_cache_that_moves_is_copied_and_still_equals_eager(simulated):
    torch.manual_seed(0)
    model = _Cache()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(1, 4), torch.zeros(8, 4), torch.tensor([0]))
    caches = [torch.zeros(8, 4), torch.ones(8, 4)]
    refs = [c.clone() for c in caches]
    for step in range(6):
        x, pos = torch.randn(1, 4), torch.tensor([step // 2])
        c, r = caches[step % 2], refs[step % 2]
        assert torch.equal(compiled(x, c, pos), model(x, r, pos))
        assert torch.equal(c, r)
    cap = _only_capture(ex)
    assert cap.in_place_ptrs == {}
    assert cap.input_copies == 4 * 4  # steps 2..5: x, pos, the cache in; the cache back


class _Window(torch.nn.Module):
    """A cache written at the slot its length counter (a buffer written in place) names, as a
    sliding-window KV cache keeps its length."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 2))
        self.register_buffer("length", torch.tensor([2]))

    def forward(self, x):
        self.cache.index_copy_(0, self.length, x)
        self.length.add_(1)
        return self.cache * 2


@torch.no_grad()
def test_a_capture_computes_from_what_its_warm_up_read(simulated):
    """The capturing call's warm-up writes the cache's last slot and moves the counter past its
    end. A CUDA capture computes nothing; a host capture that ran on what the warm-up left would
    index one past the cache and fail: it runs on the memory as the warm-up found it."""
    model, ref = _Window(), _Window()
    compiled = _compile(model)
    ex = _prime(compiled, torch.ones(1, 2))  # slot 2, counter 3
    ref(torch.ones(1, 2))
    x = torch.full((1, 2), 2.0)
    assert torch.equal(compiled(x), ref(x))  # captures: slot 3, counter 4
    cap = _only_capture(ex)
    for step in range(3):
        model.length.zero_()
        ref.length.zero_()
        x = torch.full((1, 2), 3.0 + step)
        assert torch.equal(compiled(x), ref(x))
        assert torch.equal(model.cache, ref.cache) and torch.equal(model.length, ref.length)
    assert [g.replays for g in cap.owner.graphs.values()] == [3]


class _EndsInABreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return torch.ops.cptest.host_round(y), y * 2


@torch.no_grad()
def test_an_output_of_a_break_is_returned_as_it_is(simulated):
    torch.manual_seed(0)
    model = _EndsInABreak()
    compiled = _compile(model, cudagraphs="breakable")
    ex = _prime(compiled, torch.randn(2, 8))
    xs = [torch.randn(2, 8) for _ in range(3)]
    got = [compiled(x) for x in xs]
    for x, out in zip(xs, got):
        want = model(x)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    cap = _only_capture(ex)
    assert cap.uncaptured and cap.direct is None  # the break ran between the replays
    assert cap.outputs.aliased == 2  # y * 2 of calls 2 and 3; the break's results are its own
    assert cap.outputs.rescues == 1  # call 3 found call 2's y * 2 held


@torch.no_grad()
def test_a_replay_rescues_the_held_outputs_of_the_models_other_captures(simulated):
    """A model's captures share a pool on a GPU: shape A's replay may write where shape B's held
    output lies. The host has no pool; the captures are put in one group as the GPU does, and a
    replay of A must copy out B's held output (B's own rescue count moves, B never replayed)."""
    from capturepass.runtime.owner import CaptureMemory

    torch.manual_seed(0)
    model = _Mlp()
    compiled = torch.compile(model, backend="capturepass", dynamic=True,
                             options={"inner": "eager", "verify": True, "cudagraphs": "monolithic"})
    ex = _prime(compiled, torch.randn(3, 16))  # one graph for every batch from 2 up
    x4, x2 = torch.randn(4, 16), torch.randn(2, 16)
    compiled(x4)  # captures shape A
    compiled(x2)  # captures shape B
    assert ex.num_captures == 2
    a, b = sorted(ex._captures.values(), key=lambda c: -next(iter(c.inputs.values())).shape[0])
    mem = CaptureMemory.__new__(CaptureMemory)  # the group alone: no streams or pool on the host
    mem.held_outputs = []
    for cap in (a, b):
        cap.owner.shared = mem
        cap.outputs.group = mem.held_outputs
    # Copies (new addresses): an input seen again where it was is captured again in place.
    held = compiled(x2.clone())  # B replays and hands out aliases
    assert mem.held_outputs == [b.outputs]
    before = b.outputs.rescues
    compiled(x4.clone())  # A's replay rescues B's held outputs first
    # Two storages copied: y (and its view y[:, :4]) and h.tanh().
    assert b.outputs.rescues == before + 2 and mem.held_outputs == [a.outputs]
    for got, want in zip(held, model(x2)):
        assert torch.equal(got, want)


def _call_args(ex, compiled, x) -> list:
    """The flat arguments the executor receives for ``compiled(x)`` (parameters included)."""
    seen, call = [], ex._call
    ex._call = lambda args: (seen.append(list(args)), call(args))[1]
    try:
        compiled(x)
    finally:
        del ex._call
    return seen[-1]


@torch.no_grad()
def test_a_timed_capture_drops_its_outputs_and_refuses_a_call(simulated):
    """What the measured choice does to each candidate it only times: the capture lets go of its
    outputs (here the simulated graph still holds them, as a real one holds only addresses), and
    a call is refused."""
    from capturepass.errors import ResourceError

    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    x = torch.randn(4, 16)
    compiled(x)  # the capture
    cap = _only_capture(ex)
    assert cap.drop_outputs() and cap.outputs_dropped
    assert all(outs == [] for outs in cap.seg_out.values())
    assert cap.outputs._static == {}
    with pytest.raises(ResourceError, match="outputs were dropped"):
        cap.replay([x])


@torch.no_grad()
def test_a_warm_up_on_copies_keeps_no_results_for_its_capture(simulated):
    """Until its capture a warm-up keeps only the values the capture reads, not the graph's inputs
    (the capture reads the caller's; one on copies would keep a copy of each input the graph
    writes); one on copies of the inputs (a schedule candidate's, a capture size's) keeps and
    returns no results of its own."""
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    args = _call_args(ex, compiled, torch.randn(4, 16))
    cap, _ = ex._capture_program(ex.program, args, False, "probe", None, warm_only=True)
    env, results = cap._warmed
    assert results is None
    read = {n for piece in ex.program.pieces for n in piece.live_in}
    outputs_only = {n for piece in ex.program.pieces for n in piece.live_out} - read
    assert set(env) <= read and outputs_only and not outputs_only & set(env)
    assert not set(env) & set(ex.program.inputs)
    cap.owner.close()
    again, out = ex._capture_program(ex.program, args, False, "probe2", None)
    assert out is None and again._warmed is None and again.seg_out
    again.owner.close()


class _ReturnsItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, cache):
        self.steps.add_(1)  # a written static input: no buffer, no copy
        cache.mul_(0.5).add_(self.a(x))  # a written input: copied in and back
        y = self.a(x).relu()
        return x, y, y.t(), cache.sum(), self.a.weight[:2]


@torch.no_grad()
def test_a_direct_replay_returns_what_the_environment_gives(simulated):
    """The direct replay's results, one kind each: an input returned as is (the caller's tensor),
    an output and a view of it (one alias storage), a written input's value, a view of a
    parameter (the parameter's memory, never aliased); and the written input copied back."""
    torch.manual_seed(0)
    model, ref = _ReturnsItsInput(), _ReturnsItsInput()
    ref.load_state_dict(model.state_dict())
    compiled = _compile(model)
    cache, ref_cache = torch.zeros(4, 8), torch.zeros(4, 8)
    ex = _prime(compiled, torch.randn(4, 8), cache)
    ref(torch.zeros(4, 8), ref_cache)  # the priming call wrote the cache and the step
    ref_cache.copy_(cache)
    ref.steps.copy_(model.steps)
    for call in range(4):
        x = torch.randn(4, 8)
        got, want = compiled(x, cache), ref(x, ref_cache)
        assert got[0] is x
        for g, w in zip(got[1:], want[1:]):
            assert torch.equal(g, w), call
        assert got[1].untyped_storage()._cdata == got[2].untyped_storage()._cdata
        assert got[4].data_ptr() == model.a.weight.data_ptr()
        assert torch.equal(cache, ref_cache) and torch.equal(model.steps, ref.steps)
    cap = _only_capture(ex)
    assert (cap.direct is not None) == (simulated != "environment")
    assert cap.input_copies > 0


def _direct_of(output, static, *, constants=None, **overrides):
    """``_Direct.of`` on a capture reduced to what it reads: one segment producing ``static``
    (the value of ``%relu``), inputs ``%a`` and ``%b``, ``output`` built from those nodes."""
    import types

    import torch.fx as fx

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    relu = g.call_function(torch.relu, (a,))
    const = g.get_attr("const")
    nodes = {"a": a, "b": b, "relu": relu, "const": const}
    out = fx.node.map_aggregate(output, lambda v: nodes[v] if isinstance(v, str) and v in nodes else v)
    piece = types.SimpleNamespace(kind="segment", external_joins=(), live_out=[relu], segment=0)
    program = types.SimpleNamespace(pieces=[piece], inputs=[a, b], output=out,
                                    constants={const: constants} if constants is not None else {})
    aliases = outputs.OutputAliases([static])
    fields = dict(program=program, outputs=aliases, static_outputs=False, uncaptured=set(), outputs_dropped=False,
                  seg_in={}, seg_scalars={}, seg_out={0: [static]})
    fields.update(overrides)
    return replay_module._Direct.of(types.SimpleNamespace(**fields)), aliases


def test_a_direct_replay_reads_inputs_from_the_call_and_outputs_over_aliases():
    import torch.fx as fx

    static, table = torch.arange(6.0), torch.ones(3)
    direct, aliases = _direct_of(("relu", "b", None, 7, "const", "relu"), static, constants=table)
    args = [torch.zeros(6), torch.full((2,), 5.0)]
    got = direct.result(args, aliases)
    assert type(got) is tuple and len(got) == 6
    assert got[1] is args[1] and got[2] is None and got[3] == 7 and got[4] is table
    assert got[0] is not static and got[0].data_ptr() == static.data_ptr() and torch.equal(got[0], static)
    # One alias storage per static storage and call: both results of %relu share it.
    assert got[0].untyped_storage()._cdata == got[5].untyped_storage()._cdata
    assert aliases.aliased == 2
    listed, _ = _direct_of(["relu", "a"], static)
    assert type(listed.result(args, aliases)) is fx.immutable_collections.immutable_list
    # Where a replay needs its environment: a nested output, a value no piece or input gives,
    # an output that requires grad, a break, staged buffers, an external join, copies out.
    assert _direct_of((("relu",), "a"), static)[0] is None
    assert _direct_of(("const",), static)[0] is None
    assert _direct_of(("relu",), torch.arange(6.0, requires_grad=True))[0] is None
    assert _direct_of(("relu",), static, uncaptured={0})[0] is None
    assert _direct_of(("relu",), static, seg_in={0: [(None, static)]})[0] is None
    assert _direct_of(("relu",), static, outputs=None)[0] is None
    assert _direct_of(("relu",), static, outputs=None, static_outputs=True)[0] is not None


def _host_build(meta, storage):
    """Stands in for torch's CUDA-only ``_construct_CUDA_Tensor_From_Storage_And_Metadata`` on
    host storages: the same tensor, made the slow way."""
    return torch.empty(0, dtype=meta["dtype"]).set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


@pytest.mark.parametrize("builder", ["right", "wrong", "raises"])
@torch.no_grad()
def test_outputs_built_in_one_call_only_once_that_call_passed_its_check(simulated, monkeypatch, builder, caplog):
    """A direct replay hands its outputs out through the one-call builder where torch has it (a
    CUDA build; here a host stand-in): checked at its first use against ``set_``, used from then on
    if it agreed, never again (and said once) if not. The results equal eager's either way."""
    import logging

    calls = []

    def build(meta, storage):
        calls.append(meta)
        if builder == "raises":
            raise RuntimeError("no such layout")
        t = _host_build(meta, storage)
        return t if builder == "right" else t.t()

    monkeypatch.setattr(outputs, "_BUILD", build)
    monkeypatch.setattr(outputs, "_BUILDS_FOR", "cpu")
    monkeypatch.setattr(outputs, "_build_ok", None)
    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    xs = [torch.randn(4, 16) for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="capturepass"):
        got = [compiled(x) for x in xs]
    for x, out in zip(xs, got):
        for g, w in zip(out, model(x)):
            assert torch.equal(g, w)
    if simulated == "environment":  # the environment's path makes each tensor through set_
        assert calls == [] and outputs._build_ok is None
        return
    said = [r for r in caplog.records if "did not pass its check" in r.getMessage()]
    # Three outputs over two storages per replay (y and its view, tanh), three replays.
    if builder == "right":
        assert outputs._build_ok is True and len(calls) == 9 and not said
    else:
        assert outputs._build_ok is False and len(calls) == 1 and len(said) == 1
    assert _only_capture(ex).outputs.aliased == 9


class _Lazy(torch.nn.Module):
    """Outputs that are lazy views of one product: its conjugate (a bit of the tensor, not of its
    memory) and the imaginary part of that (a negative bit)."""

    def forward(self, x, w):
        y = x @ w
        return y, y.conj(), y.conj().imag


@torch.no_grad()
def test_a_conjugate_or_negative_view_keeps_its_bit_when_handed_out(simulated):
    """``set_`` (and a tensor built from a storage) leaves the conjugate and negative bits unset:
    the replayed output of ``y.conj()`` read as ``y`` before. Every replay, and every held output
    rescued, gives eager's values with eager's bits."""
    torch.manual_seed(0)
    compiled = _compile(_Lazy())
    w = torch.randn(4, 4, dtype=torch.complex64)
    ex = _prime(compiled, torch.randn(4, 4, dtype=torch.complex64), w)
    xs = [torch.randn(4, 4, dtype=torch.complex64) for _ in range(4)]
    got = [compiled(x, w) for x in xs]  # all held: each replay rescues the one before
    for x, out in zip(xs, got):
        for g, want in zip(out, _Lazy()(x, w)):
            assert (g.is_conj(), g.is_neg()) == (want.is_conj(), want.is_neg())
            assert torch.equal(g, want)
    assert _only_capture(ex).outputs.aliased > 0


def test_copies_out_of_a_graphs_memory_keep_the_conjugate_and_negative_bits():
    y = torch.randn(4, 4, dtype=torch.complex64)
    views = (y.conj(), y.conj().imag)
    copied = outputs.copy_out(views, theirs=set())
    for c, v in zip(copied, views):
        assert c.data_ptr() != v.data_ptr() and (c.is_conj(), c.is_neg()) == (v.is_conj(), v.is_neg())
        assert torch.equal(c, v)


def _every_view(x, w, b):
    y = x @ w
    z = torch.view_as_complex(torch.stack([y, y * 2], -1))
    return (y, y.t(), y[1:3, ::2], y.unsqueeze(0).expand(3, 4, 4), y.view(torch.int32), torch.view_as_real(z),
            y.sum(), y[:0], y > 0, y.as_strided((3, 3), (1, 1)), b[1:], b.t(), y.diagonal(), y.flatten(), y,
            z.imag, z.conj())


@torch.no_grad()
def test_every_kind_of_output_view_is_handed_out_as_eager_returns_it(simulated):
    """Outputs over a graph's memory in every layout a view gives (transposed, strided, expanded
    with stride 0, overlapping, reinterpreted as another dtype, complex as real, empty, a scalar,
    views of an input, the same tensor twice): each call's results, held across the calls that
    follow, equal eager's in values, sizes, strides, dtype and lazy bits."""
    torch.manual_seed(0)
    compiled = _compile(_every_view)
    _prime(compiled, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    calls = [tuple(torch.randn(4, 4) for _ in range(3)) for _ in range(4)]
    got = [compiled(*args) for args in calls]
    for args, out in zip(calls, got):
        want = _every_view(*args)
        assert len(out) == len(want)
        for k, (g, e) in enumerate(zip(out, want)):
            assert (g.shape, g.stride(), g.dtype, g.is_conj(), g.is_neg()) == \
                (e.shape, e.stride(), e.dtype, e.is_conj(), e.is_neg()), k
            assert torch.equal(g, e), k


def _position_mix(positions, table, cache):
    cache.mul_(0.5).add_(table[positions].sum((0, 1)))
    return table[positions] * 2, cache.sum()


@torch.no_grad()
def test_an_input_expanded_over_a_batch_is_copied_through_its_span(simulated):
    """Position ids expanded over a batch (stride 0) as a call passes them: ``copy_`` refuses to
    write a buffer of that layout (the capture failed with "more than one element of the
    written-to tensor refers to a single memory location"); the buffer is filled through its
    span, every call, beside an input the graph writes."""
    torch.manual_seed(0)
    table = torch.randn(16, 8)
    compiled = _compile(_position_mix)

    def positions(start):
        return torch.arange(start, start + 4).unsqueeze(0).expand(3, 4)

    cache, ref = torch.zeros(8), torch.zeros(8)
    ex = _prime(compiled, positions(0), table, cache)
    _position_mix(positions(0), table, ref)
    calls = [positions(start) for start in range(1, 5)]  # all alive: new addresses, copied every call
    for start, ids in enumerate(calls, 1):
        got, want = compiled(ids, table, cache), _position_mix(positions(start), table, ref)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(cache, ref), start
    cap = _only_capture(ex)
    assert len(cap.spans) == 1 and cap.input_copies >= 1  # (the cache is read in place after a few calls)


def _scaled(x, n):
    return x * n + 1


@torch.no_grad()
def test_host_scalars_that_never_come_back_stop_being_captured(monkeypatch, caplog):
    """A call's host int (a step counter) is held by the graph: a capture per value. Once three
    captures in a row were made for values that never replayed, new values run uncaptured (one
    warning naming the scalar and its values); a value captured before still replays, and resets
    the count."""
    import logging

    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    compiled = _compile(_scaled)
    x = torch.randn(8)[:4]  # a slice of a buffer: read in place from the first capture (no promotion)
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        for n in (1, 2, 3, 4, 5, 6, 3, 7, 7):
            assert torch.equal(compiled(x, n), _scaled(x, n)), n
    kinds = [k for k, _ in log]
    # n=1: Dynamo's graph specialized to 1; then the graph of a symbolic n: 2, 3, 4 captured,
    # 5 and 6 run uncaptured, 3 replays (and resets the count), 7 captured, then replayed.
    assert (kinds.count("capture"), kinds.count("replay")) == (5, 2), kinds
    warnings = [r.getMessage() for r in caplog.records if "host scalar" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "its last 3 captures were made for values of its host scalar(s) that no capture of it held " \
           "(%arg1_1 = 2, 3, 4, 5, the last one now), and none of them replayed" in warnings[0], warnings[0]


def test_releases_wait_for_tracing_modes_but_not_for_the_first_calls_real_tensor_mode():
    """AOT autograd runs the first call of every compiled function (capturepass's warm-up and
    capture of its first shape) under a mode that checks custom ops for aliasing, on the
    call's real tensors: the cache release after that capture must run there. Under Dynamo's
    fake tensors, a proxy mode or a mode of the caller's, releases wait."""
    import torch._dynamo  # noqa: F401
    from torch._functorch._aot_autograd import runtime_wrappers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from capturepass.runtime import lifetime

    analyzer = runtime_wrappers._AnalyzeCustomOpInputOutputMode

    class Callers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert lifetime.release_allowed()
    with analyzer():
        assert lifetime.release_allowed() and not lifetime.tracing_modes_active()
    with FakeTensorMode():
        assert not lifetime.release_allowed()
        with analyzer():
            assert not lifetime.release_allowed()
    with Callers():
        assert not lifetime.release_allowed()
    with analyzer(), Callers():
        assert not lifetime.release_allowed()


@torch.no_grad()
@pytest.mark.parametrize("dies", ["model", "compiled graph"])
def test_what_dies_while_another_model_is_traced_keeps_its_held_output(simulated, dies, caplog):
    """Owners go when their model or compiled graph is collected, which happens wherever
    Python's collector runs: here while fake tensors trace another model, as Dynamo's do.
    The release waits until no dispatch mode is active (the next call of any compiled graph
    runs it), and the held output keeps its values, copied out of the capture's memory before
    that memory goes (under fake tensors the copy was fake, and raised)."""
    import gc
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    from capturepass.runtime import lifetime

    torch.manual_seed(0)
    model = _Mlp()
    compiled = _compile(model)
    ex = _prime(compiled, torch.randn(4, 16))
    xs = [torch.randn(4, 16) for _ in range(2)]  # both alive: no input is seen again at its address
    compiled(xs[0])  # the capture
    held = compiled(xs[1])[0]  # a replay's output, over the capture's memory
    want = model(xs[1])[0]
    cap = _only_capture(ex)
    owner, aliases = cap.owner, cap.outputs
    pool = {t.untyped_storage().data_ptr() for outs in cap.seg_out.values() for t in outs}
    assert held.untyped_storage().data_ptr() in pool
    (watchers,) = ex._watchers.values()  # the finalizers on the model's parameters
    gc.collect()
    lifetime.drain()  # earlier tests' collected models
    with caplog.at_level(logging.INFO, logger="capturepass"):
        if dies == "model":
            # The simulated graphs hold the tensors they read (a CUDA graph holds addresses):
            # the parameters' finalizers are fired as the collector would fire them.
            with FakeTensorMode():
                watchers[0]()
            assert lifetime.PENDING and not owner.closed  # collected, not yet released
        else:
            del compiled, model, ex, cap, watchers
            with FakeTensorMode():
                torch._dynamo.reset()  # Dynamo's caches let go of the graph: it dies here
            assert lifetime.DEFERRED and not owner.closed
        _compile(torch.nn.Linear(16, 16))(torch.randn(2, 16))  # the next call releases it
    assert not lifetime.PENDING and not lifetime.DEFERRED and owner.closed
    if dies == "model":
        assert "its model was collected" in caplog.text
    assert aliases.rescues == 1 and held.untyped_storage().data_ptr() not in pool
    assert torch.equal(held, want)
