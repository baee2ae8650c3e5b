"""Which inputs a capture is made on in place, and what happens when they move or die, on the host.

Nothing is captured without CUDA; here the executor's capture class is replaced by one
that runs the program eagerly for its "capture" and its "replays", and records what the
executor decided: the positions captured in place, the addresses it keyed them on, and
which capture served each call. The GPU half (real replays) is ``test_outputs_gpu.py``.
"""

from __future__ import annotations

import gc
import glob
import json
import logging

import pytest
import torch

from capturepass.backends.compile import last_compiled
from capturepass.runtime import executor as executor_module
from capturepass.runtime.in_place import (MADE_PER_CALL, MAX_MOVES, SHORT_TURNS, SLICE_REPLAYS, SLICE_TURNS, STEADY_CALLS,
                                         WATCHED, InPlacePlans, capture_key, is_slice, owns_memory)
from capturepass.runtime.replay import InPlaceMoved
from tests.helpers import HostCapture as _HostCapture
from tests.helpers import compiled_since


@pytest.fixture
def host_captures(monkeypatch):
    monkeypatch.setattr(executor_module, "Capture", _HostCapture)
    _HostCapture.log = []
    yield _HostCapture.log


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x, cache, pos, rows):
        cache.index_copy_(0, pos, x @ self.w)
        return cache.sum(0) + rows.sum(0)


def _compiled(**options):
    torch.manual_seed(0)
    model = _Cache()
    compiled = torch.compile(model, backend="capturepass",
                             options={"inner": "eager", "verify": True, "cudagraphs": "monolithic", **options})
    return model, compiled


def _executor():
    ex = [g for g in last_compiled() if g.name == "inference"][-1].executor
    ex.captured = True  # as on a GPU: the calls from now on capture and replay
    return ex


def _args(step: int, rows_buffer: torch.Tensor):
    return torch.randn(1, 4), torch.tensor([step]), rows_buffer[:3]


@torch.no_grad()
def test_a_written_cache_and_a_buffer_slice_are_captured_in_place_and_the_rest_copied(host_captures):
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    x, pos, r = _args(0, rows)
    torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))  # compiles, runs eagerly
    ex = _executor()
    for step in range(1, 5):
        x, pos, r = _args(step, rows)
        torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))
        torch.testing.assert_close(cache, ref)
    assert ex.num_captures == 1
    (key, cap), = ex._captures.items()
    shapes = [tuple(n.meta["val"].shape) for n in ex.program.inputs]
    in_place = sorted(shapes[i] for i in cap.in_place)
    assert in_place == [(3, 4), (8, 4)]  # the cache (written) and the slice of rows; not x nor pos
    assert sorted(key[2]) == sorted([cache.data_ptr(), rows.data_ptr()])
    assert [k for k, _ in host_captures] == ["capture", "replay", "replay", "replay"]


@torch.no_grad()
def test_a_cache_that_moves_is_copied_from_then_on_with_one_more_capture(host_captures, caplog):
    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    caches = [torch.zeros(8, 4), torch.ones(8, 4)]
    refs = [c.clone() for c in caches]
    x, pos, r = _args(0, rows)
    compiled(x, torch.zeros(8, 4), pos, r)  # compiles, runs eagerly
    ex = _executor()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for step in range(6):
            x, pos, r = _args(step // 2, rows)
            c, ref = caches[step % 2], refs[step % 2]
            torch.testing.assert_close(compiled(x, c, pos, r), model(x, ref, pos, r))
            torch.testing.assert_close(c, ref)
    said = [r.getMessage() for r in caplog.records if "another address" in r.getMessage()]
    assert len(said) == 1 and "copied into buffers while they move" in said[0]
    assert ex.num_captures == 1
    (key, cap), = ex._captures.items()
    shapes = [tuple(n.meta["val"].shape) for n in ex.program.inputs]
    assert [shapes[i] for i in cap.in_place] == [(3, 4)]  # the slice of rows stayed put
    first, second = host_captures[0][1], host_captures[1][1]
    assert host_captures == [("capture", first), ("capture", second)] + [("replay", second)] * 4


def _generations(model, compiled, rows, caches, after_step=lambda: None) -> None:
    """A new cache per generation (``caches``, which the caller keeps: the captures made on one go
    when it dies), four steps each, every call and the cache equal to eager's."""
    for cache in caches:
        ref = cache.clone()
        for step in range(4):
            x, pos, r = _args(step, rows)
            torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))
            torch.testing.assert_close(cache, ref)
            after_step()


