"""Owners die with their model.

Dynamo keeps a compiled callable (its ``Executor``) in the code cache of the
module class's ``forward`` until ``torch._dynamo.reset()``, which drops every
other model's compiled code too. The owners inside it are per model *instance*
(the addresses of the static inputs, its parameters and buffers), so they can
go with the instance:

- the owners keep the *storage* of what their captures read in place
  (``owner.HeldStorage``), never the parameter objects, so a replay can never
  read freed memory and the model can still be collected;
- the executor watches the static input tensors of every instance it serves
  (``weakref.finalize``); when one of them is collected, the owners of that
  instance are released (graphs, pools, leases, workspaces, channels, retained
  objects). A release synchronizes the owner's streams, which is not allowed
  while a capture is in progress on this thread (or, for captures capturepass
  makes, on any thread): it is then deferred to the next call of a compiled
  graph, or to the end of the capture;
- :func:`release` releases one model's owners explicitly (engines call it when
  they drop a model);
- a capture made on a caller's own tensor (an input captured in place, such as a
  KV cache) is released when that tensor's *storage* dies (``watch_capture``):
  the storage, not the tensor object, since a caller may pass a new view of the
  same buffer at every call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from capturepass.errors import CapturePassError

if TYPE_CHECKING:
    from capturepass.runtime.executor import Executor

log = logging.getLogger("capturepass")
_executors: "weakref.WeakSet[Executor]" = weakref.WeakSet()
_lock = threading.Lock()
_capturing = 0
# (executor, instance) pairs whose model died while a release was not allowed; the instance
# is a ``CaptureDied`` where one capture's in-place input died.
PENDING: list[tuple["weakref.ref[Executor]", Any]] = []
# The closes of compiled graphs and owners that were collected while a release was not
# allowed; each keeps its object alive until the next drain.
DEFERRED: list[Callable[[], None]] = []


class CaptureDied:
    """The storage of an input one capture was made on died: that capture goes.

    Args:
        key: the capture's key in its executor.
        capture: a weak reference to the capture (a later capture under the same key stays).
    """

    __slots__ = ("key", "capture")

    def __init__(self, key: tuple, capture: "weakref.ref[Any]") -> None:
        self.key = key
        self.capture = capture


def register(executor: "Executor") -> None:
    """Makes ``executor`` findable by :func:`release`."""
    with _lock:
        _executors.add(executor)


def live_executors() -> list["Executor"]:
    """Every executor not yet collected."""
    with _lock:
        return list(_executors)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks a capture in progress: releases wait until it ends."""
    global _capturing
    with _lock:
        _capturing += 1
    try:
        yield
    finally:
        with _lock:
            _capturing -= 1
        if PENDING or DEFERRED:
            drain()


def release_allowed() -> bool:
    """Whether memory may be released now: no capture of ours is in progress, the current
    stream is not capturing (a free inside a capture would invalidate it), and no dispatch mode
    is active but those that run the ops of a real call (:func:`tracing_modes_active`).

    A model dies wherever Python's collector runs, often while Dynamo traces another model
    under fake tensors: a release there would copy held outputs out as fake tensors (or into
    that trace), then free the memory under them. Its release waits for the next call of a
    compiled graph.
    """
    if _capturing:
        return False
    if tracing_modes_active():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


@functools.cache
def _real_tensor_modes() -> tuple[type, ...]:
    """Dispatch modes that run every op on real tensors and leave memory to the allocator.

    AOT autograd runs the first call of each compiled function (capturepass's warm-up and
    capture of its first shape among them) under a mode that checks whether custom ops alias
    their inputs (``_AnalyzeCustomOpInputOutputMode``, where this torch has it): the call's own
    ops, on its real tensors. A release there is a release between two ops of that call.
    """
    try:
        import torch._dynamo  # noqa: F401  (runtime_wrappers imports it back: first, to import at all)
        from torch._functorch._aot_autograd import runtime_wrappers
    except ImportError:
        return ()
    mode = getattr(runtime_wrappers, "_AnalyzeCustomOpInputOutputMode", None)
    return (mode,) if isinstance(mode, type) else ()


def tracing_modes_active() -> bool:
    """Whether a dispatch mode is active that may not run on this process's real memory:
    Dynamo's fake tensors, a proxy or functionalization mode, or a mode of the caller's; any
    mode but those of :func:`_real_tensor_modes`."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    # The stack lists the infra modes (fake, proxy, functional) too.
    return not all(isinstance(m, _real_tensor_modes()) for m in _get_current_dispatch_mode_stack())


def watch(executor: "Executor", instance: tuple, tensors: list[torch.Tensor]) -> list[weakref.finalize]:
    """Finalizers that release ``executor``'s owners of ``instance`` when any of ``tensors`` dies."""
    ref = weakref.ref(executor)
    finalizers = [weakref.finalize(t, _died, ref, instance) for t in tensors]
    for f in finalizers:
        f.atexit = False  # at interpreter exit there is nothing to release into
    return finalizers


