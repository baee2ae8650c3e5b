"""Outputs of a replay without a copy out of the graph's memory, unless the caller still holds them.

A replay writes its outputs into memory its capture fixed (the graph's private
pool, the static input buffers, the staged buffers of breaks); the next replay
of the same capture writes the same memory again. Copying every output out
after every replay costs a kernel per output and as much memory again. Instead,
:class:`OutputAliases` returns each output over a *non-owning alias* of that
memory: a storage made with ``torch._C._construct_storage_from_data_pointer``
(as PyTorch's cudagraph trees rebuild their outputs, ``torch/_inductor/
cudagraph_trees.py``), one alias storage per static storage and call, so that
outputs that view one buffer still share one storage (and ``x.view``-style
aliasing between outputs is kept).

Before the memory is written again (the next replay of the capture, or the
release of its owner, which frees the pool), :meth:`OutputAliases.rescue` looks
at every alias storage handed out since the last rescue: one that no tensor
uses any more (its use count is the alias's own reference alone, the liveness
test of cudagraph trees' ``StorageWeakRefWrapper.expired``) costs nothing; one
that the caller still holds is copied out and the copy swapped under it
(``UntypedStorage._swap_data_ptr_``): every tensor and view of that storage then
reads the copy, with the values of the call that returned it. So only outputs
the caller still holds cost a copy, and an output the caller holds is never
overwritten.

The registry holds each static storage it aliased until its next rescue: even
when the owner of the memory is collected first, a rescue reads memory that is
still allocated.

Where torch lacks one of the three functions this needs, outputs are copied
out as before (:data:`UNSUPPORTED` says why; logged once). An output that
requires grad is always copied: autograd keeps its own record of the storage.

A caller that keeps an output's *storage* object (``out.untyped_storage()``)
but no tensor over it is not seen as holding it (as in cudagraph trees).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger("capturepass")


def _unsupported() -> str | None:
    missing = [
        name for owner, name in (
            (torch._C, "_construct_storage_from_data_pointer"),
            (torch._C, "_storage_Use_Count"),
            (torch.UntypedStorage, "_swap_data_ptr_"),
        ) if not hasattr(owner, name)
    ]
    if missing:
        return f"this torch has no {', '.join(missing)}"
    return None


# Why outputs cannot be aliased with this torch (``None``: they can).
UNSUPPORTED: str | None = _unsupported()
_warned = False


def supported() -> bool:
    """Whether outputs can be returned as aliases here; logs the reason once when not."""
    global _warned
    if UNSUPPORTED is None:
        return True
    if not _warned:
        _warned = True
        log.info("capturepass: replayed outputs are copied out of the graph's memory: %s", UNSUPPORTED)
    return False


def copy_out(out: Any, theirs: set[int]) -> Any:
    """``out`` (any nesting) with every tensor over a storage not in ``theirs`` (``_cdata`` of the
    storages of the call's arguments and constants) moved to a copy: one copy per storage, so
    outputs that viewed one storage view one copy, at the same offsets and strides.

    For results a warm-up computed in a graph pool, which stays the captures' memory. An
    output that requires grad is cloned (autograd keeps its own record of the storage).
    """
    copies: dict[int, Any] = {}

    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
            return v
        storage = v.untyped_storage()
        key = storage._cdata
        if key in theirs or not storage.nbytes():
            return v
        if v.requires_grad:
            return v.clone()
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = storage.clone()
        return v.new_empty(0).set_(copy, v.storage_offset(), v.size(), v.stride())

    return fx.node.map_aggregate(out, one)


def rescue_group(group: list["OutputAliases"]) -> int:
    """Rescues every capture of ``group`` that handed out aliases since its last rescue (call it
    before anything writes memory they share); returns how many storages were copied."""
    if not group:
        return 0
    pending = list(group)
    group.clear()
    return sum(a.rescue() for a in pending)


def _use_count(storage: Any) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class OutputAliases:
    """Hands out a capture's outputs as aliases of its static memory; copies out those still held.

    Args:
        static: tensors over the memory the capture's replays overwrite (segment outputs,
            static input buffers, staged buffers). Their storages are what this aliases;
            any other tensor (a parameter, a caller's tensor, a fresh result of a break)
            is returned as it is.

    Attributes:
        aliased: outputs returned as aliases so far.
        rescues: alias storages copied out so far, because a tensor still used them when
            their memory was about to be overwritten or freed.
        copies: outputs copied at once (outputs that require grad).
    """

    def __init__(self, static: Iterable[torch.Tensor]) -> None:
        self._static: dict[int, Any] = {}  # StorageImpl address -> its storage (held)
        for t in static:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                if st.nbytes():
                    self._static[st._cdata] = st
        self._live: list[tuple[Any, Any]] = []  # (alias storage, static storage) since the last rescue
        self.aliased = 0
        self.rescues = 0
        self.copies = 0
        # Captures whose memory another capture's replays write (a model's shapes share one pool)
        # put themselves here when they hand out an alias: the other replays rescue them first.
        self.group: list[OutputAliases] | None = None
        self._in_group = False

    def is_static(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory a replay overwrites."""
        return t.layout == torch.strided and t.untyped_storage()._cdata in self._static

    def wrap(self, out: Any) -> Any:
        """``out`` (any nesting of lists, tuples and dicts) with every tensor over static memory
        replaced by an alias of it; call once per replay, after it."""
        if not self._static:
            return out
        fresh: dict[int, Any] = {}  # one alias storage per static storage in this call

        def one(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
                return v
            key = v.untyped_storage()._cdata
            static = self._static.get(key)
            if static is None:
                return v
            if v.requires_grad:
                self.copies += 1
                return v.clone()
            alias = fresh.get(key)
            if alias is None:
                alias = torch._C._construct_storage_from_data_pointer(static.data_ptr(), v.device, static.nbytes())
                fresh[key] = alias
                self._live.append((alias, static))
                if self.group is not None and not self._in_group:
                    self.group.append(self)
                    self._in_group = True
            self.aliased += 1
            return v.new_empty(0).set_(alias, v.storage_offset(), v.size(), v.stride())

        return fx.node.map_aggregate(out, one)

    @property
    def num_live(self) -> int:
        """Alias storages handed out since the last rescue that a tensor still uses."""
        return sum(1 for alias, _ in self._live if _use_count(alias) > 1)

    def rescue(self) -> int:
        """Copies out every alias storage a tensor still uses, before its memory is written again.

        Call it before anything may write the static memory: the next replay (and the copy
        of its inputs into the static buffers: an input may be an earlier output), or the
        release of the owner. Returns how many storages were copied.
        """
        self._in_group = False
        if not self._live:
            return 0
        live, self._live = self._live, []
        n = 0
        for alias, static in live:
            # Our own reference is one use; any other is a tensor (or view) of the caller's.
            if _use_count(alias) > 1:
                # The copy goes on the current stream, after the replay that wrote the values;
                # the swap moves the memory under every tensor of the alias at once.
                alias._swap_data_ptr_(static.clone())
                n += 1
        self.rescues += n
        return n

    def close(self) -> None:
        """Rescues what is still held, then lets go of the static storages."""
        self.rescue()
        self._static.clear()
