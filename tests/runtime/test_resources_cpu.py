"""Owner-bound resources on the host: channels per owner, workspace phases, profiling captures,
the retention scope, weak arguments of breaks and the replay check, with exact counters.

On a machine without CUDA nothing is captured, but a graph compiled with a capturing mode
(``cudagraphs="breakable"``) keeps the owner bookkeeping of a GPU: its first run stands for its
capture. The GPU halves of these tests are in ``test_cuda_runtime.py``.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

import capturepass
from capturepass.errors import ResourceError
from capturepass.runtime import context, pools
from capturepass.runtime.executor import _Snapshot
from capturepass.runtime.owner import GraphOwner
from capturepass.runtime.workspaces import Workspaces

# -- a custom op that takes its channel from a pool ------------------------------------------------

SEEN: list[tuple[str, int]] = []


@pytest.fixture
def comm():
    made: list[str] = []
    released: list[str] = []
    state = {"bump": 0}

    def make(key):
        made.append(str(key))
        state["bump"] += 1
        return types.SimpleNamespace(key=key, buf=torch.zeros(4))

    pool = capturepass.resource_pool(
        "test_comm",
        make,
        release=lambda ch: released.append(str(ch.key)),
        snapshot=lambda: state["bump"],
        restore=lambda v: state.update(bump=v),
    )
    pool.made, pool.released, pool.state = made, released, state
    SEEN.clear()
    yield pool
    pools.unregister_pool("test_comm")


@torch.library.custom_op("cptest_res::allreduce", mutates_args=())
def _allreduce(x: torch.Tensor) -> torch.Tensor:
    pool = {p.name: p for p in pools.registered_pools()}["test_comm"]
    ch = pool.channel()
    SEEN.append((str(pools.ChannelKey(ch.key.owner, ch.key.lane)), id(ch)))
    return x * 2


@_allreduce.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_res::allreduce", overlap="safe", resources=("channel",))


class _Block(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.ops.cptest_res.allreduce(x.relu() * self.scale) + 1


class _Draft(torch.nn.Module):
    # Its own forward: Dynamo keys compiled code by code object, so two instances of one
    # class may share a compiled graph (and its owner).
    def forward(self, x):
        return torch.ops.cptest_res.allreduce(x.relu() * 0.5) + 1


def _compile(model, **opts):
    return torch.compile(model, backend="capturepass", options={"inner": "eager", **opts})


def test_channel_per_owner_and_eager(comm):
    x = torch.randn(4, 8)
    target, draft = _compile(_Block(1.0)), _compile(_Draft())
    for _ in range(2):  # interleaved, twice: each owner keeps its own channel
        torch.testing.assert_close(target(x), (x.relu() * 1.0) * 2 + 1)
        torch.testing.assert_close(draft(x), (x.relu() * 0.5) * 2 + 1)
    torch.ops.cptest_res.allreduce(x)  # outside any compiled graph: the eager channel
    keys = [k for k, _ in SEEN]
    assert len(set(keys)) == 3 and keys[-1] == "eager/s0"
    assert keys[0] == keys[2] and keys[1] == keys[3] and keys[0] != keys[1]
    assert len({i for _, i in SEEN}) == 3  # three channel objects, never one for two owners
    assert comm.counters["made"] == 3 and comm.counters["released"] == 0
    assert sorted(str(k) for k in comm.channels()) == sorted(set(keys))


def test_closing_an_owner_releases_its_channels(comm):
    x = torch.randn(4, 8)
    target = _compile(_Block(1.0))
    target(x)
    graph = capturepass.backends.compile.last_compiled()[-1]
    owner_name = graph.executor.owners[0].name
    assert [str(k) for k in comm.channels()] == [f"{owner_name}/s0"]
    graph.executor.close()
    assert comm.channels() == {} and comm.released == [f"{owner_name}/s0"]
    assert comm.counters["released"] == 1


def test_checkpoint_rollback(comm):
    a = comm.channel(owner="g_a")
    cp = comm.checkpoint()
    comm.channel(owner="g_b", lane=1)
    comm.channel(owner="g_c")
    assert comm.state["bump"] == 3
    dropped = comm.rollback(cp)
    assert [str(k) for k in dropped] == ["g_b/s1", "g_c/s0"]
    assert comm.state["bump"] == 1  # the engine's own state came back
    assert list(comm.channels().values()) == [a]
    assert comm.counters["rolled_back"] == 2 and comm.released == ["g_b/s1", "g_c/s0"]
    other = pools.ResourcePool("other", lambda k: k)
    with pytest.raises(ResourceError, match="cannot roll back to a checkpoint of 'test_comm'"):
        other.rollback(cp)


def test_pool_errors():
    with pytest.raises(ResourceError, match="non-empty name"):
        pools.ResourcePool("", lambda k: k)
    with pytest.raises(ResourceError, match="make must be callable"):
        pools.ResourcePool("p", None)
    with pytest.raises(ResourceError, match="both snapshot and restore"):
        pools.ResourcePool("p", lambda k: k, snapshot=lambda: 0)
    capturepass.resource_pool("dup", lambda k: k)
    try:
        with pytest.raises(ResourceError, match="'dup' is already registered"):
            capturepass.resource_pool("dup", lambda k: k)
    finally:
        pools.unregister_pool("dup")
    owner = GraphOwner("g900.m0.eager", 2, None, captured=False)
    pool = pools.ResourcePool("p", lambda k: k)
    with context.running(owner):
        assert pool.channel(lane=1) == pools.ChannelKey(owner.name, 1)
        with pytest.raises(ResourceError, match=r"lane s2 does not exist in owner g900\.m0\.eager: its lanes are s0..s1"):
            pool.channel(lane=2)
    owner.close()


# -- workspaces --------------------------------------------------------------------------------------


def test_workspace_reserve_lock_unlock():
    ws = Workspaces("engine", lanes=("target", "draft"), microbatches=2)
    ws.reserve("attn", 1024, lane="draft", microbatch=1)
    assert ws.capacity("attn", lane="draft", microbatch=1) == 1024
    assert ws.capacity(lane=0) == float("inf")
    with ws.locked("capture of g1"):
        assert ws.capacity(lane=0) == 0 and ws.capacity("attn", lane=1, microbatch=1) == 1024
        t = ws.get("attn", (256,), torch.float32, lane="draft", microbatch=1)  # exactly the reservation
        assert t.shape == (256,)
        with pytest.raises(ResourceError, match=r"workspace 'attn' of 'engine' \(lane draft, micro-batch 1\) "
                                                r"would grow from 1024 to 1028 bytes while locked \(capture of g1\)"):
            ws.get("attn", (257,), torch.float32, lane="draft", microbatch=1)
        with pytest.raises(ResourceError, match="would grow from 0 to 4 bytes"):
            ws.get("attn", (1,), torch.float32, lane="target")
    before = ws.buffers()[("draft", 1, "attn")]
    bigger = ws.get("attn", (512,), torch.float32, lane="draft", microbatch=1)  # unlocked: grows
    assert bigger.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
    assert ws.nbytes == 2048
    # slots never share storage
    a = ws.get("attn", (4,), lane=0, microbatch=0)
    b = ws.get("attn", (4,), lane=0, microbatch=1)
    assert a.data_ptr() != b.data_ptr()
    with pytest.raises(ResourceError, match="unlock without a lock"):
        ws.unlock()


def test_workspace_preallocated_slots():
    buf = torch.empty(4 * 1024, dtype=torch.uint8)
    ws = Workspaces("pre", lanes=2, microbatches=2, buffer=buf)
    assert ws.capacity(lane=1, microbatch=1) == 1024
    x = ws.get("a", (100,), torch.float32, lane=1, microbatch=1)  # 400 bytes, aligned to 512
    assert x.data_ptr() == buf.data_ptr() + 3 * 1024
    assert ws.capacity(lane=1, microbatch=1) == 512
    y = ws.get("b", (128,), torch.float32, lane=1, microbatch=1)
    assert y.data_ptr() == buf.data_ptr() + 3 * 1024 + 512
    with pytest.raises(ResourceError, match=r"4 bytes do not fit in the preallocated slot \(0 of 1024 bytes free\)"):
        ws.get("c", (1,), torch.float32, lane=1, microbatch=1)
    z = ws.get("a", (8,), torch.uint8, lane=0, microbatch=0)
    assert z.data_ptr() == buf.data_ptr()
    with pytest.raises(ResourceError, match="cannot hold 4 slot"):
        Workspaces("tiny", lanes=2, microbatches=2, buffer=torch.empty(100, dtype=torch.uint8))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ws: ws.get("a", (4,), lane=3), r"no lane 3; valid lanes are 0..1 \(s0, s1\)"),
        (lambda ws: ws.get("a", (4,), lane="draft"), r"no lane 'draft'; its lanes are s0, s1"),
        (lambda ws: ws.get("a", (4,), microbatch=2), r"no micro-batch slot 2; valid slots are 0..1"),
        (lambda ws: ws.get("a", (-1, 4)), r"negative size in shape \(-1, 4\)"),
        (lambda ws: ws.reserve("a", -5), r"size must be a non-negative int of bytes, got -5"),
        (lambda ws: ws.reserve("", 5), r"a workspace name must be a non-empty string"),
        (lambda ws: ws.get("a", (2.5,)), r"shape must be ints"),
    ],
)
def test_workspace_bad_requests(call, message):
    ws = Workspaces("w", lanes=2, microbatches=2)
    with pytest.raises(ResourceError, match=message):
        call(ws)


def test_owner_workspaces_locked_while_capturing():
    owner = GraphOwner("g901.m0.c0", 2, None, captured=True)
    with context.running(owner):
        ws = capturepass.workspace("scratch", (16,), torch.float32)
        with owner.workspaces.locked(f"capture of {owner.name}"):
            assert capturepass.workspace("scratch", (16,), torch.float32).data_ptr() == ws.data_ptr()
            with pytest.raises(ResourceError, match=r"workspace 'scratch' of 'g901\.m0\.c0' \(lane s0, micro-batch 0\) "
                                                    r"would grow from 64 to 68 bytes while locked \(capture of "
                                                    r"g901\.m0\.c0\)"):
                capturepass.workspace("scratch", (17,), torch.float32)
    owner.close()
    assert owner.workspaces.nbytes == 0


# -- profiling captures --------------------------------------------------------------------------------


def test_profiling_capture_releases_owners_and_rolls_back(comm):
    x = torch.randn(4, 8)
    model = _compile(_Block(1.0), cudagraphs="breakable")
    comm.channel(owner="engine")  # made before: survives the rollback
    with capturepass.profiling_capture() as prof:
        out = model(x)
        torch.testing.assert_close(out, (x.relu() * 1.0) * 2 + 1)
        model(x)  # the same throwaway owner
        executor = capturepass.backends.compile.last_compiled()[-1].executor
        (throwaway,) = [r.owner for r in executor._profile_owners.values()]
        assert throwaway.profiling and throwaway.num_retained > 0
        during = sorted(str(k) for k in comm.channels())
        assert during == sorted(["engine/s0", f"{throwaway.name}/s0"])
    assert prof.owners == [throwaway.name]
    assert throwaway.closed and throwaway.num_retained == 0
    assert prof.retained > 0 and prof.graphs == 0 and prof.peak_bytes == 0  # host: nothing captured
    assert [str(k) for k in comm.channels()] == ["engine/s0"]
    assert comm.released == [f"{throwaway.name}/s0"]
    # after the block the callable runs on its own owner again, with a new channel
    torch.testing.assert_close(model(x), (x.relu() * 1.0) * 2 + 1)
    assert len(comm.channels()) == 2 and executor._profile_owners == {}


def test_a_pool_made_inside_a_profiling_capture_gives_back_the_channels_made_in_it():
    """A pool first made inside the block (capturepass's communicators are made at a model's first
    call, which may be inside one) had no channel before it: the block releases them all."""
    released = []
    try:
        with capturepass.profiling_capture() as prof:
            pool = capturepass.resource_pool("test_born", lambda key: types.SimpleNamespace(key=key),
                                             release=lambda ch: released.append(str(ch.key)))
            pool.channel(owner="engine")
            pool.channel(owner="draft", lane=1)
        assert pool.channels() == {} and sorted(released) == ["draft/s1", "engine/s0"]
        assert prof.rolled_back == {"test_born": ["draft/s1", "engine/s0"]}
    finally:
        pools.unregister_pool("test_born")


def test_profiling_captures_do_not_nest():
    with capturepass.profiling_capture():
        with pytest.raises(ResourceError, match="already in progress"):
            with capturepass.profiling_capture():
                pass


# -- retention scope, weak arguments -----------------------------------------------------------------


def test_retain_returns_whether_it_retained_and_suspend_scope():
    owner = GraphOwner("g902.m0.c0", 1, None, captured=True)
    obj = object()
    assert capturepass.retain(obj) is False  # nothing running
    with context.running(owner):
        assert capturepass.retain(obj) is False  # running, not capturing
        owner.capturing = 0
        assert capturepass.retain(obj) is True
        with capturepass.suspend_retention():
            with capturepass.suspend_retention():
                assert capturepass.retain(object()) is False
            assert capturepass.retain(object()) is False
        assert capturepass.retain(obj) is True
        owner.capturing = None
    assert owner.num_retained == 2 and owner.retained[0] == [obj, obj]
    owner.close()


KEPT: list[torch.Tensor] = []


@torch.library.custom_op("cptest_res::host_stash", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
                         if hasattr(torch.Tag, "cudagraph_unsafe") else ())
def _host_stash(x: torch.Tensor) -> torch.Tensor:
    KEPT.append(x)  # an op that keeps its argument (a cache): must not pin the activation
    return x + 1


@_host_stash.register_fake
def _(x):
    return torch.empty_like(x)


capturepass.register_capability("cptest_res::host_stash", capturable=False)


class _WithBreak(torch.nn.Module):
    def forward(self, x):
        h = x * 3
        return torch.ops.cptest_res.host_stash(h).sin() + torch.ops.cptest_res.host_stash(x)


def test_breaks_hold_host_arguments_as_they_are():
    # Only a graph pool keeps a block once its owner lets go. A weak view of host memory that an
    # op keeps (a cache) reads, or writes, what malloc put there since: host arguments stay strong
    # (on a GPU the device's arguments go in weak: test_cuda_resources.py).
    KEPT.clear()
    x = torch.randn(8)
    model = _compile(_WithBreak(), cudagraphs="breakable")
    torch.testing.assert_close(model(x), (x * 3 + 1).sin() + (x + 1))
    executor = capturepass.backends.compile.last_compiled()[-1].executor
    lanes = executor.owners[-1].lanes("eager")
    assert lanes.counters["weak_args"] == 0
    assert len(KEPT) == 2
    assert KEPT[1].untyped_storage()._cdata == x.untyped_storage()._cdata
    torch.testing.assert_close(KEPT[0], x * 3)  # the activation the op kept keeps its values


def test_only_arguments_on_the_owners_device_go_in_weak():
    from capturepass.runtime.lanes import HostLanes
    from capturepass.runtime.program import _weak_args

    x = torch.randn(6)
    for device, weak in ((torch.device("cpu"), True), (torch.device("cuda", 0), False)):
        lanes = HostLanes(1)
        kept = []
        run = _weak_args(lambda fn, args: fn(*args), lanes, device)
        run(lambda t: (kept.append(t), t + 1)[1:], (x,))
        assert lanes.counters["weak_args"] == int(weak)
        assert (kept[0].untyped_storage()._cdata != x.untyped_storage()._cdata) == weak, device


def test_uncaptured_breaks_hold_arguments_strongly():
    KEPT.clear()
    x = torch.randn(8)
    model = _compile(_WithBreak(), cudagraphs="none")
    torch.testing.assert_close(model(x), (x * 3 + 1).sin() + (x + 1))
    assert KEPT[1].untyped_storage()._cdata == x.untyped_storage()._cdata


def test_break_output_aliasing_a_weak_argument_is_made_strong():
    from capturepass.runtime.program import _weak_args
    from capturepass.runtime.lanes import HostLanes

    lanes = HostLanes(1)
    run = _weak_args(lambda fn, args: fn(*args), lanes, torch.device("cpu"))  # host memory weak: the mechanism
    x = torch.randn(6)
    (view,) = run(lambda t: (t[2:],), (x,))
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata  # strong again
    del x
    gc.collect()
    assert view.shape == (4,)


# -- replay check -------------------------------------------------------------------------------------


def test_replay_check_names_what_moved():
    owner = GraphOwner("g903.m1.c0", 1, None, captured=True)
    weight = torch.randn(4)
    binding = torch.zeros(8)
    owner.keep(0, [weight, binding])
    node = types.SimpleNamespace(name="arg0_1")
    buf = torch.zeros(2)
    cap = types.SimpleNamespace(owner=owner, program=types.SimpleNamespace(inputs=[node, node]), inputs={1: buf})
    snap = _Snapshot.of(cap)
    snap.check(cap, [weight, buf])  # unchanged: no error
    binding.resize_(1024)  # a retained buffer reallocated under the graph
    with pytest.raises(ResourceError, match=r"retained Tensor 1 of segment 0 of g903\.m1\.c0 changed storage"):
        snap.check(cap, [weight, buf])
    snap = _Snapshot.of(cap)
    cap.inputs[1] = torch.zeros(2)  # the static input buffer itself replaced
    with pytest.raises(ResourceError, match=r"the static buffer of input 1 \(%arg0_1\) of g903\.m1\.c0 moved"):
        snap.check(cap, [weight, buf])
    cap.inputs[1] = buf
    owner.retained[0][0] = torch.randn(4)
    with pytest.raises(ResourceError, match="retained object 0 \\(Tensor\\) of segment 0 .* was replaced"):
        snap.check(cap, [weight, buf])
    owner.close()


def test_check_replay_option_is_validated():
    from capturepass.errors import OptionError
    from capturepass.ir.options import Options

    assert Options.from_mapping({"check_replay": True}).check_replay is True
    with pytest.raises(OptionError, match="option 'check_replay' must be True or False"):
        Options.from_mapping({"check_replay": "yes"})


def test_two_instances_of_one_class_get_their_own_owners_and_channels(comm):
    # Dynamo serves both instances with one compiled graph (parameters are inputs); the
    # owners, and so the channels, are still per instance.
    class Scaled(torch.nn.Module):
        def __init__(self, s: float) -> None:
            super().__init__()
            self.s = torch.nn.Parameter(torch.full((8,), s), requires_grad=False)

        def forward(self, x):
            return torch.ops.cptest_res.allreduce(x * self.s) + 1

    a, b = Scaled(1.0), Scaled(3.0)
    ca, cb = _compile(a), _compile(b)
    x = torch.randn(4, 8)
    for _ in range(2):
        torch.testing.assert_close(ca(x), x * 2 + 1)
        torch.testing.assert_close(cb(x), x * 6 + 1)
    executors = {id(g.executor) for g in capturepass.backends.compile.last_compiled() if g.executor is not None}
    keys = [k for k, _ in SEEN]
    assert keys[0] == keys[2] and keys[1] == keys[3] and keys[0] != keys[1]
    assert comm.counters["made"] == 2
    if len(executors) == 1:  # one compiled graph for both: two owners in it
        (executor,) = [g.executor for g in capturepass.backends.compile.last_compiled() if g.executor is not None][-1:]
        assert len(executor.owners) == 2