def watch_capture(executor: "Executor", key: tuple, capture: Any, storages: list[Any]) -> list[weakref.finalize]:
    """Finalizers that release ``executor``'s capture under ``key`` when any of ``storages`` dies.

    Storages are watched through their Python object, which torch keeps alive as long as
    the storage itself (PyObject preservation); where it does not, nothing is watched
    (logged once), and the capture goes with its model or by ``max_captures``. Either way
    a replay writes only the tensor of the call: the address is part of the key.
    """
    if not _storages_preserved():
        return []
    ref = weakref.ref(executor)
    died = CaptureDied(key, weakref.ref(capture))
    finalizers = []
    for storage in storages:
        f = weakref.finalize(storage, _died, ref, died)
        f.atexit = False
        finalizers.append(f)
    return finalizers


_preserved: bool | None = None


def _storages_preserved() -> bool:
    """Whether a storage's Python object lives as long as the storage (else a finalizer on it
    would fire as soon as our own reference goes, not when the memory does)."""
    global _preserved
    if _preserved is None:
        t = torch.empty(1)
        try:
            r = weakref.ref(t.untyped_storage())
        except TypeError as exc:
            reason = f"storages take no weak reference ({exc})"
            _preserved = False
        else:
            _preserved = r() is not None
            reason = "a storage's Python object does not live as long as the storage"
        if not _preserved:
            log.info("capturepass: inputs captured in place are not watched: %s; their captures go with "
                     "their model or by max_captures", reason)
    return _preserved


def _died(ref: "weakref.ref[Executor]", instance: Any) -> None:
    # No lock: the collector runs this at any allocation, also inside code that would hold
    # one. A list's append and pop are atomic.
    PENDING.append((ref, instance))
    if release_allowed():
        drain()


def defer(close: Callable[[], None]) -> None:
    """Runs ``close`` (a collected object's release, from its ``__del__``) now if a release is
    allowed, else at the next drain: an object dies wherever its last reference goes, also
    inside a capture, where a release would synchronize (invalidating the capture) and free
    memory the capture may be using."""
    if release_allowed():
        close()
    else:
        DEFERRED.append(close)


def _take(items: list) -> Iterator[Any]:
    """Pops ``items`` from the front until it is empty, without a lock (a list's pop is atomic):
    what a collection adds meanwhile, even inside the caller's loop, is taken too."""
    while True:
        try:
            yield items.pop(0)
        except IndexError:
            return


def drain() -> None:
    """Releases the owners of every instance that died, and the compiled graphs and owners
    collected meanwhile (when a release is allowed)."""
    if not release_allowed():
        return
    for close in _take(DEFERRED):
        try:
            close()
        except Exception:  # noqa: BLE001 - one object's release must not keep the others
            log.warning("capturepass: a deferred release failed", exc_info=True)
    keep = []
    for ref, instance in _take(PENDING):
        executor = ref()
        if executor is None:
            continue
        if isinstance(instance, CaptureDied):
            done = executor.release_capture(instance.key, instance.capture(), "an input it was made on was collected")
        else:
            done = executor.release_instance(instance, "its model was collected")
        if not done:
            keep.append((ref, instance))  # the executor is busy (capturing): next time
    PENDING.extend(keep)


def _static_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in itertools.chain(module.parameters(), module.buffers()) if t.layout == torch.strided]


def release(obj: Any) -> int:
    """Releases every owner capturepass holds for a model: its graphs, pools, leases, workspaces,
    channels and retained objects, in every compiled graph of the process; then the model's
    communicators (process groups), after every graph that captured on them.

    With collectives, every rank calls this for the model at the same point of its program:
    destroying an NCCL communicator is collective. Call it before
    ``torch.distributed.destroy_process_group()``, which NCCL makes wait for every CUDA graph
    that captured on a communicator.

    Args:
        obj: the model (an ``nn.Module``), or what ``torch.compile`` returned for it.

    Returns:
        how many owners were released. The compiled callable stays usable: a later
        call with the model captures again.

    Raises:
        CapturePassError: ``obj`` is not a module nor a compiled module.
    """
    module = getattr(obj, "_orig_mod", obj)
    if not isinstance(module, torch.nn.Module):
        raise CapturePassError(
            f"capturepass.release takes a model (torch.nn.Module) or the module torch.compile returned, "
            f"got {type(obj).__name__}"
        )
    from capturepass.runtime import comms, naming

    addresses = {t.data_ptr() for t in _static_tensors(module)} - {0}
    closed: list[tuple[str, str]] = []
    for executor in live_executors():
        closed += executor.release_addresses(addresses)
    # Every rank calls this at the same point of its program, but holds its executors in an
    # order of its own; tearing an NCCL communicator down is collective, so the models'
    # communicators go after every owner (and so every CUDA graph that captured on them),
    # in the order of their names: the same on every rank.
    for model in sorted({m for m, _ in closed if m != "?"}, key=naming.model_order):
        comms.release_model(model, in_step=True)
    return len(closed)
