"""Communicators per model instance, in one process: a gloo group of one rank stands in for the world.

A compiled graph's collectives post on the process group of the model instance that runs
them (its owners share it), made on its first call from the traced group's ranks and
backend, and destroyed with the model (``capturepass.release``, the end of a profiling
capture; a collected model's groups whose teardown is collective are kept until the world
goes). Two model instances (a target and a draft) never share one. The two-process runs are
in ``test_collectives_gloo.py`` (gloo) and ``test_collectives_gpu.py`` (NCCL).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from capturepass.testing import parallel

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build of torch", allow_module_level=True)

from torch.distributed import _functional_collectives as funcol  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

import capturepass  # noqa: E402
from capturepass.backends.compile import compile_graph  # noqa: E402
from capturepass.errors import ResourceError  # noqa: E402
from capturepass.ir import collectives  # noqa: E402
from capturepass.runtime import comms  # noqa: E402
from capturepass.runtime.executor import Executor  # noqa: E402
from tests.helpers import aten_graph  # noqa: E402


@pytest.fixture
def world():
    reason = parallel.gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    assert not dist.is_initialized()
    with parallel.one_rank_world() as group:
        yield group


class Block(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = funcol.all_reduce(x @ self.w1, "sum", dist.group.WORLD)
        return r + torch.relu(x @ self.w2)


def _compiled(model: nn.Module, **options):
    return torch.compile(model, backend="capturepass", options={"inner": "eager", **options})


def test_each_owner_posts_on_its_own_communicator(world):
    target, draft = Block(0), Block(1)
    c_target, c_draft = _compiled(target), _compiled(draft)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(c_target(x), target(x))
        (key_t,) = comms.communicators()
        torch.testing.assert_close(c_draft(x), draft(x))
        torch.testing.assert_close(c_target(x + 1), target(x + 1))
    live = comms.communicators()
    (key_d,) = set(live) - {key_t}
    # One group per owner (the lane is the comm lane, s1), standing for the traced world group '0'.
    assert key_t.endswith("/s1") and key_d.endswith("/s1") and key_t != key_d
    assert set(live[key_t]) == set(live[key_d]) == {world.group_name}
    names = {live[key_t]["0"], live[key_d]["0"]}
    assert len(names) == 2 and world.group_name not in names
    for name in names:
        assert dist.get_process_group_ranks(c10d._resolve_process_group(name)) == [0]
    # The draft's owner closes with the draft: its group is destroyed, the target's stays.
    assert capturepass.release(draft) == 1
    assert comms.communicators() == {key_t: live[key_t]}
    assert capturepass.release(target) == 1
    assert comms.communicators() == {}


def test_a_collected_model_keeps_collectively_destroyed_groups_until_the_world_goes(world, monkeypatch, caplog):
    import gc
    import logging

    # NOTE: gloo tears a group down locally; NCCL's teardown is collective. The backend query
    # is replaced so that this one-rank gloo group stands for an NCCL one.
    monkeypatch.setattr(comms, "_local_teardown", lambda group: False)
    model = Block(0)
    compiled = _compiled(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    ((key, made),) = comms.communicators().items()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        del model, compiled
        gc.collect()
        capturepass.runtime.lifetime.drain()
    # Released from the pool (nothing posts on it again), not destroyed: the other ranks collect
    # their copies of the model at moments of their own.
    assert comms.communicators() == {}
    assert dist.get_process_group_ranks(c10d._resolve_process_group(made["0"])) == [0]
    (line,) = [r.getMessage() for r in caplog.records if "communicators" in r.getMessage()]
    assert (f"model {key.split('/')[0]} was collected (or its compiled callable was); its communicators {made['0']} "
            "(lane s1) are kept") in line


def test_a_profiling_capture_gives_its_communicators_back(world):
    model = Block(0)
    compiled = _compiled(model, cudagraphs="breakable")  # on the host a first run stands for a capture
    x = torch.randn(4, 8)
    with torch.no_grad(), capturepass.profiling_capture():
        torch.testing.assert_close(compiled(x), model(x))
        (made,) = comms.communicators().values()
    assert comms.communicators() == {}
    with pytest.raises(Exception):  # destroyed: its name no longer resolves
        c10d._resolve_process_group(made["0"])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    (again,) = comms.communicators().values()
    assert dist.get_process_group_ranks(c10d._resolve_process_group(again["0"])) == [0]
    capturepass.release(model)
    assert comms.communicators() == {}


def test_rebind_names_the_owners_group():
    gm = aten_graph(lambda x: funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")),
                    torch.randn(4))
    out = collectives.rebind(gm, {"0": "7"})
    (ar,) = [n for n in out.graph.nodes if collectives.is_collective(n)]
    assert ar.args == (ar.args[0], "sum", "7") and collectives.group_of(ar) == "7"
    assert "'sum', '7')" in out.code
    with pytest.raises(KeyError):
        collectives.rebind(gm, {"1": "7"})


def test_without_a_process_group_the_collective_says_so():
    gm = aten_graph(lambda x: torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x * 2, "sum", "0")) + 1, torch.randn(4))
    compiled = compile_graph(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"],
                             {"inner": "eager"}, record=False)
    executor = Executor(compiled.program)
    try:
        with pytest.raises(ResourceError, match=r"^%all_reduce \(_c10d_functional.all_reduce.default\): owner g\d+\.m\d+/s1: the graph's "
                           r"collectives use process group '0', but torch.distributed is not initialized"):
            executor([torch.randn(4)])
    finally:
        executor.close()


@pytest.mark.slow
def test_inductor_compiles_the_wait_into_the_merged_host_region(world):
    """On the host a segment's lanes merge into one Inductor region; the collective stays a region
    of its own on the comm lane (redirected to the owner's group), and its wait_tensor goes into
    the merged region after it, where Inductor's fallback for it waits for the owner's work."""
    from capturepass.backends.compile import last_compiled

    model = Block(0)
    compiled = torch.compile(model, backend="capturepass", options={"inner": "inductor"})
    with torch.no_grad():
        for seed in (0, 1):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
            # Inductor's relu and add are its own kernels: float32 tolerance.
            torch.testing.assert_close(compiled(x), model(x))
    program = last_compiled()[-1].program
    regions = [(r.lane, r.compiler, r.groups, sorted(n.name for n in r.graph.graph.nodes if collectives.is_wait(n)))
               for r in program.regions]
    assert regions == [(0, "inductor", (), []), (1, "eager", ("0",), []), (0, "inductor", (), ["wait_tensor"])]
    (key,) = comms.communicators()
    assert key.endswith("/s1")
    capturepass.release(model)
