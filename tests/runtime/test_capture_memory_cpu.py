"""The bookkeeping of a model's shared capture memory, on the host (streams and pool handles faked).

The GPU half, with real pools, streams and interleaved replays, is ``test_shared_memory_gpu.py``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import threading
import types

import pytest
import torch

from capturepass.runtime import capture, files
from capturepass.runtime import owner as owner_module
from capturepass.runtime.owner import CaptureMemory, _memories, capture_memory


@pytest.fixture
def fake_cuda(monkeypatch):
    handles = itertools.count()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles) + 1))
    # A pool's keeper is an empty captured graph: none can be captured without a GPU, whether
    # torch is a CPU build (no pool routing: no keeper is made) or a CUDA build.
    monkeypatch.setattr(capture, "keep_pool", lambda pool, stream: ("keeper", pool))


def test_side_streams_are_made_once_per_lane_and_shared(fake_cuda):
    mem = CaptureMemory(torch.device("cuda", 0))
    two = mem.side_streams(2)
    three = mem.side_streams(3)
    assert three[:2] == two and len(set(map(id, three))) == 3
    assert mem.side_streams(1) == two[:1]
    assert mem.side_streams(0) == []


def test_the_pool_is_shared_while_used_and_renewed_after(fake_cuda):
    mem = CaptureMemory(torch.device("cuda", 0))
    a, b = mem.acquire_pool(), mem.acquire_pool()
    assert a == b and mem.users == 2
    mem.release_pool()
    assert mem.acquire_pool() == a  # still in use by one owner: the same pool
    mem.release_pool()
    mem.release_pool()
    assert mem.users == 0
    assert mem.acquire_pool() != a  # torch freed the old pool with its last graph


def test_a_keeper_holds_each_pool_open_until_its_last_owner_leaves(fake_cuda, monkeypatch):
    """Warm-ups enter the pool before any graph of it exists: an empty keeper graph holds it
    open (torch refuses a pool whose last user left), and goes with the pool's last owner."""
    kept = []
    monkeypatch.setattr(capture, "POOL_WARM_UP_UNSUPPORTED", None)
    monkeypatch.setattr(capture, "keep_pool", lambda pool, stream: kept.append(pool) or ("keeper", pool))
    mem = CaptureMemory(torch.device("cuda", 0))
    a = mem.acquire_pool()
    assert mem.acquire_pool() == a and kept == [a] and mem._keeper == ("keeper", a)
    mem.release_pool()
    assert mem._keeper == ("keeper", a)
    mem.release_pool()
    assert mem._keeper is None
    b = mem.acquire_pool()
    assert kept == [a, b] and b != a and mem._keeper == ("keeper", b)


class _Holder:
    """Stands in for a capture owner: the graphs it holds in the pool."""

    def __init__(self) -> None:
        self.graphs: dict[int, object] = {}


def test_warm_ups_run_in_the_pool_only_while_no_graph_lives_there(fake_cuda, monkeypatch, caplog):
    """A capture's temporaries are free blocks of the pool: a cache an op makes in a later warm-up
    could take one, and that capture's replays would overwrite it. Candidates that all warm up
    before any is captured still may."""
    mem = CaptureMemory(torch.device("cuda", 0))
    monkeypatch.setattr(capture, "keep_pool", lambda pool, stream: ("keeper", pool))
    monkeypatch.setattr(capture, "POOL_WARM_UP_UNSUPPORTED", None)
    first, second = _Holder(), _Holder()
    mem.acquire_pool(first)
    assert mem.warms_up_in_pool()
    mem.acquire_pool(second)
    assert mem.warms_up_in_pool()  # two candidates warming up, neither captured yet
    first.graphs[0] = object()
    assert not mem.warms_up_in_pool()  # the first captured: its temporaries are in the pool
    first.graphs.clear()
    mem.release_pool(first)
    assert mem.warms_up_in_pool() and mem.users == 1
    monkeypatch.setattr(capture, "POOL_WARM_UP_UNSUPPORTED", "this torch cannot")
    monkeypatch.setattr(owner_module, "_warned_pool", False)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert not mem.warms_up_in_pool() and not mem.warms_up_in_pool()
    assert [r.getMessage() for r in caplog.records].count(
        "capturepass: warm-ups run outside the capture's pool: this torch cannot") == 1


