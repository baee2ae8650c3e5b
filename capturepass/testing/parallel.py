"""Tensor- and expert-parallel MoE blocks over ``torch.distributed``, and a gloo harness.

Both blocks shard the weights of one :class:`~capturepass.testing.models.MoEBlock` (built
from one seed on every rank), so a single-process reference computed from the same
weights is the full block itself:

- :class:`TensorParallelMoE`: tokens replicated on every rank; the shared expert
  column-parallel (gate and up projections split by rows) then row-parallel (the down
  projection split by columns), summed over ranks by an all-reduce; the routed experts
  expert-parallel (each rank computes its ``experts / world`` experts for every token,
  weighted by the replicated router), summed by their own all-reduce.
- :class:`ExpertParallelMoE`: tokens sharded (every rank has its own); the shared
  expert replicated beside expert-parallel routed experts that receive every rank's
  tokens with their router weights through one fixed-capacity ``all_to_all_single``
  and send their weighted sums back through another (dense dispatch: no host sync).

Collectives go through ``torch.distributed._functional_collectives`` (``api="functional"``,
what DTensor uses) or the in-place ``torch.distributed`` calls (``api="c10d"``,
``dist.all_reduce(t)``), which Dynamo traces to the same functional ops.

:func:`spawn_gloo` runs a function on ``world`` CPU processes joined by gloo through a
file in a temporary directory (no network); :func:`check_tensor_parallel` is the
worker the CPU tests and examples run.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from capturepass.testing.models import MoEBlock

APIS = ("functional", "c10d")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def _all_reduce(t: torch.Tensor, group: Any, api: str) -> torch.Tensor:
    import torch.distributed as dist

    if api == "c10d":
        dist.all_reduce(t, group=group)
        return t
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(t, "sum", group if group is not None else dist.group.WORLD)


def _all_to_all(t: torch.Tensor, splits: list[int], group: Any, api: str) -> torch.Tensor:
    import torch.distributed as dist

    if api == "c10d":
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, splits, splits, group=group)
        return out
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single(t, splits, splits, group if group is not None else dist.group.WORLD)


class _Shard(nn.Module):
    def __init__(self, full: MoEBlock, rank: int, world: int, group: Any, api: str) -> None:
        super().__init__()
        if full.experts % world:
            raise ValueError(f"{full.experts} experts do not split over {world} ranks")
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        self.rank, self.world, self.group, self.api = rank, world, group, api
        self.experts, self.expert_width, self.topk = full.experts, full.expert_width, full.topk
        self.local = full.experts // world
        e0 = rank * self.local
        self.first_expert = e0
        self.wr = _frozen(full.wr)
        self.w13 = _frozen(full.w13[e0:e0 + self.local])
        self.w2 = _frozen(full.w2[e0:e0 + self.local])

    def _comb(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.wr)
        vals, idx = torch.topk(logits, self.topk, dim=-1)
        probs = torch.softmax(vals.float(), dim=-1).to(x.dtype)
        return torch.zeros(x.shape[0], self.experts, device=x.device, dtype=x.dtype).scatter(1, idx, probs)

    def _local_experts(self, x: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """This rank's experts on every row of ``x``, weighted by ``comb`` (its columns)."""
        t, d = x.shape
        h = torch.bmm(x.unsqueeze(0).expand(self.local, t, d), self.w13)
        g, u = h.split(self.expert_width, dim=-1)
        o = torch.bmm(F.silu(g) * u, self.w2)
        return (o * comb.t().unsqueeze(-1)).sum(0)


