"""Capture semantics that run without CUDA: written inputs, owners that die with their model,
explicit release, and a failed capture turned into a break by a rebuild.

On the host nothing is captured; a graph compiled with a capturing mode keeps the owner
bookkeeping of a GPU (its first run stands for its capture). The probe that finds the op
that cannot be captured needs CUDA for its throwaway captures: here
``capture.fails_alone`` is replaced by a stand-in that fails for chosen ops, so that the
search, the learning, the rebuild, the dump and the results are checked on the host. The
GPU halves are in ``test_capture_semantics.py``.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.ir.capabilities import REGISTRY
from capturepass.show import summarize_dir
from capturepass.errors import CapturePassError
from capturepass.ir import meta
from capturepass.runtime import capture, lifetime
from capturepass.runtime.executor import mutated_inputs
from capturepass.runtime.owner import HeldStorage
from capturepass.runtime.replay import CaptureFailure


def _compile(model, **options):
    options.setdefault("inner", "eager")
    options.setdefault("verify", True)
    options.setdefault("cudagraphs", "breakable")
    return torch.compile(model, backend="capturepass", options=options)


def _record(kind: str = "inference"):
    return [g for g in last_compiled() if g.name == kind][-1]


# -- inputs the graph writes ---------------------------------------------------------------------------

@torch.library.custom_op("cptest_sem::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@_scale_.register_fake
def _(x, s):
    return None


class _Writes(torch.nn.Module):
    """One write of every kind: an input, a view of an input, a module buffer, a KV cache
    written at positions (index_copy_ and index_put_), and a custom op's mutates_args."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x, y, cache, pos, z, untouched):
        self.step.add_(1)
        x.add_(1)
        y[1:3].mul_(2)
        cache.index_copy_(0, pos, x[:2])
        cache[pos + 1] = y[:2]
        torch.ops.cptest_sem.scale_(z, 3.0)
        return x * 2 + self.step + untouched.sum()


def _writes_args():
    return [torch.randn(4, 3), torch.randn(4, 3), torch.zeros(8, 3), torch.tensor([1, 4]), torch.randn(2),
            torch.randn(3)]


@torch.no_grad()
def test_mutated_inputs_names_every_kind_of_write():
    model = _Writes()
    compiled = _compile(model)
    compiled(*_writes_args())
    program = _record().program
    names = {}
    for i, node in enumerate(program.inputs):
        val = node.meta["val"]
        names[i] = tuple(val.shape)
    written = mutated_inputs(program)
    # Placeholders: the buffer (static), then x, y, cache, pos, z, untouched.
    assert names == {0: (), 1: (4, 3), 2: (4, 3), 3: (8, 3), 4: (2,), 5: (2,), 6: (3,)}
    assert program.static_inputs == frozenset({0})
    assert written == frozenset({0, 1, 2, 3, 5})


@torch.no_grad()
def test_writes_reach_the_caller_once_per_call():
    model, twin = _Writes(), _Writes()
    compiled = _compile(model)
    for call in range(1, 4):
        args = _writes_args()
        ref = [a.clone() for a in args]
        out = compiled(*args)
        want = twin(*ref)
        torch.testing.assert_close(out, want)
        for got, exp in zip(args, ref):
            torch.testing.assert_close(got, exp)
        assert model.step.item() == call


# -- owners die with their model ---------------------------------------------------------------------------

class _Lin(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)

    def forward(self, x):
        return self.l(x).relu() * self.scale


@torch.no_grad()
def test_owners_hold_storage_not_parameters_and_die_with_their_model():
    a, b = _Lin(1.0), _Lin(3.0)
    ca, cb = _compile(a), _compile(b)
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.testing.assert_close(ca(x), a(x))
        torch.testing.assert_close(cb(x), b(x))
    executor = _record().executor
    assert len(executor.owners) == 2  # one graph for the class, an owner per instance
    owner_a = [o for o in executor.owners
               if any(isinstance(h, HeldStorage) and h.storage.data_ptr() == a.l.weight.data_ptr()
                      for objs in o.retained.values() for h in objs)]
    assert len(owner_a) == 1
    held = [o for objs in owner_a[0].retained.values() for o in objs]
    assert held and all(isinstance(h, HeldStorage) and h.kind == "Parameter" for h in held)
    assert not any(isinstance(o, torch.nn.Parameter) for objs in owner_a[0].retained.values() for o in objs)
    first = list(executor.owners)
    weak_owner, weak_model, weak_param = weakref.ref(owner_a[0]), weakref.ref(a), weakref.ref(a.l.weight)
    del owner_a, held, first
    del a, ca
    gc.collect()
    assert weak_model() is None and weak_param() is None
    assert weak_owner() is None or weak_owner().closed
    assert len(executor.owners) == 1 and not lifetime.PENDING
    torch.testing.assert_close(cb(x), b(x))  # the other model's callable is untouched
    assert len(executor.owners) == 1


