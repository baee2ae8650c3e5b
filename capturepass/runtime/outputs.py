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

Where torch has no ``_swap_data_ptr_`` (torch 2.11) a held alias is rescued
by moving its *tensors* instead of its storage: every tensor this handed out
over it that is still alive is re-pointed at the copy (``Tensor.set_`` with its
own offset, sizes and strides, so views stay views of one copy). A tensor the
caller made from an output (a view, a ``detach``) is not one this knows: when
the alias is still used after the known tensors moved, the Python heap is
searched once for tensors over it (a slow path, logged), and that capture
returns copies from then on, since its caller evidently keeps derived views
across calls. A holder no search can reach (a C++ object) makes the storage
raise on access where torch offers that (``_set_storage_data_ptr_access_error_msg``,
as cudagraph trees expire outputs), and otherwise fails the call: never is
an output overwritten under its holder.

Where torch lacks one of the two functions aliasing needs, outputs are copied
out as before (:data:`UNSUPPORTED` says why; logged once). An output that
requires grad is always copied: autograd keeps its own record of the storage.

A caller that keeps an output's *storage* object (``out.untyped_storage()``)
but no tensor over it is not seen as holding it (as in cudagraph trees).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger("capturepass")


def _unsupported() -> str | None:
    missing = [
        name for owner, name in (
            (torch._C, "_construct_storage_from_data_pointer"),
            (torch._C, "_storage_Use_Count"),
        ) if not hasattr(owner, name)
    ]
    if missing:
        return f"this torch has no {', '.join(missing)}"
    return None


# Why outputs cannot be aliased with this torch (``None``: they can).
UNSUPPORTED: str | None = _unsupported()
# Makes a tensor over a storage with a dtype, sizes, strides and an offset in one call, as
# cudagraph trees hand out their outputs (CUDA builds of torch, for CUDA storages). Checked once
# against ``Tensor.set_`` before it is used (:func:`over_alias`).
_BUILD = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)
_BUILDS_FOR = "cuda"
_build_ok: bool | None = None  # None: not checked yet
# Whether a held alias storage can take a copy's memory in place (else its tensors are moved).
SWAP: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
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
        if storage._cdata in theirs or not storage.nbytes():
            return v
        if v.requires_grad:
            return v.clone()
        return _on_copy(v, storage, copies)

    return fx.node.map_aggregate(out, one)


