"""Tensor- and expert-parallel MoE blocks over ``torch.distributed``, and a gloo harness.

Both blocks shard the weights of one :class:`~capturepass.testing.models.MoEBlock` (built
from one seed on every rank), so a single-process reference computed from the same
weights is the full block itself (equal up to the rounding of sums that the sharding
splits), and :func:`tensor_parallel_reference` and :func:`expert_parallel_reference`
redo the ranks' computation in one process in their op order (equal to the last bit):

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

:func:`spawn_ranks` runs a function on ``world`` processes that join through a file in a
temporary directory (no network; gloo on the CPU, NCCL on GPUs, :func:`init_ranks`);
:func:`check_blocks` is the worker of the parallel tests; :func:`one_rank_world` makes a
world of one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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

    def shared_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the shared expert: its rows of the hidden layer through its
        columns of the down projection (the all-reduce sums the shares)."""
        return F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)

    def routed_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts on every token, weighted by the router (the all-reduce sums them)."""
        comb = self._comb(x)
        return self._local_experts(x, comb[:, self.first_expert:self.first_expert + self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = _all_reduce(self.shared_partial(x), self.group, self.api)
        r = _all_reduce(self.routed_partial(x), self.group, self.api)
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

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert (replicated) on this rank's tokens."""
        return F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)

    def dispatch_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """What this rank sends: every token with its router weights, once per rank."""
        return torch.cat([x, self._comb(x)], dim=-1).repeat(self.world, 1)

    def expert_sums(self, recv: torch.Tensor) -> torch.Tensor:
        """This rank's experts on every received token, weighted: one row per row of ``recv``."""
        d = self.w13.shape[1]
        e0 = d + self.first_expert
        return self._local_experts(recv[:, :d], recv[:, e0:e0 + self.local])

    def combine(self, back: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of what came back, ``world`` blocks of this rank's tokens."""
        return back.view(self.world, back.shape[0] // self.world, back.shape[1]).sum(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splits = [x.shape[0]] * self.world
        s = self.shared(x)
        recv = _all_to_all(self.dispatch_buffer(x), splits, self.group, self.api)
        back = _all_to_all(self.expert_sums(recv), splits, self.group, self.api)
        return s + self.combine(back)


def _rank_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def tensor_parallel_reference(full: MoEBlock, x: torch.Tensor, world: int,
                              shards: list[TensorParallelMoE] | None = None) -> torch.Tensor:
    """What :class:`TensorParallelMoE` computes on ``world`` ranks, in one process and in its op order.

    Each rank's shares are computed with its weights and summed in rank order where the
    all-reduce sums them. For two ranks this is what gloo returns to the last bit: a sum of
    two floats does not depend on their order. (``full(x)`` differs in the last bits: it sums
    the shared expert's down projection over all its columns at once.) ``shards``: the ranks'
    modules, when made already (they copy the weights).
    """
    shards = shards or [TensorParallelMoE(full, r, world) for r in range(world)]
    shared = _rank_sum([sh.shared_partial(x) for sh in shards])
    routed = _rank_sum([sh.routed_partial(x) for sh in shards])
    return shared + routed


def expert_parallel_reference(full: MoEBlock, xs: list[torch.Tensor], world: int,
                              shards: list[ExpertParallelMoE] | None = None) -> list[torch.Tensor]:
    """What :class:`ExpertParallelMoE` computes on ``world`` ranks (rank ``r`` with tokens
    ``xs[r]``), in one process and in its op order: every rank's output.

    The all-to-alls only move rows (rank ``q`` receives block ``q`` of every rank's buffer,
    in rank order), so this equals the ranks' results to the last bit. ``shards``: the ranks'
    modules, when made already (they copy the weights).
    """
    shards = shards or [ExpertParallelMoE(full, r, world) for r in range(world)]
    t = xs[0].shape[0]
    sent = [sh.dispatch_buffer(x) for sh, x in zip(shards, xs)]
    recv = [torch.cat([buf[q * t:(q + 1) * t] for buf in sent]) for q in range(world)]
    sums = [sh.expert_sums(r) for sh, r in zip(shards, recv)]
    back = [torch.cat([y[r * t:(r + 1) * t] for y in sums]) for r in range(world)]
    return [sh.shared(x) + sh.combine(b) for sh, x, b in zip(shards, xs, back)]


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
    init_ranks(rank, world, init_file, "cpu")


def init_ranks(rank: int, world: int, init_file: str, device: str) -> None:
    """Joins the process group of ``world`` processes through ``init_file``: gloo on the CPU,
    NCCL on CUDA (rank ``r`` on GPU ``r``)."""
    import torch.distributed as dist

    import inspect

    kwargs: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            # Bound to its GPU: NCCL guesses it from the rank otherwise (and says it may hang).
            kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, **kwargs)


def nccl_unavailable(world: int = 2) -> str | None:
    """Why ``world`` NCCL ranks (one GPU each) cannot run here, or ``None`` when they can."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build of torch"
    if torch.cuda.device_count() < world:
        return f"needs {world} CUDA devices, found {torch.cuda.device_count()}"
    return None


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> None:
    """Runs ``fn(rank, world, init_file, *args)`` on ``world`` processes (``torch.multiprocessing``,
    started with ``spawn``: CUDA may be used in them), ``init_file`` in a new temporary directory.

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
                raise TimeoutError(f"{world} processes running {fn.__qualname__} did not finish in {timeout:.0f} s")


SIZES = {"d": 32, "shared": 64, "experts": 8, "expert_width": 16, "topk": 2}
"""The block of the CPU tests: 8 routed experts, 4 per rank of two."""

DRAFT_SIZES = {"d": 32, "shared": 32, "experts": 8, "expert_width": 8, "topk": 2}
"""A second, smaller block (a draft model beside the target)."""

FLOAT32_TOLERANCE = {"atol": 1e-5, "rtol": 1.3e-6}
"""torch.testing's float32 tolerance: for results whose op order differs from the reference's
(the full block's one down projection, where tensor parallelism sums two halves; Inductor's
own pointwise kernels), each rounding a few ulps apart."""


def tokens_of(model: str, call: int, t: int, world: int, d: int) -> list[torch.Tensor]:
    """Every rank's tokens for call ``call`` of ``model``: new values at every call; the same on
    every rank for tensor parallelism, each rank its own for expert parallelism."""
    def draw(seed: int) -> torch.Tensor:
        return torch.randn(t, d, generator=torch.Generator().manual_seed(seed))

    if model == "ep":
        return [draw(1000 + 10 * call + r) for r in range(world)]
    return [draw(100 + call)] * world


def _sequence_number(group: Any) -> int | None:
    # How many collectives a group has posted (gloo and NCCL count them); None where torch
    # does not say.
    get = getattr(group, "_get_sequence_number_for_group", None)
    try:
        return int(get()) if get is not None else None
    except RuntimeError:
        return None


def check_blocks(rank: int, world: int, init_file: str, out_dir: str, options: dict[str, Any],
                 per_model: dict[str, dict[str, Any]] | None = None, tokens: tuple[int, ...] = (8, 8, 5),
                 exact: bool = True, device: str = "cpu", watchdog_s: float | None = None) -> None:
    """The worker of the parallel tests: compiles the parallel blocks and checks every call.

    Three models, compiled with ``torch.compile(backend="capturepass")`` one after the other:
    ``"tp"`` (:class:`TensorParallelMoE` of a :data:`SIZES` block), ``"ep"``
    (:class:`ExpertParallelMoE` of the same block) and ``"draft"`` (a second tensor-parallel
    model instance, of a :data:`DRAFT_SIZES` block, written with in-place
    ``dist.all_reduce``). Each is called once per entry of ``tokens`` with new values
    (:func:`tokens_of`) and must equal the reference in the ranks' op order
    (:func:`tensor_parallel_reference`, :func:`expert_parallel_reference`): to the last bit
    with ``exact`` (the eager inner compiler runs the ATen kernels eager runs), within
    :data:`FLOAT32_TOLERANCE` otherwise; and the full single-process block within
    :data:`FLOAT32_TOLERANCE`.

    ``options`` are the capturepass options of every model, ``per_model`` adds options by
    model name. Writes ``rank<r>.json`` into ``out_dir``: per model and call the largest
    difference from each reference; the communicators each model's owners used
    (``capturepass.communicators``); the ranks of each of those groups and how many
    collectives it posted, and how many the world group (the one the graphs were traced
    with) posted meanwhile (``None`` where torch does not count them); per model, how many
    CUDA graphs its compiled graphs hold. The dumps go to ``out_dir/rank<r>/<model>``.

    ``device="cuda"``: NCCL, rank ``r`` on GPU ``r``, the weights and tokens there (float32).
    ``watchdog_s``: a rank still running after this many seconds prints every thread's stack
    and exits (a collective one rank never reaches waits forever; the stacks say where).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import capturepass
    from capturepass.backends.compile import last_compiled
    from capturepass.runtime import comms

    if watchdog_s is not None:
        import faulthandler

        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    init_ranks(rank, world, init_file, device)
    torch.set_num_threads(1)  # the same kernels, one thread, in the workers and their references
    report: dict[str, Any] = {"errors": {}, "communicators": {}, "posted": {}, "captures": {}}
    try:
        torch.manual_seed(0)
        full = MoEBlock(**SIZES, device=device)
        torch.manual_seed(1)
        draft_full = MoEBlock(**DRAFT_SIZES, device=device)
        models = {
            "tp": (TensorParallelMoE(full, rank, world), full),
            "ep": (ExpertParallelMoE(full, rank, world), full),
            "draft": (TensorParallelMoE(draft_full, rank, world, api="c10d"), draft_full),
        }
        world_before = _sequence_number(dist.group.WORLD)
        before: set[str] = set(comms.communicators())
        for name, (model, block) in models.items():
            opts = dict(options, **(per_model or {}).get(name, {}), dump_dir=os.path.join(out_dir, f"rank{rank}", name))
            compiled = torch.compile(model, backend="capturepass", options=opts, dynamic=False)
            graphs_before = {id(g) for g in last_compiled()}
            errors = []
            for call, t in enumerate(tokens):
                xs = [x.to(device) for x in tokens_of(name, call, t, world, block.wg.shape[1])]
                with torch.no_grad():
                    out = compiled(xs[rank])
                    if name == "ep":
                        same = expert_parallel_reference(block, xs, world)[rank]
                    else:
                        same = tensor_parallel_reference(block, xs[rank], world)
                    ref = block(xs[rank])
                if exact:
                    torch.testing.assert_close(out, same, atol=0, rtol=0, msg=lambda m: f"{name} call {call}: {m}")
                else:
                    torch.testing.assert_close(out, same, **FLOAT32_TOLERANCE, msg=lambda m: f"{name} call {call}: {m}")
                torch.testing.assert_close(out, ref, **FLOAT32_TOLERANCE, msg=lambda m: f"{name} call {call}: {m}")
                errors.append({"same_order": float((out - same).abs().max()), "full": float((out - ref).abs().max())})
            report["errors"][name] = errors
            report["captures"][name] = sum(g.executor.num_captures for g in last_compiled()
                                           if id(g) not in graphs_before and getattr(g, "executor", None) is not None)
            now = comms.communicators()
            report["communicators"][name] = {k: v for k, v in now.items() if k not in before}
            before = set(now)
        report["ranks"] = {}
        for channel in comms.communicators().values():
            for group_name in channel.values():
                group = c10d._resolve_process_group(group_name)
                report["posted"][group_name] = _sequence_number(group)
                report["ranks"][group_name] = dist.get_process_group_ranks(group)
        after = _sequence_number(dist.group.WORLD)
        report["world_posted"] = None if world_before is None or after is None else after - world_before
        dist.barrier()
        # Every rank releases the models in one order before the world goes: NCCL destroys a
        # communicator only once the CUDA graphs that captured its collectives are gone.
        for model, _ in models.values():
            capturepass.release(model)
        report["released"] = sorted(comms.communicators())
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
        dist.destroy_process_group()
        if watchdog_s is not None:
            import faulthandler

            faulthandler.cancel_dump_traceback_later()


def canonical_dump(text: str) -> str:
    """A dump with the graph's owner id as ``g0``: the id is process-wide, so it depends on what
    compiled before the graph."""
    return re.sub(r"(?<=owner[ =])g\d+|(?<=@)g\d+", "g0", text)


def schedule_lines(text: str) -> list[str]:
    """Each line of a dump without the arguments of its op (binders, ops, lanes, events,
    reasons): what every rank schedules alike, its own slice bounds aside."""
    return [re.sub(r"^(\s*%\w+ : .*? = [\w.]+)\(.*\)(  \{.*)$", r"\1\2", line)
            for line in canonical_dump(text).splitlines()]