@torch.no_grad()
def test_an_owner_is_kept_across_calls():
    model = _Lin(2.0)
    compiled = _compile(model)
    x = torch.randn(4, 8)
    compiled(x)
    (owner,) = _record().executor.owners
    for _ in range(5):
        compiled(x)
        gc.collect()
    assert _record().executor.owners == [owner] and not owner.closed


@torch.no_grad()
def test_release_waits_for_a_capture_in_progress():
    model = _Lin(2.0)
    compiled = _compile(model)
    compiled(torch.randn(4, 8))
    executor = _record().executor
    (owner,) = executor.owners
    with lifetime.capturing():
        del model, compiled
        gc.collect()
        assert not owner.closed and lifetime.PENDING  # releasing would synchronize inside a capture
    assert owner.closed and not lifetime.PENDING and executor.owners == []


@torch.no_grad()
def test_a_compiled_graph_collected_inside_a_capture_is_released_after_it():
    """A compiled graph dies where its last reference goes, also inside a capture (an engine's,
    or one of ours on another thread): its owners' release would synchronize there, which
    invalidates a CUDA capture. It waits for the capture's end."""
    model = _Lin(2.0)
    compiled = _compile(model)
    compiled(torch.randn(4, 8))
    (owner,) = _record().executor.owners
    with lifetime.capturing():
        del model, compiled
        torch._dynamo.reset()  # the graph's last references: the executor dies here
        gc.collect()
        assert not owner.closed and lifetime.DEFERRED
    assert owner.closed and not lifetime.DEFERRED


def test_a_model_that_dies_while_the_pending_releases_are_drained_does_not_deadlock(monkeypatch):
    """A watched tensor dies wherever the collector runs: also inside ``drain`` itself, at an
    allocation made while it takes the pending releases. The finalizer then adds its own
    there; a lock around that (not reentrant) waited on itself forever. The collector is
    stood in for by a list that fires the finalizer when it is read."""
    import threading

    class _Executor:  # what drain asks of an executor
        def __init__(self) -> None:
            self.released: list[tuple] = []

        def release_instance(self, instance, why):
            self.released.append(instance)
            return True

    ex = _Executor()
    watched = torch.zeros(1)
    (late,) = lifetime.watch(ex, ("late",), [watched])

    class _CollectsWhenRead(list):
        def _collect(self):
            if late.alive:
                late()  # the finalizer, as the collector runs it
        def __iter__(self):
            self._collect()
            return super().__iter__()
        def pop(self, *args):
            self._collect()
            return super().pop(*args)

    monkeypatch.setattr(lifetime, "PENDING", _CollectsWhenRead([(weakref.ref(ex), ("first",))]))
    thread = threading.Thread(target=lifetime.drain, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive() and lifetime._lock.locked():
        lifetime._lock.release()  # for the tests after this one (a Lock has no owner)
    assert not thread.is_alive(), "drain waited on its own lock"
    lifetime.drain()
    assert sorted(ex.released) == [("first",), ("late",)] and not lifetime.PENDING
    del watched


@torch.no_grad()
def test_capturepass_release_releases_one_model():
    a, b = _Lin(1.0), _Lin(3.0)
    ca, cb = _compile(a), _compile(b)
    x = torch.randn(4, 8)
    ca(x), cb(x)
    executor = _record().executor
    assert len(executor.owners) == 2
    assert capturepass.release(ca) == 1
    assert len(executor.owners) == 1
    (kept,) = executor.owners
    assert capturepass.release(a) == 0  # nothing left of it
    torch.testing.assert_close(cb(x), b(x))
    torch.testing.assert_close(ca(x), a(x))  # still usable: a new owner
    assert len(executor.owners) == 2 and kept in executor.owners
    with pytest.raises(CapturePassError, match=r"capturepass.release takes a model .* got function"):
        capturepass.release(lambda x: x)


# -- a capture that fails on one op becomes a break ----------------------------------------------------------

@torch.library.custom_op("cptest_sem::grouped", mutates_args=())
def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for end in offs.tolist():  # a host sync no declaration shows
        out[start:end] = x[start:end] @ w
        start = end
    return out


@_grouped.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


capturepass.register_capability("cptest_sem::grouped", overlap="safe")


class _Grouped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("offs", torch.tensor([1, 3, 4]))

    def forward(self, x):
        h = x.relu() * 2
        return torch.ops.cptest_sem.grouped(h, self.w, self.offs).sin() + 1


def _failure(executor, model, x, culprit_op: str) -> CaptureFailure:
    """A capture failure of the piece that holds ``culprit_op``, with the warm-up's values."""
    program = executor.program
    args = [x, model.w, model.offs]  # the input, then the parameter and the buffer
    assert [tuple(n.meta["val"].shape) for n in program.inputs] == [tuple(a.shape) for a in args]
    owner = executor.owners[0]
    bound = program.bind(owner, owner.lanes("eager"))
    env = bound.initial_env(args)
    for p in range(len(program.pieces)):
        bound.run_piece(p, env)
    piece = next(p for p, piece in enumerate(program.pieces)
                 for step in piece.steps if step.kind == "region"
                 for n in step.payload.graph.graph.nodes if culprit_op in str(n.target))
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                         "tensor is pinned")
    return CaptureFailure(piece, error, None, env, torch.device("cpu"))


