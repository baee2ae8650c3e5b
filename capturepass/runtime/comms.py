"""Communicators as owner-bound resources: a process group per model instance, lane and traced group.

A compiled graph's collectives name the process group they were traced with
(``_c10d_functional.all_reduce(x, "sum", "0")``). Two owners that post on one
communicator (a target model and its draft, replayed back to back or on two
streams) would interleave their collectives on one NCCL channel, and a CUDA graph
bakes that channel in. capturepass therefore binds communicators like any other
channel (docs/resources.md): the resource pool :data:`POOL_NAME` gives every model
instance (``g3.m0``: the owners of its capture shapes, its uncaptured runs and its
schedule candidates, which never run at once, share them) and lane its own
:class:`Communicators`, which makes one process group per traced group on first use,
with ``torch.distributed.new_group`` over the traced group's ranks and backend.

When they are destroyed: tearing an NCCL communicator down is collective (the finalize
waits for the other ranks; torch destroys its own groups in name order for this
reason), so a rank may only destroy one where every rank does, at the same point of
its program. :func:`release_model` destroys a model instance's groups when
``capturepass.release(model)`` releases it (every rank runs the same program, so every
rank calls it there) and when a profiling capture rolls the pool back. A model that is
garbage collected dies at a moment of each rank's own: its NCCL groups are kept (and
logged) until ``torch.distributed`` destroys its process groups; gloo groups, torn down
locally, are destroyed at once.

How the graph reaches the owner's group: ``emit`` puts every collective in a region
of its own, run by the eager compiler. When the runtime binds a program to an owner
(``Program.bind``), each such region is wrapped by :func:`redirected`: on its first
call it asks the pool for the running owner's communicators on the region's lane
and calls a copy of the region graph whose collectives name the owner's groups
instead of the traced ones (``ir.collectives.rebind``). The first call of every
owner is uncaptured (a warm-up, or an eager run), so the group, and with NCCL its
communicator, exists before any capture records onto it (made by the model's first
owner, it is there for the rest); a capture then bakes the
owner's communicator into its graph, and replays use it without calling the region.

What cannot be redirected: a group made while a CUDA graph is being captured (NCCL
cannot create a communicator then), which happens only when an engine captures
around a compiled graph whose owner never ran uncaptured: :class:`ResourceError`
says so. ``wait_tensor`` needs no redirection: it waits for the work registered
on its tensor, whichever group posted it.

Every rank must make its groups in the same order: it does when every rank runs
the same program (the SPMD model ``torch.distributed`` assumes), since owners are
made by the same calls on every rank. ``new_group`` is called with
``use_local_synchronization=True`` where torch has it, so that only the group's
members take part.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import ResourceError
from capturepass.ir import collectives
from capturepass.runtime import pools
from capturepass.runtime.pools import ChannelKey, ResourcePool

log = logging.getLogger("capturepass")

POOL_NAME = "capturepass.communicators"
"""The name of the resource pool of communicators."""

_lock = threading.Lock()
_pool: ResourcePool | None = None
_retired: list[Any] = []  # groups kept alive until torch.distributed destroys its process groups


class Communicators:
    """The communicators of one owner and lane: one process group per traced group.

    Args:
        key: the owner and lane they belong to.

    Attributes:
        groups: traced group name -> this owner's process group, made on first use.
    """

    def __init__(self, key: ChannelKey) -> None:
        self.key = key
        self.groups: dict[str, Any] = {}
        self._lock = threading.Lock()

    def group(self, traced: str) -> Any:
        """This owner's process group standing for the traced group ``traced``.

        Raises:
            ResourceError: ``torch.distributed`` is not initialized, ``traced`` is not a group
                of this process, or a CUDA graph is being captured.
        """
        with self._lock:
            group = self.groups.get(traced)
            if group is None:
                group = self.groups[traced] = _new_group(traced, self.key)
            return group

    def name(self, traced: str) -> str:
        """The name of this owner's group for ``traced`` (what the redirected collective passes)."""
        return self.group(traced).group_name

    def names(self) -> dict[str, str]:
        """Traced group name -> this owner's group name, for the groups made so far."""
        with self._lock:
            return {traced: g.group_name for traced, g in self.groups.items()}

    def release(self) -> None:
        """Destroys this model instance's groups (in name order, as every rank does)."""
        with self._lock:
            groups, self.groups = self.groups, {}
        for traced, group in sorted(groups.items(), key=lambda item: item[1].group_name):
            _destroy(group, f"{self.key} ({traced!r})")

    def retire(self) -> list[str]:
        """Drops the groups whose teardown is collective without destroying them: they are
        kept until ``torch.distributed`` destroys its process groups. Returns their names."""
        with self._lock:
            kept = {t: g for t, g in self.groups.items() if not _local_teardown(g)}
            for traced in kept:
                del self.groups[traced]
        _retired.extend(kept.values())
        return sorted(g.group_name for g in kept.values())

    def __repr__(self) -> str:
        return f"<Communicators {self.key}: {self.names()}>"