@torch.no_grad()
def test_a_cache_that_moves_once_and_stays_is_captured_in_place_again(host_captures, caplog):
    """A new cache per generation: the call that brings it is captured copying it, the next finds
    it where it was and captures it in place again, and the calls after replay with no copy of it."""
    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    x, pos, r = _args(0, rows)
    compiled(x, torch.zeros(8, 4), pos, r)  # compiles, runs eagerly
    ex = _executor()
    copies = []
    with caplog.at_level(logging.INFO, logger="capturepass"):
        caches = (torch.zeros(8, 4), torch.ones(8, 4))
        _generations(model, compiled, rows, caches,
                     lambda: copies.append(sum(cap.input_copies for cap in ex._captures.values())))
    moved = [r.getMessage() for r in caplog.records if "another address" in r.getMessage()]
    again = [r.getMessage() for r in caplog.records if "stayed at one address" in r.getMessage()]
    assert len(moved) == 1 and "copied into buffers while they move" in moved[0]
    assert len(again) == 1 and "which copied them" in again[0]
    kinds = [k for k, _ in host_captures]
    # The first cache: captured in place, three replays; the second: captured copying it, then
    # in place at its new address, two replays.
    assert kinds == ["capture", "replay", "replay", "replay", "capture", "capture", "replay", "replay"]
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(3, 4), (8, 4)]
    # The last two calls replayed with x and pos copied into their buffers, the cache neither in
    # nor back (copied, it would add two copies a call).
    assert copies[-1] - copies[-2] == 2 and cap.input_copies == 2 * 2


@torch.no_grad()
def test_a_cache_its_device_cannot_copy_is_captured_in_place_at_its_new_address(host_captures, caplog, monkeypatch):
    """A new cache per generation that the device has no room to copy (``aside.spare_bytes``: a
    GPU's free memory; none here): the call that brings it captures in place at its new address,
    with no buffer of its size, and the calls after replay."""
    from capturepass.runtime import aside

    monkeypatch.setattr(aside, "spare_bytes", lambda device: 0)
    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    x, pos, r = _args(0, rows)
    compiled(x, torch.zeros(8, 4), pos, r)  # compiles, runs eagerly
    ex = _executor()
    del host_captures[:]
    with caplog.at_level(logging.INFO, logger="capturepass"):
        caches = (torch.zeros(8, 4), torch.ones(8, 4))
        _generations(model, compiled, rows, caches)
    said = [r.getMessage() for r in caplog.records if "another address" in r.getMessage()]
    assert len(said) == 1 and "captured in place there, as the device cannot spare" in said[0], said
    assert [k for k, _ in host_captures] == ["capture", "replay", "replay", "replay"] * 2
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(3, 4), (8, 4)]
    assert cap.input_copies == 3 * 2  # x and pos at each replay, never the cache


@torch.no_grad()
def test_the_capture_made_on_a_cache_goes_when_its_storage_dies(host_captures, caplog):
    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    cache = torch.zeros(8, 4)
    x, pos, r = _args(0, rows)
    compiled(x, cache, pos, r)
    ex = _executor()
    view = cache[:8]  # a caller may pass a new view of its buffer at every call
    compiled(x, view, pos, r)
    (cap,) = ex._captures.values()
    del view
    gc.collect()
    assert not cap.owner.closed  # a view died, not the cache
    with caplog.at_level(logging.INFO, logger="capturepass"):
        del cache
        gc.collect()
    assert cap.owner.closed and ex.num_captures == 0
    said = [r.getMessage() for r in caplog.records if "was collected" in r.getMessage()]
    assert said == [f"capturepass: inference graph {ex.graph_owner}: released 1 owner(s) of model "
                    f"{cap.owner.name.rsplit('.', 1)[0]} ({cap.owner.name}): an input it was made on was collected"]
    fresh, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    torch.testing.assert_close(compiled(x, fresh, pos, r), model(x, ref, pos, r))
    torch.testing.assert_close(fresh, ref)
    assert ex.num_captures == 1