@pytest.fixture
def fails_under_capture(monkeypatch):
    """Stands in for the throwaway captures of the probe: the ops named fail, the rest capture."""
    failing: set[str] = set()
    probed: list[str] = []

    def fails_alone(fn, args, kwargs, device):
        name = str(fn)
        probed.append(name)
        if any(f in str(fn) for f in failing):
            return RuntimeError(f"Cannot copy between CPU and CUDA tensors during CUDA graph capture ({name})")
        return None

    monkeypatch.setattr(capture, "fails_alone", fails_alone)
    yield failing, probed
    REGISTRY.forget_learned()


def _prepare(model, x, dump_dir=None):
    options = {"dump_dir": str(dump_dir)} if dump_dir is not None else {}
    compiled = _compile(model, **options)
    with torch.no_grad():
        compiled(x)
    return compiled, _record().executor


@torch.no_grad()
def test_an_op_that_fails_under_capture_becomes_a_break(fails_under_capture, tmp_path, caplog):
    failing, probed = fails_under_capture
    failing.add("cptest_sem.grouped")
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled, executor = _prepare(model, x, tmp_path)
    assert meta.graph_info(_record().graph).breaks == ()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        executor._capture_failed(_failure(executor, model, x, "cptest_sem.grouped"))
    # The opaque custom op is probed first, found, learned and made a break.
    assert probed == ["cptest_sem.grouped.default"]
    assert "cptest_sem::grouped" in REGISTRY.learned()
    assert list(executor.not_capturable) == ["grouped"]
    gi = meta.graph_info(_record().graph)
    assert [(b.node, b.source) for b in gi.breaks] == [("grouped", "partition")]
    assert gi.breaks[0].reason.startswith("cptest_sem::grouped failed under CUDA graph capture (RuntimeError: "
                                          "Cannot copy between CPU and CUDA tensors")
    assert gi.cudagraphs == "breakable" and len(gi.segments) == 2
    assert any("%grouped (cptest_sem.grouped.default)" in d and "made a break" in d for d in gi.decisions)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cptest_sem::grouped cannot be captured" in warnings[0]
    assert executor.uncaptured_reason is None
    # The dump and `capturepass show` name the break.
    assert "break b0: cptest_sem::grouped failed under CUDA graph capture" in \
        (next(tmp_path.glob("*_inference")) / "008_partition.txt").read_text()
    assert "cptest_sem::grouped failed under CUDA graph capture" in summarize_dir(str(tmp_path))
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(x), model(x))
    # Learned once for the process: a graph compiled later has the break from the start, unprobed.
    probed.clear()
    other = _Grouped()
    compiled_other = torch.compile(lambda x: other(x) * 3, backend="capturepass",
                                   options={"inner": "eager", "cudagraphs": "breakable"})
    torch.testing.assert_close(compiled_other(x), other(x) * 3)
    assert [b.node for b in meta.graph_info(_record().graph).breaks] == ["grouped"]
    assert probed == []