def test_graphs_of_one_model_scope_share_one_memory_and_others_do_not(fake_cuda):
    dev = torch.device("cuda", 0)
    one = capture_memory(dev, ("frame", 3, "inference", frozenset({1, 2})))
    assert capture_memory(dev, ("frame", 3, "inference", frozenset({2, 1}))) is one
    assert capture_memory(dev, ("frame", 3, "inference", frozenset({1, 5}))) is not one  # other parameters
    assert capture_memory(dev, ("frame", 4, "inference", frozenset({1, 2}))) is not one  # other code
    assert capture_memory(dev, None) is not capture_memory(dev, None)
    key = ("frame", 9, "inference", frozenset({7}))
    held = capture_memory(dev, key)
    assert _memories[(dev, key)] is held
    del held
    gc.collect()  # no model holds it any more: the registry lets it go
    assert (dev, key) not in _memories


def test_the_lock_is_reentrant_for_the_capturing_thread(fake_cuda):
    mem = CaptureMemory(torch.device("cuda", 0))
    got = []
    with mem.lock:
        with mem.lock:  # the picker holds it and replays, which take it again
            t = threading.Thread(target=lambda: got.append(mem.lock.acquire(timeout=0.05)))
            t.start()
            t.join()
    assert got == [False]  # another thread waits while one model's capture or replay runs


class _FakeStream:
    def __init__(self, name: str, raw: int) -> None:
        self.name, self.raw = name, raw
        self.waited: list[str] = []

    def wait_stream(self, other: "_FakeStream") -> None:
        self.waited.append(other.name)


def test_a_replay_on_another_stream_waits_for_the_last_replay(fake_cuda):
    """Captures that share memory must not run at once on the GPU: a change of stream waits."""
    from capturepass.runtime.owner import order_after_last

    mem = CaptureMemory(torch.device("cuda", 0))
    a, b = _FakeStream("a", 11), _FakeStream("b", 22)
    made = []

    def current(s):
        made.append(s.name)
        return s

    for s in (a, a, b, b, a):
        order_after_last(mem, s.raw, lambda s=s: current(s))
    assert b.waited == ["a"]  # once, at the change
    assert a.waited == ["b"]  # and back
    assert mem.last_stream is a and mem.last_raw == 11
    assert made == ["a", "b", "a"]  # a Stream object is made only when the stream changed


def test_closing_an_owner_leaves_cublas_cache_alone_while_a_capture_is_in_progress(monkeypatch):
    """cuBLAS's workspace cache is the process's: an owner closed (collected, released) while a
    capture of ours runs, on this thread or another, would free that capture's workspace under
    it. The clear is skipped then, and done by a close outside any capture."""
    from capturepass.runtime import lifetime
    from capturepass.runtime.owner import GraphOwner

    clears = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: clears.append(1), raising=False)
    during = GraphOwner("cpu-test.during", 1, None, captured=True)
    after = GraphOwner("cpu-test.after", 1, None, captured=True)
    for o in (during, after):
        o.graphs[0] = object()  # an owner that captured
    with lifetime.capturing():
        during.close()
    assert clears == []
    after.close()
    assert clears == [1]


@pytest.fixture
def workspace_size(monkeypatch):
    """torch's run-time cuBLAS workspace size (a CUDA build of torch 2.13 or later has it; this
    CPU build does not, so a stand-in keeps the size): the sizes set, in order."""
    size = [32 << 20]
    sets = []
    monkeypatch.setattr(torch._C, "_cuda_getCublasWorkspaceSize", lambda: size[0], raising=False)

    def put(n):
        sets.append(n)
        size[0] = n

    monkeypatch.setattr(torch._C, "_cuda_setCublasWorkspaceSize", put, raising=False)
    return size, sets


@pytest.mark.parametrize("whole_mib, streams, share_mib", [
    (32, 3, 10),    # PyTorch's size on an H100 or H200, three lanes: 10 MiB each, 30 in all
    (32, 2, 16),
    (32, 5, 8),     # never below 8 MiB a stream
    (8, 3, None),   # 8 MiB already (a CUBLAS_WORKSPACE_CONFIG of :4096:2): nothing to divide
    (4, 2, None),   # below the floor: each stream keeps the whole size
    (32, 1, None),  # one stream: nothing to divide
])
def test_a_capture_on_several_streams_divides_the_cublas_workspace(workspace_size, whole_mib, streams, share_mib):
    size, sets = workspace_size
    size[0] = whole_mib << 20
    with capture.split_cublas_workspace(streams) as share:
        assert share == (None if share_mib is None else share_mib << 20)
        assert size[0] == (whole_mib << 20 if share_mib is None else share_mib << 20)
    assert size[0] == whole_mib << 20
    assert sets == ([] if share_mib is None else [share_mib << 20, whole_mib << 20])