@torch.no_grad()
def test_the_measured_choice_captures_its_candidates_in_place_and_protects_the_cache(host_captures):
    """The picker's candidates are captured with the executor's in-place plan; the timed replays
    would write the cache at the caller's address, so the picker is told to restore it."""
    import types

    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    x, pos, r = _args(0, rows)
    compiled(x, cache, pos, r)  # compiles, runs eagerly
    model(x, ref, pos, r)
    ex = _executor()
    seen = {}

    class Picker:
        def for_program(self, program):
            return self

        def capture(self, executor, args, real, protect, device):
            seen["protect"] = [t.data_ptr() for t in protect]
            cap, out = executor._capture_program(ex.program, args, real, None)
            other, _ = executor._capture_program(ex.program, args, False, types.SimpleNamespace(name="one_lane"))
            other.owner.close()
            return cap, out

    ex._picker = Picker()
    for step in range(1, 4):
        x, pos, r = _args(step, rows)
        torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))
        torch.testing.assert_close(cache, ref)
    (key, cap), = ex._captures.items()
    shapes = [tuple(n.meta["val"].shape) for n in ex.program.inputs]
    assert sorted(shapes[i] for i in cap.in_place) == [(3, 4), (8, 4)]
    assert seen["protect"] == [cache.data_ptr()]  # written and in place: restored after timing
    assert len(cap.watchers) == 2  # released when the cache's or the buffer's storage dies
    assert [k for k, _ in host_captures] == ["capture", "capture", "replay", "replay"]


def _in_place_shapes(ex, cap):
    shapes = [tuple(n.meta["val"].shape) for n in ex.program.inputs]
    return sorted(shapes[i] for i in cap.in_place)


@torch.no_grad()
def test_whole_inputs_read_only_that_stay_put_are_captured_in_place_once_seen_there(host_captures, caplog, tmp_path):
    """x and pos are whole tensors the graph only reads: copied at first (most callers make one
    per call); refilled at one address call after call, they are captured in place."""
    model, compiled = _compiled(dump_dir=str(tmp_path))
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    x, pos = torch.empty(1, 4), torch.empty(1, dtype=torch.long)
    x.normal_(), pos.fill_(0)
    compiled(x, cache, pos, rows[:3])  # compiles, runs eagerly
    model(x, ref, pos, rows[:3])
    ex = _executor()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for step in range(1, 8):
            x.normal_(), pos.fill_(step)  # the caller refills its buffers: read where they are
            torch.testing.assert_close(compiled(x, cache, pos, rows[:3]), model(x, ref, pos, rows[:3]))
            torch.testing.assert_close(cache, ref)
    first, second = host_captures[0][1], host_captures[STEADY_CALLS][1]
    # The copy capture replays until STEADY_CALLS calls in a row found x and pos where the call
    # before had them; that call captures them in place.
    assert host_captures == ([("capture", first)] + [("replay", first)] * (STEADY_CALLS - 1)
                             + [("capture", second)] + [("replay", second)] * (6 - STEADY_CALLS))
    (key, cap), = ex._captures.items()
    assert _in_place_shapes(ex, cap) == [(1,), (1, 4), (3, 4), (8, 4)]
    assert sorted(key[2]) == sorted([x.data_ptr(), pos.data_ptr(), cache.data_ptr(), rows.data_ptr()])
    assert len(cap.watchers) == 2  # the cache and the rows' buffer: x and pos may die and come back
    said = [r.getMessage() for r in caplog.records if "stayed at one address" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"capturepass: inference graph {ex.graph_owner}: input(s) %")
    assert f"for {STEADY_CALLS + 1} calls; captured in place from now on" in said[0] and "which copied them" in said[0]
    assert ex._places.watching(key[:2]) is None  # nothing is watched per call any more
    # owners.json (what `capturepass show` prints) lists the capture once, its inputs in place.
    (doc,) = [json.load(open(p)) for p in glob.glob(str(tmp_path / "*" / "owners.json"))
              if json.load(open(p))["graph"] == "inference"]
    assert [o["inputs"] for o in doc["owners"] if o["role"] == "capture"] == \
        ["f32[8,4] in place, f32[1,4] in place, i64[1] in place, f32[3,4] in place"]  # program order