@torch.no_grad()
def test_a_graph_built_before_the_op_was_learned_is_rebuilt_without_probing(fails_under_capture):
    failing, probed = fails_under_capture
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled, executor = _prepare(model, x)
    REGISTRY.learn("cptest_sem::grouped", "cptest_sem::grouped failed under CUDA graph capture (elsewhere)")
    executor._capture_failed(_failure(executor, model, x, "cptest_sem.grouped"))
    assert probed == []
    assert executor.not_capturable == {"grouped": "cptest_sem::grouped failed under CUDA graph capture (elsewhere)"}
    assert [b.node for b in meta.graph_info(_record().graph).breaks] == ["grouped"]
    torch.testing.assert_close(compiled(x), model(x))


@torch.no_grad()
def test_an_aten_op_is_made_a_break_for_its_node_only(fails_under_capture):
    failing, probed = fails_under_capture
    failing.add("aten.sin")
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled, executor = _prepare(model, x)
    executor._capture_failed(_failure(executor, model, x, "aten.sin"))
    # Opaque ops first (the custom op captures), then the aten ops in order: sin fails.
    assert any("grouped" in p for p in probed)
    assert REGISTRY.learned() == {}
    assert list(executor.not_capturable) == ["sin"]
    assert [b.node for b in meta.graph_info(_record().graph).breaks] == ["sin"]
    torch.testing.assert_close(compiled(x), model(x))


@torch.no_grad()
def test_when_no_break_can_help_the_graph_runs_uncaptured_and_says_why(fails_under_capture, caplog):
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled, executor = _prepare(model, x)
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        executor._capture_failed(_failure(executor, model, x, "cptest_sem.grouped"))
    assert executor.uncaptured_reason.startswith(
        f"capturing segment 0 of the inference graph {executor.graph_owner} failed (RuntimeError:")
    assert "no single op of it fails when captured alone" in executor.uncaptured_reason
    assert "runs uncaptured from now on" in caplog.text
    assert not executor.captured
    torch.testing.assert_close(compiled(x), model(x))


@torch.no_grad()
def test_a_rebuild_that_fails_leaves_the_graph_uncaptured(fails_under_capture):
    failing, _ = fails_under_capture
    failing.add("cptest_sem.grouped")
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled, executor = _prepare(model, x)

    def refuse(not_capturable):
        raise CapturePassError("%grouped requires the whole forward in one monolithic CUDA graph")

    executor._rebuild = refuse
    executor._capture_failed(_failure(executor, model, x, "cptest_sem.grouped"))
    assert "rebuilding the graph with it as a break failed (CapturePassError: %grouped requires the whole " \
           "forward" in executor.uncaptured_reason
    torch.testing.assert_close(compiled(x), model(x))


def _first_call_mode() -> torch.utils._python_dispatch.TorchDispatchMode:
    """The dispatch mode AOT autograd runs a compiled graph's first call under (it checks custom
    ops for aliasing); where this torch has none, a mode that passes plain tensors through and
    declines the rest, as it does."""
    from torch._functorch._aot_autograd import runtime_wrappers

    mode = getattr(runtime_wrappers, "_AnalyzeCustomOpInputOutputMode", None)
    if mode is not None:
        return mode()

    class _Declines(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is not torch.Tensor for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))

    return _Declines()