def _new_group(traced: str, key: ChannelKey) -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ResourceError(
            f"owner {key}: the graph's collectives use process group {traced!r}, but torch.distributed "
            "is not initialized in this process (init_process_group before calling the compiled model)"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ResourceError(
            f"owner {key}: its communicator for process group {traced!r} would be made during a CUDA graph "
            "capture, which NCCL cannot do; call the compiled model once uncaptured (a warm-up) before "
            "capturing it"
        )
    from torch.distributed import distributed_c10d as c10d

    try:
        base = c10d._resolve_process_group(traced)
    except Exception as exc:
        raise ResourceError(
            f"owner {key}: the graph's collectives use process group {traced!r}, which this process does not "
            f"know ({type(exc).__name__}: {exc})"
        ) from exc
    ranks = dist.get_process_group_ranks(base)
    kwargs: dict[str, Any] = {"ranks": ranks, "backend": dist.get_backend(base)}
    params = inspect.signature(dist.new_group).parameters
    if "use_local_synchronization" in params:
        kwargs["use_local_synchronization"] = True
    if "group_desc" in params:
        kwargs["group_desc"] = f"capturepass {key} for {traced}"
    group = dist.new_group(**kwargs)
    log.info("capturepass: owner %s: communicator %r for process group %r (ranks %s, backend %s)",
             key, group.group_name, traced, ",".join(map(str, ranks)), kwargs["backend"])
    return group


def _destroy(group: Any, what: str) -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(group)
    except Exception as exc:  # the default group is gone already (process teardown): nothing left
        log.debug("capturepass: destroying the communicator of %s failed: %s", what, exc)


def _local_teardown(group: Any) -> bool:
    # gloo closes its pairs locally; NCCL's finalize waits for the other ranks (and any backend
    # not known here is assumed to as well).
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # the group is gone already
        return True


def _release(channel: Communicators) -> None:
    channel.release()


def release_model(model: str, in_step: bool) -> int:
    """Releases the communicators of model instance ``model`` (``"g3.m0"``); returns how many
    lanes' worth.

    Args:
        in_step: every rank releases the model at this point of its program
            (``capturepass.release``): every group is destroyed, in name order. Otherwise
            (the model was garbage collected) groups whose teardown is collective are kept
            until ``torch.distributed`` destroys its process groups, and the log says so.
    """
    if _pool is None:
        return 0
    if not in_step:
        for key, channel in sorted(_pool.channels().items()):
            if key.owner == model:
                kept = channel.retire()
                if kept:
                    log.info("capturepass: model %s was collected (or its compiled callable was); its communicators "
                             "%s (lane s%d) are kept until torch.distributed destroys its process groups: "
                             "destroying them is collective, and the other ranks collect theirs at moments of "
                             "their own (capturepass.release(model) on every rank destroys them at once)",
                             model, ", ".join(kept), key.lane)
    return _pool.release_owner(model)


def pool() -> ResourcePool:
    """The resource pool of communicators (registered on first use)."""
    global _pool
    with _lock:
        if _pool is None or _pool not in pools.registered_pools():
            _pool = ResourcePool(POOL_NAME, Communicators, release=_release)
            pools.register_pool(_pool)
        return _pool


def communicators(owner: str | None = None) -> dict[str, dict[str, str]]:
    """The live communicators, ``"<model>/s<lane>"`` -> {traced group name: model's group name}.

    Args:
        owner: only this model instance's (its name, ``"g3.m0"``).
    """
    if _pool is None:
        return {}
    return {str(k): ch.names() for k, ch in sorted(_pool.channels().items())
            if owner is None or k.owner == owner}


def redirected(graph: fx.GraphModule, groups: Sequence[str], owner: str, lane: int) -> Callable[..., Any]:
    """The region ``graph`` calling the communicators of ``owner`` (a model instance, ``"g3.m0"``)
    on ``lane`` for the traced ``groups``.

    The copy is made on the first call (the owner's groups are made then) and again if the
    pool released the communicators meanwhile (a rollback).
    """
    comm_pool = pool()
    bound: list[Any] = [None, None]  # the Communicators the copy was made for, and the copy
    nodes = ", ".join(f"%{n.name} ({n.target})" for n in graph.graph.nodes if collectives.is_collective(n))

    def call(*args: Any) -> Any:
        channel = comm_pool.channel(owner=owner, lane=lane)
        if bound[0] is not channel:
            try:
                mapping = {g: channel.name(g) for g in groups}
            except ResourceError as exc:
                raise ResourceError(f"{nodes}: {exc}") from exc
            bound[1] = collectives.rebind(graph, mapping).forward
            bound[0] = channel
        return bound[1](*args)

    call.__name__ = f"redirected_{owner}_s{lane}"
    return call