@torch.no_grad()
def test_inputs_made_per_call_stay_copied_without_another_capture(host_captures):
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    made = [_args(step % 8, rows) for step in range(10)]  # all alive: every call at new addresses
    compiled(*[made[0][0], cache, *made[0][1:]])
    model(made[0][0], ref, *made[0][1:])
    ex = _executor()
    for x, pos, r in made[1:]:
        torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))
    (key, cap), = ex._captures.items()
    assert [k for k, _ in host_captures] == ["capture"] + ["replay"] * 8
    assert _in_place_shapes(ex, cap) == [(3, 4), (8, 4)]
    assert ex._places.watching(key[:2]) is None  # given up after MAX_MOVES addresses
    assert MAX_MOVES < 8


@torch.no_grad()
def test_an_input_captured_in_place_for_staying_put_that_moves_is_copied_for_good(host_captures):
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    x, pos = torch.randn(1, 4), torch.tensor([0])
    for _ in range(STEADY_CALLS + 2):
        compiled(x, cache, pos, rows[:3])
        model(x, ref, pos, rows[:3])
    ex = _executor()
    for _ in range(STEADY_CALLS + 1):
        compiled(x, cache, pos, rows[:3])
        model(x, ref, pos, rows[:3])
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(1,), (1, 4), (3, 4), (8, 4)]
    others = [torch.randn(1, 4) for _ in range(STEADY_CALLS + 2)]
    for y in [*others, x]:
        torch.testing.assert_close(compiled(y, cache, pos, rows[:3]), model(y, ref, pos, rows[:3]))
        torch.testing.assert_close(cache, ref)
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(1,), (3, 4), (8, 4)]  # x copied from now on; pos stayed
    assert [k for k, _ in host_captures].count("capture") == 3


@torch.no_grad()
def test_a_promoted_input_that_moves_is_not_promoted_again_where_it_then_stays(host_captures, caplog):
    """A caller that makes its input per call, which the allocator hands back at the address of
    the last one for a while and then elsewhere (a loop at two shapes, other tensors between),
    must not pay two captures at every such turn: once an input captured in place for staying
    put has moved, it is copied for good, however long it then stays at its new address."""
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    pos = torch.tensor([0])
    x, y = torch.randn(1, 4), torch.randn(1, 4)
    calls = [x] * (STEADY_CALLS + 2) + [y] * (STEADY_CALLS + 3) + [x] * (STEADY_CALLS + 3) + [y] * 3
    compiled(calls[0], cache, pos, rows[:3])
    model(calls[0], ref, pos, rows[:3])
    ex = _executor()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for t in calls[1:]:
            torch.testing.assert_close(compiled(t, cache, pos, rows[:3]), model(t, ref, pos, rows[:3]))
            torch.testing.assert_close(cache, ref)
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(1,), (3, 4), (8, 4)]  # x's place copied for good; pos stayed
    said = [r.getMessage() for r in caplog.records if "came at another address" in r.getMessage()]
    assert len(said) == 1 and f"came at another address than at their capture; {MADE_PER_CALL};" in said[0]
    # The first (x copied), x in place once it stayed put, copied again once it moved: no more.
    assert [k for k, _ in host_captures].count("capture") == 3
    assert ex._places.watching(next(iter(ex._captures))[:2]) is None