@torch.no_grad()
def test_a_rebuild_during_the_first_call_compiles_with_inductor(fails_under_capture, caplog):
    """A capture fails during the model's first call, which AOT autograd runs under a dispatch
    mode of its own: the rebuild's Inductor compiles must not run under it (torch 2.11's failed
    on every region, "Attempting to use FunctionalTensor on its own", and each ran eagerly)."""
    failing, _ = fails_under_capture
    failing.add("cptest_sem.grouped")
    model = _Grouped()
    x = torch.randn(4, 8)
    compiled = _compile(model, inner="inductor")
    compiled(x)
    executor = _record().executor
    with caplog.at_level(logging.WARNING, logger="capturepass"), _first_call_mode():
        executor._capture_failed(_failure(executor, model, x, "cptest_sem.grouped"))
    assert [b.node for b in meta.graph_info(_record().graph).breaks] == ["grouped"]
    assert "runs its graph eagerly" not in caplog.text
    regions = [r for r in _record().program.regions if not r.eager]
    assert regions and all(r.compiler == "inductor" for r in regions)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_failed_captures_probe_reads_what_the_call_read(monkeypatch):
    """A capture that fails is probed: the failing piece's ops run eagerly, one by one, on copies
    of the inputs the graph writes. The call (the warm-up) has moved a cache's counter by then:
    the probe must read the value the call read, or an index into the cache points past what the
    call wrote (past the cache's end at its last slot: on a GPU a device-side assert)."""
    import copy

    from capturepass.runtime import capture
    from capturepass.testing.host_graphs import replay_on_host
    from tests.helpers import HostCapture, SlotCache

    class Failing(HostCapture):
        def _segment_graph(self, p, bound, env, stream):
            graph, _ = super()._segment_graph(p, bound, env, stream)
            return graph, _raising()

    replay_on_host(capture_class=Failing, set_attr=monkeypatch.setattr)
    counters = []

    def probe(program, index, env, device):
        counters.extend(v.item() for v in env.values()
                        if isinstance(v, torch.Tensor) and v.dtype == torch.long and v.dim() == 0)
        return None

    monkeypatch.setattr(capture, "first_failing_node", probe)
    torch.manual_seed(0)
    model = SlotCache()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="capturepass", dynamic=False,
                             options={"inner": "eager", "cudagraphs": "monolithic"})
    with torch.no_grad():
        for rows in (3, 1):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), eager(x))
    assert model.n.item() == 4 and torch.equal(model.cache, eager.cache)
    # Each shape's capture failed and was probed, with the counter as its call read it (after the
    # call: 3, then 4, the second one's index past the cache's end).
    assert counters == [0, 3], counters


@pytest.mark.parametrize("spare", (None, 0), ids=("copies-beside", "copies-on-the-host"))
def test_a_failed_captures_probe_leaves_the_callers_written_inputs_as_the_call_left_them(spare, monkeypatch):
    """The probe runs the failing piece's ops once more. On a copy of a large input the graph
    writes (a running sum), or, where its device cannot spare one (``aside.spare_bytes``: a GPU's
    free memory; none here), on the caller's tensor, put back from the host after the probe:
    either way the caller's buffer holds what the call wrote, once."""
    import copy

    from capturepass.runtime import aside, capture, replay
    from capturepass.testing.host_graphs import replay_on_host
    from tests.helpers import HostCapture, RunningSum

    class Failing(HostCapture):
        def _segment_graph(self, p, bound, env, stream):
            graph, _ = super()._segment_graph(p, bound, env, stream)
            return graph, _raising()

    replay_on_host(capture_class=Failing, set_attr=monkeypatch.setattr)
    monkeypatch.setattr(aside, "spare_bytes", lambda device: spare)
    rows = 2 * replay.BEFORE_CALL_BYTES // (4 * 64)
    probed = []

    def probe(program, index, env, device):  # writes what the piece's eager run would write again
        for v in env.values():
            if isinstance(v, torch.Tensor) and v.shape == (rows, 64):
                probed.append(v)
                v.add_(1.0)
        return None

    monkeypatch.setattr(capture, "first_failing_node", probe)
    torch.manual_seed(0)
    model = RunningSum(rows)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="capturepass", dynamic=False,
                             options={"inner": "eager", "cudagraphs": "monolithic"})
    with torch.no_grad():
        x = torch.randn(3, 64)
        torch.testing.assert_close(compiled(x), eager(x))
    torch.testing.assert_close(model.acc, eager.acc)
    assert len(probed) == 1 and (probed[0] is model.acc) == (spare == 0)


class _Raising:
    def __enter__(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    def __exit__(self, *exc):
        return False


def _raising():
    return _Raising()