class TensorParallelMoE(_Shard):
    """One rank's part of a :class:`MoEBlock`: tensor-parallel shared expert, expert-parallel experts.

    Args:
        full: the whole block (every rank builds it from one seed).
        rank / world: this rank and the number of ranks.
        group: the process group (default: the world).
        api: ``"functional"`` or ``"c10d"`` collectives.
    """

    def __init__(self, full: MoEBlock, rank: int, world: int, group: Any = None, api: str = "functional") -> None:
        super().__init__(full, rank, world, group, api)
        shared = full.wg.shape[0]
        if shared % world:
            raise ValueError(f"shared width {shared} does not split over {world} ranks")
        n = shared // world
        rows = slice(rank * n, (rank + 1) * n)
        self.wg = _frozen(full.wg[rows])
        self.wu = _frozen(full.wu[rows])
        self.wd = _frozen(full.wd[:, rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)
        s = _all_reduce(s, self.group, self.api)
        comb = self._comb(x)
        r = self._local_experts(x, comb[:, self.first_expert:self.first_expert + self.local])
        r = _all_reduce(r, self.group, self.api)
        return s + r


class ExpertParallelMoE(_Shard):
    """One rank's part of a :class:`MoEBlock` over sharded tokens: the shared expert replicated,
    the routed experts expert-parallel behind two fixed-capacity all-to-alls.

    Every rank sends all its tokens, with their router weights, to every rank (capacity: all
    of them; no host sync), computes its experts' weighted sum for each, and sends it back;
    each token's output is its shared expert plus the sum over ranks.
    """

    def __init__(self, full: MoEBlock, rank: int, world: int, group: Any = None, api: str = "functional") -> None:
        super().__init__(full, rank, world, group, api)
        self.wg = _frozen(full.wg)
        self.wu = _frozen(full.wu)
        self.wd = _frozen(full.wd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        s = F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)
        comb = self._comb(x)
        splits = [t] * self.world
        recv = _all_to_all(torch.cat([x, comb], dim=-1).repeat(self.world, 1), splits, self.group, self.api)
        e0 = d + self.first_expert
        y = self._local_experts(recv[:, :d], recv[:, e0:e0 + self.local])
        back = _all_to_all(y, splits, self.group, self.api)
        return s + back.view(self.world, t, d).sum(0)


def gloo_unavailable() -> str | None:
    """Why gloo process groups cannot be made in this build of torch, or ``None`` when they can."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this build of torch"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this build of torch"
    return None


@contextlib.contextmanager
def one_rank_world() -> Iterator[Any]:
    """A gloo world of this process alone, for the duration of the block (yields its group).

    Graphs traced with the world group name it ``"0"``: the first group a process makes, and
    the name again after the world is destroyed (torch resets its group counter then). Inside
    an initialized world, yields that one and leaves it alone.

    Raises:
        RuntimeError: gloo is not available (:func:`gloo_unavailable` says why).
    """
    import torch.distributed as dist

    reason = gloo_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory(prefix="capturepass-gloo-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def init_gloo(rank: int, world: int, init_file: str) -> None:
    """Joins the gloo process group of ``world`` CPU processes through ``init_file``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def spawn_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> None:
    """Runs ``fn(rank, world, init_file, *args)`` on ``world`` processes (``torch.multiprocessing``),
    ``init_file`` in a new temporary directory.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a process failed (its traceback included).
        TimeoutError: the processes did not finish within ``timeout`` seconds (they are
            terminated: a collective that one rank never reaches would wait forever).
    """
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="capturepass-gloo-") as tmp:
        context = mp.start_processes(fn, args=(world, os.path.join(tmp, "init"), *args), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{world} gloo processes running {fn.__qualname__} did not finish in {timeout:.0f} s")


def check_tensor_parallel(rank: int, world: int, init_file: str, out_dir: str, options: dict[str, Any],
                          per_model: dict[str, dict[str, Any]] | None = None,
                          tokens: tuple[int, ...] = (8, 5)) -> None:
    """The worker of the CPU tests: compiles both blocks, checks them against the full block.

    ``options`` are the capturepass options of every model, ``per_model`` adds options by
    model name (``"tp"``, ``"ep"``, ``"draft"``).

    Writes ``rank<r>.json`` into ``out_dir``: the largest error per block and call, and the
    communicators each compiled model used (``capturepass.communicators``); the dumps go
    to ``out_dir/rank<r>/<block>``. A target and a draft instance of the tensor-parallel
    block run one after the other: their owners must not share a communicator.
    """
    import torch.distributed as dist

    from capturepass.runtime import comms

    init_gloo(rank, world, init_file)
    torch.set_num_threads(1)
    report: dict[str, Any] = {"errors": {}, "communicators": {}}
    try:
        torch.manual_seed(0)
        full = MoEBlock(d=32, shared=64, experts=4, expert_width=16, topk=2)
        torch.manual_seed(1)
        draft_full = MoEBlock(d=32, shared=32, experts=4, expert_width=8, topk=2)
        models = {
            "tp": TensorParallelMoE(full, rank, world),
            "ep": ExpertParallelMoE(full, rank, world),
            "draft": TensorParallelMoE(draft_full, rank, world, api="c10d"),
        }
        refs = {"tp": full, "ep": full, "draft": draft_full}
        before = set(comms.communicators())
        for name, model in models.items():
            opts = dict(options, **(per_model or {}).get(name, {}), dump_dir=os.path.join(out_dir, f"rank{rank}", name))
            compiled = torch.compile(model, backend="capturepass", options=opts, dynamic=False)
            errors = []
            for i, t in enumerate(tokens):
                # Tensor parallel: every rank sees the same tokens; expert parallel: its own.
                torch.manual_seed(100 + i + (rank if name == "ep" else 0))
                x = torch.randn(t, 32)
                with torch.no_grad():
                    out = compiled(x)
                    ref = refs[name](x)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
                errors.append(float((out - ref).abs().max()))
            report["errors"][name] = errors
            now = comms.communicators()
            report["communicators"][name] = {k: v for k, v in now.items() if k not in before}
            before = set(now)
        dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
        dist.destroy_process_group()