@torch.no_grad()
def test_slices_of_two_buffers_taking_turns_every_few_calls_are_copied_after_two_turns(host_captures, caplog):
    """An engine alternating two input buffers every few calls: the slice goes back in place where
    it stays, but a capture in place that served only a few calls before the slice moved again is
    a wasted turn, and after SLICE_TURNS of them the slice is copied for good (it cost two captures
    at every turn: 39 captures in 60 calls for turns of three calls)."""
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    buffers = [torch.randn(16, 4), torch.randn(16, 4)]
    x, pos = torch.randn(1, 4), torch.tensor([0])
    compiled(x, cache, pos, buffers[0][:3])
    model(x, ref, pos, buffers[0][:3])
    ex = _executor()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for call in range(1, 30):
            rows = buffers[(call // 3) % 2][:3]
            torch.testing.assert_close(compiled(x, cache, pos, rows), model(x, ref, pos, rows))
            torch.testing.assert_close(cache, ref)
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(1,), (1, 4), (8, 4)]  # the rows copied for good; x and pos stayed
    captures = [k for k, _ in host_captures]
    # The first capture (the rows in place on buffer 0, x and pos copied), x and pos in place once
    # they stayed put; then at each turn (every third call) a copy capture, and in place again on
    # the new buffer at the next call, but for the last turn, after which the rows stay copied.
    assert captures.count("capture") == 2 + 2 * SLICE_TURNS - 1
    # (the log starts at call 1: call 0 ran before the executor captured)
    assert captures[3 * SLICE_TURNS - 1] == "capture" and "capture" not in captures[3 * SLICE_TURNS:]
    assert SLICE_REPLAYS > 30
    said = [r.getMessage() for r in caplog.records if "came at another address" in r.getMessage()]
    assert WATCHED in said[0] and "captured in place again once one stays put" in WATCHED
    assert SHORT_TURNS in said[-1] and f"served fewer than {SLICE_REPLAYS} calls before they moved" in SHORT_TURNS


@torch.no_grad()
def test_threads_calling_one_model_with_buffers_of_their_own_equal_eager(host_captures):
    """Four threads, each refilling buffers of its own: the shape's plan sees inputs move and stay
    put in every order, and captures are released while other threads look for them. A replay
    never sees an in-place input elsewhere than at its capture (the host capture asserts it)."""
    import threading

    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    x, pos = torch.randn(1, 4), torch.tensor([0])
    compiled(x, torch.zeros(8, 4), pos, rows[:3])  # compiles, runs eagerly
    _executor()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        x, pos, cache, ref = torch.empty(1, 4), torch.empty(1, dtype=torch.long), torch.zeros(8, 4), torch.zeros(8, 4)
        try:
            torch.set_grad_enabled(False)  # per thread, as the graph was compiled
            for step in range(12):
                x.copy_(torch.randn(1, 4, generator=gen))
                pos.fill_(step % 8)
                torch.testing.assert_close(compiled(x, cache, pos, rows[:3]), model(x, ref, pos, rows[:3]))
                torch.testing.assert_close(cache, ref)
        except BaseException as e:  # noqa: BLE001 - reported on the main thread
            errors.append(e)

    before = last_compiled()
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert compiled_since(before) == []  # every thread called the one graph
    assert sum(1 for kind, _ in host_captures if kind == "replay") > 0


class _Rescuing(_HostCapture):
    """A replay that first moves the in-place inputs at ``positions`` to copies, as the rescue of
    a held output does when the caller hands one back."""

    positions: tuple[int, ...] = ()

    def replay(self, args, check=False):
        for i in _Rescuing.positions:
            args[i].set_(args[i].clone())
        _Rescuing.positions = ()
        moved = self.moved_in_place(args)
        if moved:
            raise InPlaceMoved(moved)
        return super().replay(args, check)


@torch.no_grad()
def test_an_input_in_place_that_the_replay_moves_goes_again_copied(monkeypatch, caplog):
    monkeypatch.setattr(executor_module, "Capture", _Rescuing)
    _HostCapture.log = []
    model, compiled = _compiled()
    cache, ref = torch.zeros(8, 4), torch.zeros(8, 4)
    rows = torch.randn(16, 4)
    calls = [_args(step, rows) for step in range(3)]  # all alive: x and pos stay copied
    for i, (x, pos, r) in enumerate(calls[:2]):
        compiled(x, cache, pos, r)
        model(x, ref, pos, r)
        if i == 0:
            ex = _executor()
    (cap,) = ex._captures.values()
    cache_at = [i for i in cap.in_place if ex.program.inputs[i].meta["val"].shape == (8, 4)]
    _Rescuing.positions = tuple(cache_at)
    x, pos, r = calls[2]
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        torch.testing.assert_close(compiled(x, cache, pos, r), model(x, ref, pos, r))
    torch.testing.assert_close(cache, ref)
    said = [r.getMessage() for r in caplog.records if "were moved by the replay" in r.getMessage()]
    assert len(said) == 1 and "copied into buffers while they move" in said[0]
    assert cap.owner.closed
    (cap,) = ex._captures.values()
    assert _in_place_shapes(ex, cap) == [(3, 4)]  # the cache is copied in and back from now on
    assert [k for k, _ in _HostCapture.log] == ["capture", "capture"]


def test_memory_handed_out_over_a_non_owning_storage_is_never_in_place():
    owner = torch.zeros(16, 8)
    nbytes = owner.untyped_storage().nbytes()
    alias = torch._C._construct_storage_from_data_pointer(owner.data_ptr(), owner.device, nbytes)
    out = torch.empty(0).set_(alias, 0, (16, 8), (8, 1))
    assert owns_memory(owner) and not owns_memory(out) and not owns_memory(out[:4])
    plans = InPlacePlans(static_inputs=(), written={0})
    base = (("instance",), ("shapes",))
    assert plans.plan(base, [out, out[:4], owner[:4]]) == ((2,), (owner.data_ptr(),))
    assert plans.watching(base) is None  # a replayed output is not watched for staying put either
    kept = torch.zeros(2, 8)
    plans = InPlacePlans(static_inputs=(), written=())
    plans.plan(base, [kept, out])
    for _ in range(STEADY_CALLS - 1):
        assert plans.observe(base, [kept, out]) == ()
    assert plans.observe(base, [kept, out]) == (0,)  # only the caller's own tensor
    assert plans.promote(base, [kept, out], (0,)) == ((0,), (kept.data_ptr(),))
    assert plans.watched((0,), [kept, out]) == frozenset()  # read whole: not watched for its death
    assert InPlacePlans(static_inputs=(), written={1}).watched((0, 1), [kept, kept]) == {1}
    assert plans.watched((0,), [torch.zeros(4, 8)[:2], out]) == {0}  # a slice of a buffer is


def test_a_whole_input_is_steady_only_where_the_call_just_before_had_it():
    """A capture call counts: a caller alternating two tensors, with a capture between (a cache
    that moved), must not look steady because the tensor of two calls ago is back."""
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    plans = InPlacePlans(static_inputs=(), written=())
    base = (("instance",), ("shapes",))
    assert plans.plan(base, [a]) == ((), ()) and plans.watching(base) is not None
    plans.saw(base, [b])  # a later call captured again, with b
    assert plans.observe(base, [a]) == ()  # a was two calls ago
    assert plans.observe(base, [a]) == (0,)
    plans = InPlacePlans(static_inputs=(), written=())
    plans.plan(base, [a])
    for t in ([b, c] * MAX_MOVES)[:MAX_MOVES + 1]:
        assert plans.observe(base, [t]) == ()
    assert plans.watching(base) is None  # moved too often: copied for good, nothing watched


def test_a_moved_input_is_watched_again_only_where_the_caller_keeps_it():
    """A written input (a cache) or a slice of a buffer that moves is watched, to be captured in
    place again where it then stays (a new cache per generation); a whole read-only input that
    was in place only because it stayed put is copied for good once it moves."""
    cache, buf, x = torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(2, 8)
    plans = InPlacePlans(static_inputs=(), written={0})
    base = (("instance",), ("shapes",))
    plans.plan(base, [cache, buf[:3], x])
    assert plans.get(base)[0] == (0, 1)  # the cache (written) and the slice, from the first capture
    assert plans.observe(base, [cache, buf[:3], x]) == (2,)
    plans.promote(base, [cache, buf[:3], x], (2,))
    assert plans.get(base)[0] == (0, 1, 2) and plans.watching(base) is None
    other_cache, other_buf, other_x = torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(2, 8)
    assert plans.moved(base, [other_cache, other_buf[:3], other_x]) == {0: WATCHED, 1: WATCHED, 2: MADE_PER_CALL}
    assert plans.get(base) == ((), ())
    assert sorted(plans.watching(base)) == [0, 1]  # x: copied for good


def test_a_slice_is_watched_again_after_a_move_unless_it_moved_soon_after_its_capture_twice():
    buffers = [torch.zeros(16, 8), torch.zeros(16, 8)]
    plans = InPlacePlans(static_inputs=(), written=())
    base = (("instance",), ("shapes",))
    plans.plan(base, [buffers[0][:3]])
    # Long in place (an engine that reallocated its buffers once), or for an unknown while (its
    # capture went with the old buffer's storage): watched again however often.
    for turn in range(2 * SLICE_TURNS + 1):
        served = SLICE_REPLAYS if turn % 2 else None
        assert plans.moved(base, [buffers[(turn + 1) % 2][:3]], served=served) == {0: WATCHED}
        assert plans.watching(base) is not None
        plans.promote(base, [buffers[(turn + 1) % 2][:3]], (0,))
    # Short turns: copied for good after SLICE_TURNS of them.
    for turn in range(SLICE_TURNS):
        assert plans.watching(base) is None
        last = turn == SLICE_TURNS - 1
        assert plans.moved(base, [buffers[turn % 2][:3]], served=SLICE_REPLAYS - 1) == {0: SHORT_TURNS if last else WATCHED}
        if turn < SLICE_TURNS - 1:
            plans.promote(base, [buffers[turn % 2][:3]], (0,))
    assert plans.watching(base) is None and plans.get(base) == ((), ())


def test_a_slice_of_a_larger_buffer_is_told_from_a_tensor_made_for_the_call():
    buf = torch.zeros(16, 8)
    assert is_slice(buf[:4]) and is_slice(buf[:, :2]) and is_slice(buf[3])
    assert not is_slice(buf) and not is_slice(torch.zeros(4, 8)) and not is_slice(buf.t())
    assert not is_slice(torch.zeros(0, 8)) and not is_slice(torch.zeros(4, 1).expand(4, 8))


def test_the_key_holds_the_addresses_of_the_inputs_in_place():
    x, cache = torch.zeros(2), torch.zeros(8)
    base = ((), ("shapes",))
    assert capture_key(base, None, [x, cache]) == ((), ("shapes",), ())
    assert capture_key(base, ((), ()), [x, cache]) == ((), ("shapes",), ())
    assert capture_key(base, ((1,), (0,)), [x, cache]) == ((), ("shapes",), (cache.data_ptr(),))


def test_a_plan_is_decided_at_the_first_capture_and_a_moved_input_leaves_it():
    cache, x, w = torch.zeros(4, 8), torch.zeros(2, 8), torch.zeros(8)
    plans = InPlacePlans(static_inputs={2}, written={0})
    base = (("instance",), ("shapes",))
    assert plans.get(base) is None
    plan = plans.plan(base, [cache, x, w])
    assert plan == ((0,), (cache.data_ptr(),))  # written; x is made for the call; w is static
    assert plans.plan(base, [torch.zeros(4, 8), x, w]) == plan  # decided once
    assert plans.moved(base, [cache, x, w]) == {} and plans.get(base) == plan
    other = torch.zeros(4, 8)
    assert plans.moved(base, [other, x, w]) == {0: WATCHED}
    assert plans.get(base) == ((), ())  # copied from now on
    assert capture_key(base, plans.get(base), [other, x, w]) == (*base, ())
    plans.forget(lambda instance: instance == ("instance",))
    assert plans.get(base) is None


def test_a_resized_copys_address_does_not_make_the_callers_next_tensor_steady():
    """``capture_sizes`` captures on copies of its own, freed after the capture; the allocator
    may hand the copy's block to the caller's next tensor (a new one per call), which must not
    look like a buffer that stayed put: it takes two calls of the caller's at one address, also
    where the capture was made on the caller's own tensor."""
    plans = InPlacePlans(static_inputs=(), written=())
    base = (("instance",), ("shapes",))
    given, copy, later = torch.zeros(4), torch.zeros(8), torch.zeros(8)
    assert plans.plan(base, [copy], given=[given]) == ((), ())
    assert plans.observe(base, [copy]) == ()  # a caller's tensor where the copy was
    assert plans.observe(base, [copy]) == (0,)  # and there again: steady
    plans = InPlacePlans(static_inputs=(), written=())
    plans.plan(base, [copy], given=[given])
    calls = ([later, copy] * MAX_MOVES)[:MAX_MOVES + 2]
    for t in calls[:-1]:  # the first call is not a move
        assert plans.observe(base, [t]) == ()
    assert plans.watching(base) is not None
    assert plans.observe(base, [calls[-1]]) == ()
    assert plans.watching(base) is None
    # The caller's own tensor (one not sized by the batch, passed as it is): the call that made
    # the capture replays next on it, which says nothing of where the caller keeps it.
    plans = InPlacePlans(static_inputs=(), written=())
    plans.plan(base, [given], given=[given])
    assert plans.observe(base, [given]) == ()
    assert plans.observe(base, [given]) == (0,)


class _SlowReplay(_HostCapture):
    """A replay that holds until told to finish, and checks that its owner is still open then."""

    entered = None
    finish = None

    def replay(self, args, check=False):
        _SlowReplay.entered.set()
        assert _SlowReplay.finish.wait(10)
        assert not self.owner.closed, "the capture was closed during its replay"
        return super().replay(args, check)


def test_release_captures_waits_for_a_replay_on_another_thread(monkeypatch):
    import threading

    monkeypatch.setattr(executor_module, "Capture", _SlowReplay)
    _HostCapture.log, _SlowReplay.entered, _SlowReplay.finish = [], threading.Event(), threading.Event()
    model, compiled = _compiled()
    rows = torch.randn(16, 4)
    x, cache, ref = torch.randn(1, 4), torch.zeros(8, 4), torch.zeros(8, 4)
    with torch.no_grad():
        compiled(x, cache, torch.tensor([0]), rows[:3])  # compiles, runs eagerly
        model(x, ref, torch.tensor([0]), rows[:3])
        ex = _executor()
        _SlowReplay.finish.set()
        for step in (1, 2, 3):  # captures, then again with x read in place (it stays put), replays
            compiled(x, cache, torch.tensor([step]), rows[:3])
            model(x, ref, torch.tensor([step]), rows[:3])
    assert ex.num_captures == 1 and [k for k, _ in _HostCapture.log] == ["capture", "capture", "replay"]
    _SlowReplay.entered.clear()
    _SlowReplay.finish.clear()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            with torch.no_grad():
                compiled(x, cache, torch.tensor([4]), rows[:3])
        except BaseException as e:  # noqa: BLE001 - reported on the main thread
            errors.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    assert _SlowReplay.entered.wait(10)
    releaser = threading.Thread(target=ex.release_captures)
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive()  # waits for the replay
    _SlowReplay.finish.set()
    caller.join()
    releaser.join()
    assert errors == [] and ex.num_captures == 0
    with torch.no_grad():
        model(x, ref, torch.tensor([4]), rows[:3])
    torch.testing.assert_close(cache, ref)