def non_owning(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """For each strided tensor of ``tensors``, the same tensor over a *non-owning* storage of
    the same memory (address, size, offset, strides kept), by ``id`` of the tensor; one
    non-owning storage per storage, so tensors that viewed one storage still share one.

    A capture holds its outputs and input buffers this way once captured, as vLLM holds its
    graphs' outputs (``weak_ref_tensors``): their blocks go back to the graphs' pool, where the
    model's later captures take them, and the graph still writes the same addresses at replay.
    Tensors of another type than ``torch.Tensor``, that require grad, with a conjugate or
    negative bit, or over no memory are left out (held as they are).
    """
    made: dict[int, Any] = {}
    out: dict[int, torch.Tensor] = {}
    for v in tensors:
        if type(v) is not torch.Tensor or v.layout != torch.strided or v.requires_grad or v.is_conj() \
                or v.is_neg():
            continue
        storage = v.untyped_storage()
        if storage.nbytes():
            out[id(v)] = _over(v, storage, made, lambda st: torch._C._construct_storage_from_data_pointer(
                st.data_ptr(), v.device, st.nbytes()))
    return out


def build_meta(v: torch.Tensor) -> dict[str, Any] | None:
    """What :func:`over_alias` builds a tensor like ``v`` from in one call (``None`` where it
    cannot: no such call in this torch, a tensor of another device or type, or a failed check)."""
    if _BUILD is None or _build_ok is False or type(v) is not torch.Tensor or v.device.type != _BUILDS_FOR:
        return None
    return {"dtype": v.dtype, "size": tuple(v.shape), "stride": v.stride(), "storage_offset": v.storage_offset()}


def over_alias(v: torch.Tensor, alias: Any, meta: dict[str, Any] | None) -> torch.Tensor:
    """``v``'s sizes, strides, offset and dtype over the storage ``alias``: in one call from
    ``meta`` (:func:`build_meta`) where that call passed its check, else through ``set_``."""
    global _build_ok
    if meta is not None and _build_ok:
        return _BUILD(meta, alias)
    t = v.new_empty(0).set_(alias, v.storage_offset(), v.size(), v.stride())
    if meta is not None and _build_ok is None:
        try:
            built = _BUILD(meta, alias)
            same = all(f(built) == f(t) for f in _ALIKE)
        except Exception as exc:  # noqa: BLE001 - any failure of the fast call only disables it
            same, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = "it built a tensor unlike Tensor.set_'s"
        _build_ok = same
        if not same:
            log.info("capturepass: replayed outputs are aliased through Tensor.set_ (%s did not pass its check: %s)",
                     "_construct_CUDA_Tensor_From_Storage_And_Metadata", why)
    return t


# What a tensor built over an alias must agree on with one made by ``set_``.
_ALIKE = (
    torch.Tensor.data_ptr, lambda t: tuple(t.shape), torch.Tensor.stride, torch.Tensor.storage_offset,
    lambda t: t.dtype, lambda t: t.device, lambda t: t.requires_grad, torch.Tensor.is_inference,
    lambda t: t.untyped_storage()._cdata, lambda t: type(t),
)


def _over(v: torch.Tensor, storage: Any, made: dict[int, Any], make: Any) -> torch.Tensor:
    """``v`` over ``make(storage)``, kept in ``made`` (made on first use: one per storage, so
    tensors that viewed one storage view one replacement), at its own offset, sizes and strides."""
    other = made.get(storage._cdata)
    if other is None:
        other = made[storage._cdata] = make(storage)
    return with_bits(v, v.new_empty(0).set_(other, v.storage_offset(), v.size(), v.stride()))


def with_bits(v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``, made over ``v``'s memory, with ``v``'s conjugate and negative bits: a lazy
    ``conj()`` or negation is a bit of the tensor, not of its memory, which ``set_`` and a tensor
    built from a storage leave unset (the replayed output of ``y.conj()`` read as ``y``)."""
    if v.is_conj():
        torch._C._set_conj(t, True)
    if v.is_neg():
        torch._C._set_neg(t, True)
    return t


def _on_copy(v: torch.Tensor, storage: Any, copies: dict[int, Any]) -> torch.Tensor:
    """``v`` over the copy of ``storage`` in ``copies`` (one copy per storage)."""
    return _over(v, storage, copies, lambda st: st.clone())


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
        swap: rescue a held alias by swapping its storage's memory (``_swap_data_ptr_``)
            rather than by moving the tensors over it; defaults to :data:`SWAP`.

    Attributes:
        aliased: outputs returned as aliases so far.
        rescues: alias storages copied out so far, because a tensor still used them when
            their memory was about to be overwritten or freed.
        copies: outputs copied at once (outputs that require grad, and every output once
            :attr:`copying`).
        searches: rescues that had to search the heap for tensors the caller derived.
        copying: why outputs are copied at once from now on (``None``: they are aliased).
    """

    def __init__(self, static: Iterable[torch.Tensor], swap: bool | None = None) -> None:
        self._static: dict[int, Any] = {}  # StorageImpl address -> its storage (held)
        for t in static:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                if st.nbytes():
                    self._static[st._cdata] = st
        self._swap = SWAP if swap is None else swap
        # Since the last rescue: (alias storage, static storage, weak references to the tensors
        # handed out over the alias; kept only when a rescue moves tensors, not storages).
        self._live: list[tuple[Any, Any, Sequence[weakref.ref]]] = []
        self.aliased = 0
        self.rescues = 0
        self.copies = 0
        self.searches = 0
        self.copying: str | None = None
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
        fresh: dict[int, Any] = {}  # one alias storage (or copy) per static storage

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
            return self.alias(v, key, fresh)

        return fx.node.map_aggregate(out, one)

    def alias(self, v: torch.Tensor, key: int, fresh: dict[int, Any], meta: dict[str, Any] | None = None
              ) -> torch.Tensor:
        """``v``, a tensor over the static storage ``key`` (its ``_cdata``) that requires no grad,
        over an alias of that storage: one alias storage per static storage and call (``fresh``,
        the call's, empty at its start), so that outputs viewing one storage still share one.
        ``meta``: ``build_meta(v)``, for a caller that hands out ``v`` at every call. While
        :attr:`copying`, a copy instead."""
        static = self._static[key]
        if self.copying is not None:
            self.copies += 1
            return _on_copy(v, static, fresh)
        alias, refs = fresh.get(key, (None, None))
        if alias is None:
            alias = torch._C._construct_storage_from_data_pointer(static.data_ptr(), v.device, static.nbytes())
            refs = None if self._swap else []
            fresh[key] = (alias, refs)
            self._live.append((alias, static, refs if refs is not None else ()))
            if self.group is not None and not self._in_group:
                self.group.append(self)
                self._in_group = True
        self.aliased += 1
        t = with_bits(v, over_alias(v, alias, meta))
        if refs is not None:
            refs.append(weakref.ref(t))
        return t

    @property
    def num_live(self) -> int:
        """Alias storages handed out since the last rescue that a tensor still uses."""
        return sum(1 for alias, _, _ in self._live if _use_count(alias) > 1)

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
        if torch._C._len_torch_dispatch_stack():
            # The release of an owner runs wherever Python collects what held it, often inside
            # another program's trace (Dynamo's fake tensors, a proxy mode): the copy must be of
            # the real memory, and no part of that trace.
            with _disable_current_modes():
                n = self._copy_out(live)
        else:
            n = self._copy_out(live)
        self.rescues += n
        return n

    def _copy_out(self, live: list[tuple[Any, Any, Sequence[weakref.ref]]]) -> int:
        n = 0
        for alias, static, refs in live:
            # Our own reference is one use; any other is a tensor (or view) of the caller's.
            if _use_count(alias) > 1:
                # The copy goes on the current stream, after the replay that wrote the values.
                if self._swap:
                    # The swap moves the memory under every tensor of the alias at once.
                    alias._swap_data_ptr_(static.clone())
                else:
                    self._move(alias, static.clone(), refs)
                n += 1
        return n

    def _move(self, alias: Any, copy: Any, refs: Sequence[weakref.ref]) -> None:
        """Re-points every tensor over ``alias`` at ``copy``: those handed out, then (when the
        caller derived others) every tensor the heap holds over it."""
        key = alias._cdata
        for ref in refs:
            t = ref()
            if t is not None and t.untyped_storage()._cdata == key:
                _repoint(t, copy)
        if _use_count(alias) == 1:
            return
        self.searches += 1
        found = 0
        for obj in gc.get_objects():
            if not issubclass(type(obj), torch.Tensor):
                continue
            try:
                over = obj.layout == torch.strided and obj.device == copy.device and obj.untyped_storage()._cdata == key
            except Exception:  # noqa: BLE001 - a subclass without a storage of its own is not over ours
                continue
            if over:
                _repoint(obj, copy)
                found += 1
        if self.copying is None:
            self.copying = "the caller kept a tensor derived from an output (a view) until the next replay"
            log.info("capturepass: this torch cannot move a held output's memory under its views (no "
                     "UntypedStorage._swap_data_ptr_): %d derived tensor(s) found on the heap and moved; "
                     "this capture's outputs are copied out from now on", found)
        if _use_count(alias) == 1:
            return
        if hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
            log.warning("capturepass: a replayed output is held where it cannot be moved (not a Python "
                        "tensor: autograd's saved tensors, C++); accessing it raises from now on")
            torch._C._set_storage_data_ptr_access_error_msg(
                alias._cdata, "capturepass: this tensor was an output of a CUDA graph replay, held outside Python's "
                       "heap when the graph replayed again, which writes its memory: it was expired rather "
                       "than read stale; clone an output that must outlive the next call")
            return
        raise RuntimeError(
            "capturepass: an output of the previous replay is held outside Python's heap (autograd's saved "
            "tensors, C++) and this torch can neither move its memory (no UntypedStorage._swap_data_ptr_) nor "
            "expire it; clone the output before the next call")

    def close(self) -> None:
        """Rescues what is still held, then lets go of the static storages.

        A close runs wherever its owner's release runs (a collector's finalizer, with any
        stream current): on a GPU the copies are fenced by synchronizing the device, so that
        they read what the last replay wrote on whichever stream it ran, and the caller's next
        use, on any stream, reads them complete. Not while the current stream captures (a
        release there is the caller's fault; the copies then go on the current stream).
        """
        devices = {st.device for st in self._static.values() if st.device.type == "cuda"} if self.num_live else ()
        fence = bool(devices) and not torch.cuda.is_current_stream_capturing()
        for device in devices if fence else ():
            torch.cuda.synchronize(device)
        self.rescue()
        for device in devices if fence else ():
            torch.cuda.synchronize(device)
        self._static.clear()


def _repoint(t: torch.Tensor, copy: Any) -> None:
    """``t`` over ``copy`` at its own offset, sizes and strides (an inference tensor is
    changed in inference mode, the only mode that may)."""
    with torch.inference_mode() if t.is_inference() else torch.no_grad():
        t.set_(copy, t.storage_offset(), t.size(), t.stride())