def test_the_divided_cublas_workspace_is_set_back_when_the_capture_fails(workspace_size):
    size, sets = workspace_size
    with pytest.raises(RuntimeError, match="capture failed"):
        with capture.split_cublas_workspace(3):
            raise RuntimeError("capture failed")
    assert size[0] == 32 << 20 and sets == [10 << 20, 32 << 20]


@pytest.mark.parametrize("config", [None, ":4096:2"])
def test_a_torch_without_a_run_time_workspace_size_divides_nothing_and_says_so_once(monkeypatch, caplog, config):
    """torch 2.11: nothing is divided and ``CUBLAS_WORKSPACE_CONFIG`` is left as it is (2.11's
    cache would hand a workspace allocated under a smaller setting to cuBLAS at the larger one);
    the first capture on several streams logs the remedy, unless the variable already set a size."""
    for name in ("_cuda_getCublasWorkspaceSize", "_cuda_setCublasWorkspaceSize"):
        monkeypatch.delattr(torch._C, name, raising=False)
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    monkeypatch.setattr(files, "_warned", set())
    assert capture.workspace_size_setter() is None
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for streams in (1, 3, 2):
            with capture.split_cublas_workspace(streams) as share:
                assert share is None
                assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == config
    told = [r.getMessage() for r in caplog.records if "cuBLAS workspace size" in r.getMessage()]
    assert told == ([capture.UNDIVIDED] if config is None else []), told
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:2" in capture.UNDIVIDED


def test_captures_on_two_threads_take_turns():
    """``capture.exclusive``: one thread at a time clears cuBLAS's cache and captures; re-entrant
    on the thread that holds it (a probe inside a capture's failure handling)."""
    order = []
    entered = threading.Event()

    def other():
        entered.wait()
        with capture.exclusive():
            order.append("other")

    t = threading.Thread(target=other)
    with capture.exclusive():
        with capture.exclusive():
            t.start()
            entered.set()
            t.join(0.2)
            order.append("mine")
    t.join(5)
    assert order == ["mine", "other"]


class _PoolUses:
    """The caching allocator's count of each private pool's users, as torch keeps it: a
    capture's ``beginAllocateToPool`` adds one and routes to the pool, ``endAllocateToPool``
    stops the routing, ``releasePool`` takes one away (and frees the pool at zero)."""

    def __init__(self) -> None:
        self.uses: dict = {}
        self.routing: list = []

    def begin(self, pool) -> None:
        self.uses[pool] = self.uses.get(pool, 0) + 1
        self.routing.append(pool)

    def end(self, index, pool) -> None:
        if pool not in self.routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routing.remove(pool)

    def release(self, index, pool) -> None:
        self.uses[pool] -= 1


class _Graph:
    """A stand-in for ``torch.cuda.CUDAGraph`` (none can be captured without a GPU) that takes
    ``capture_end``'s steps in torch's order (aten/src/ATen/cuda/CUDAGraph.cpp): end the stream
    capture, stop routing, count the capture as ended, instantiate; ``fail_at`` names the step
    that raises."""

    def __init__(self, uses: _PoolUses, fail_at: str) -> None:
        self.uses, self.fail_at, self.ended, self.pool_id = uses, fail_at, False, None

    def capture_begin(self, pool=None, **kwargs) -> None:
        self.pool_id = pool
        self.uses.begin(pool)

    def capture_end(self) -> None:
        if self.fail_at == "end_capture":
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.uses.end(0, self.pool_id)
        self.ended = True
        if self.fail_at == "instantiate":
            raise RuntimeError("CUDA error: cudaGraphInstantiateWithFlags failed")

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def reset(self) -> None:
        if self.ended:
            self.uses.release(0, self.pool_id)
            self.ended = False


@pytest.mark.parametrize("op_raised", [False, True], ids=["capture_end", "op"])
@pytest.mark.parametrize("fail_at", ["end_capture", "instantiate"])
def test_a_failed_capture_gives_its_pool_reference_back_once(monkeypatch, fail_at, op_raised):
    """A capture into a model's shared pool that fails, before or after torch counts it as
    ended, leaves the pool's count of users as it found it: a second release would let the
    allocator free the pool under the graphs that still replay from it."""
    uses = _PoolUses()
    pool = (0, 7)
    uses.uses[pool] = 1  # the model's other graphs (its keeper)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", uses.end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", uses.release, raising=False)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(capture, "_restore_generator", lambda device: None)
    graph = _Graph(uses, fail_at)
    with pytest.raises(RuntimeError):
        with capture.segment(graph, pool, types.SimpleNamespace(device=torch.device("cuda", 0))):
            if op_raised:
                raise RuntimeError("an op failed under capture")
    assert uses.uses[pool] == 1
    assert uses.routing == []
