"""Capturing a segment without surprises: the capture mode, failures that end cleanly, probes.

- Every capture runs in the *thread-local* capture mode where torch offers it
  (``capture_error_mode="thread_local"``, feature-detected). In torch's default
  global mode a potentially unsafe CUDA call from *any* thread during the
  capture (an allocation, a synchronization of its own work) fails and
  invalidates the capture (``cudaErrorStreamCaptureUnsupported``); in the
  thread-local mode other threads' eager work neither breaks the capture nor is
  broken by it, while this thread's unsafe calls still fail.
- A capture that fails (an op raised, or the capture was invalidated) is ended
  and discarded by :func:`segment`, with every auxiliary lane joined first:
  ending a capture while a lane is still forked fails with
  ``cudaErrorStreamCaptureUnjoined`` and hides the op's own error, which is
  re-raised instead. When the end itself fails (the capture was invalidated),
  torch's ``CUDAGraph.capture_end`` raises at ``cudaStreamEndCapture``, before it
  stops routing the capture stream's allocations to the pool and before the CUDA
  generator leaves capture mode: torch 2.11's generator state keeps a
  ``capturing_`` flag that only ``capture_epilogue`` clears, and every later
  ``torch.randn`` on the device then fails with "Offset increment outside graph
  capture". :func:`_discard_failed` ends the routing, releases the pool's
  reference (once: where the end failed later, at instantiation, torch counts
  the capture as ended and its ``reset`` releases the reference itself) and
  walks the generator through one trivial capture, whose prologue
  and epilogue put it back (newer torch keys capture state by capture id and
  drops it in ``CUDAGraph.reset``; the trivial capture is then harmless).
- :func:`first_failing_node` probes a segment whose capture failed: it runs the
  segment's region graphs node by node, eagerly, and captures each node alone
  in a throwaway capture; the first node that fails is the culprit. Opaque
  custom ops (namespaces other than aten and prims, and the wrappers of
  functionalized custom ops) are probed first, then every other node with a
  kernel.
- :func:`in_pool` runs a capture's warm-up on the capture stream with every allocation of
  the thread (on any lane's stream) taken from the capture's pool, as cudagraph trees warm
  up: the warm-up's temporaries, cuBLAS workspaces and autotuning buffers land in the blocks
  the capture then reuses (the same streams, the same pool), instead of each side stream's
  own cache outside any pool, where they stay reserved for nothing. :func:`keep_pool` holds
  a pool open before its first graph exists (torch asserts on a pool re-entered after its
  last user left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from capturepass.ir.capabilities import op_of
from capturepass.ir import analysis
from capturepass.ir.plan import StepKind
from capturepass.runtime import inline as _registers_inline_step  # noqa: F401  (the op the probe passes over)
from capturepass.runtime import files

if TYPE_CHECKING:
    from capturepass.runtime.program import Program, RegionSpec

log = logging.getLogger("capturepass")


def _mode_kwargs() -> dict[str, str]:
    try:
        params = inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return {}
    return {"capture_error_mode": "thread_local"} if "capture_error_mode" in params else {}


MODE_KWARGS = _mode_kwargs()


def _capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


# Routes every allocation of the calling thread, whatever the stream, to a pool (torch's
# ``use_mem_pool`` and cudagraph trees' warm-ups use it).
def _cuda_function(name: str) -> Any:
    fn = getattr(torch._C, name, None)
    # A build without CUDA fills these names with placeholder classes (torch/cuda/memory.py).
    return None if fn is None or isinstance(fn, type) else fn


_route_thread = _cuda_function("_cuda_beginAllocateCurrentThreadToPool")
_end_route = _cuda_function("_cuda_endAllocateToPool")
_release_pool = _cuda_function("_cuda_releasePool")
# Why warm-ups cannot run in their capture's pool here (``None``: they can).
POOL_WARM_UP_UNSUPPORTED: str | None = (
    None if _route_thread is not None and _end_route is not None and _release_pool is not None
    else "this torch cannot route a thread's allocations to a pool (no _cuda_beginAllocateCurrentThreadToPool)"
)


def keep_pool(pool: Any, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """An empty graph captured into ``pool``: while it lives, the pool exists and may be
    entered (a pool whose last user left is only freed at the allocator's next cache release,
    and torch refuses to enter it before that)."""
    keeper = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is meant to be
        with torch.cuda.stream(stream):
            keeper.capture_begin(pool=pool, **MODE_KWARGS)
            keeper.capture_end()
    return keeper


@contextlib.contextmanager
def in_pool(pool: Any, stream: torch.cuda.Stream, after: Sequence[Any] = ()) -> Iterator[None]:
    """Runs the block on ``stream`` with this thread's allocations taken from ``pool``.

    The pool must be open (a graph or :func:`keep_pool` holds it). ``stream`` first waits
    for the current stream (the block reads the caller's tensors) and for each stream of
    ``after`` (the last replay of graphs sharing the pool, whose temporaries the block's
    allocations may reuse); the current stream waits for ``stream`` at the end.

    Tensors the block allocates and that outlive it stay in the pool, which is the graphs'
    memory: the caller copies out what it hands on.
    """
    assert POOL_WARM_UP_UNSUPPORTED is None, POOL_WARM_UP_UNSUPPORTED
    device = stream.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    for s in after:
        if s is not None:
            stream.wait_stream(s)
    try:
        with torch.cuda.stream(stream):
            _route_thread(index, pool)
            try:
                yield
            finally:
                _end_route(index, pool)
                _release_pool(index, pool)
    finally:
        current.wait_stream(stream)


def clear_cublas_workspaces() -> None:
    """Drops cuBLAS's cached workspaces (one per handle and stream)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# A capture on several streams divides the process's cuBLAS workspace among them, but gives no
# stream less than this (or the whole size, where that is smaller): 8 MiB per stream made no
# schedule candidate slower on an H200 (BENCHMARKS.md, the twenty-ninth run).
MIN_SPLIT_WORKSPACE = 8 << 20


UNDIVIDED = ("capturepass: this torch cannot set the cuBLAS workspace size at run time "
             "(torch.backends.cuda.cublas_workspace_size), so each stream of a capture on several "
             "streams holds a whole workspace (by default 32 MiB on Hopper GPUs); "
             "CUBLAS_WORKSPACE_CONFIG=:4096:2, set before the process starts, gives every stream 8 MiB")
"""What the first capture on several streams logs where torch cannot divide the workspace."""


def workspace_size_setter() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """torch's run-time cuBLAS workspace size (get, set), where it has one (2.13 has, 2.11 not);
    ``None`` elsewhere.

    torch 2.11 reads ``CUBLAS_WORKSPACE_CONFIG`` at each workspace it allocates, but its cache
    keeps no size: a workspace allocated while the variable was small is handed to cuBLAS at the
    size the variable says later (measured on an H100: 8 MiB allocated, then given as 32 MiB
    once the variable said 32 MiB, without a new allocation). Set around a capture, the
    variable would let a matrix product another thread runs between the restore and the
    cache's clear write past its workspace, so capturepass never sets it; with the API, torch
    2.13 records each workspace's size and allocates a larger one when the size grows.
    """
    get = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)
    put = getattr(torch._C, "_cuda_setCublasWorkspaceSize", None)
    return None if get is None or put is None else (get, put)


@contextlib.contextmanager
def split_cublas_workspace(streams: int) -> Iterator[int | None]:
    """While a capture runs matrix products on ``streams`` streams, each stream's cuBLAS workspace
    is the process's size divided among them (at least :data:`MIN_SPLIT_WORKSPACE`); yields the
    size each gets, or ``None`` where nothing is divided (one stream, or a torch without
    :func:`workspace_size_setter`: there every stream's capture holds a whole workspace, and the
    first such capture of the process logs why, unless ``CUBLAS_WORKSPACE_CONFIG`` chose the size).

    cuBLAS keeps one workspace per handle and stream, and two streams cannot share one while
    their kernels may run at once; a captured graph keeps the workspace it was captured with
    and writes it at every replay. A capture on three streams thus held three 32 MiB workspaces
    on an H100 or H200 where one lane's held one. Divided, they hold what one lane's does: a
    smaller workspace only narrows the algorithms cuBLAS may pick, and the measured choice
    times the candidates with the workspaces they will replay with. The size is set back
    afterwards; the caller clears cuBLAS's workspace cache before and after (so that the
    capture allocates its own, and the next eager product takes the process's size again), and
    holds :func:`exclusive`, since the size is the process's.
    """
    api = workspace_size_setter() if streams > 1 else None
    if api is None:
        if streams > 1 and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            files.warn_once("undivided-workspace", UNDIVIDED, level=logging.INFO)
        yield None
        return
    get, put = api
    whole = int(get())
    share = max(whole // streams, min(whole, MIN_SPLIT_WORKSPACE))
    if share >= whole:
        yield None
        return
    share -= share % (1 << 20)  # whole MiB: 32 MiB over three streams is 10 MiB each
    put(share)
    try:
        yield share
    finally:
        put(whole)


_exclusive = threading.RLock()


def exclusive() -> threading.RLock:
    """The lock that serializes capturepass's captures (and probes) across the threads of the process.

    A capture clears cuBLAS's workspace cache before and after it, so that its graphs allocate
    workspaces of their own in their pool and the next warm-up does not peak beside them. The
    cache is the process's: a clear while another thread captures frees that capture's
    workspace into its pool mid-capture, where its next allocation may take the block while
    the graph's matrix products still use it. Two models captured on two threads (a target and
    its draft) therefore take turns; a release that would clear the cache waits for no capture
    (``GraphOwner.close`` skips the clear while one of ours is in progress).
    """
    return _exclusive


@contextlib.contextmanager
def segment(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream,
            forked: Sequence[torch.cuda.Stream] = ()) -> Iterator[None]:
    """Captures the block into ``graph`` on ``stream``, in the thread-local capture mode.

    Args:
        graph: a fresh CUDA graph.
        pool: the memory pool handle to capture into.
        stream: the capture stream (made current inside the block).
        forked: streams the block may fork from the capture (joined before a failed
            capture is ended).

    On an exception in the block the capture is ended and discarded (the graph is
    reset, the pool reference released, the generator and allocator restored) and
    the exception propagates. If ending a capture that raised nothing fails, the
    same clean-up runs and torch's error propagates.
    """
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, **MODE_KWARGS)
        try:
            yield
        except BaseException:
            _abort(graph, pool, stream, forked)
            raise
        try:
            graph.capture_end()
        except Exception:
            _discard_failed(graph, pool, stream.device)
            raise


def _abort(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream,
           forked: Sequence[torch.cuda.Stream]) -> None:
    for s in forked:
        try:
            if _capturing(s):
                event = torch.cuda.Event()
                event.record(s)
                stream.wait_event(event)
        except Exception:  # noqa: BLE001 - an invalidated capture refuses joins; ending it tears forks down
            pass
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - invalidated: the capture ended all the same
        _discard_failed(graph, pool, stream.device)
    else:
        graph.reset()


def _discard_failed(graph: torch.cuda.CUDAGraph, pool: Any, device: torch.device) -> None:
    """Cleans up after ``capture_end`` raised (see the module doc).

    NOTE: ``capture_end`` can fail on either side of the point where the graph counts as
    captured. Before it (``cudaStreamEndCapture`` refused an invalidated capture) the
    allocator still routes to the pool and the pool's reference is the capture's to give
    back. After it (``cudaGraphInstantiate`` failed) the routing has ended, and ``reset``
    gives the reference back itself: a second release would let the allocator free a pool
    that the model's other graphs still replay from (``releasePool`` counts users, and
    frees at zero on the next cache release).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    ended = _capture_ended(graph)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if not ended and end is not None and pool is not None:
        try:
            end(index, pool)
        except Exception:  # noqa: BLE001 - this torch stopped the routing before it failed
            pass
    try:
        graph.reset()
    except Exception:  # noqa: BLE001
        pass
    release = getattr(torch._C, "_cuda_releasePool", None)
    if not ended and release is not None and pool is not None:
        try:
            release(index, pool)
        except Exception:  # noqa: BLE001 - the pool was already released
            pass
    try:
        _restore_generator(device)
    except Exception as exc:  # noqa: BLE001
        log.error("capturepass: could not take the CUDA generator of %s out of capture mode after a failed "
                  "capture (%s: %s); random ops on it may fail", device, type(exc).__name__, exc)


def _capture_ended(graph: torch.cuda.CUDAGraph) -> bool:
    """Whether torch counts ``graph``'s capture as ended (its pool reference then goes back
    with ``reset``): ``CUDAGraph.pool`` answers only then."""
    try:
        graph.pool()
    except Exception:  # noqa: BLE001 - "without a preceding successful capture"
        return False
    return True


def _restore_generator(device: torch.device) -> None:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(**MODE_KWARGS)
        try:
            torch.zeros(1, device=device)  # one kernel: an empty capture only warns
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph.reset()


def fails_alone(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                device: torch.device) -> BaseException | None:
    """The error ``fn(*args, **kwargs)`` raises when captured alone in a throwaway capture, or ``None``."""
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA Graph is empty" for ops without a kernel
            with segment(graph, pool, stream):
                fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the probe's answer
        return exc
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
    graph.reset()
    return None


@dataclasses.dataclass(frozen=True)
class Culprit:
    """The node a probe found failing under capture.

    Attributes:
        node: its name in the annotated graph.
        op: its op's qualified name (the op a functionalization wrapper wraps), or
            the target's name for a plain callable.
        opaque: whether it is an opaque custom op (learned per op, not per node).
        error: what it raised under capture.
    """

    node: str
    op: str
    opaque: bool
    error: BaseException

    @property
    def reason(self) -> str:
        """The break reason shown in dumps and logs."""
        first = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return f"{self.op} failed under CUDA graph capture ({type(self.error).__name__}: {first[:200]})"


def is_opaque(node: fx.Node) -> bool:
    """Whether ``node`` calls an opaque custom op (or a wrapper of one, or a plain callable)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in ("aten", "prims")
    return True


def op_name(node: fx.Node) -> str:
    """The qualified op name of ``node`` (its wrapped op for a functionalization wrapper)."""
    op = op_of(node)
    if op is not None:
        return op._schema.name
    return getattr(node.target, "__name__", str(node.target))


def _has_kernel(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return is_opaque(node) or (analysis.aliases_input(node) is None and analysis.carries_tensor(node))


def first_failing_node(program: "Program", index: int, env: dict[fx.Node, Any],
                       device: torch.device) -> Culprit | None:
    """Probes piece ``index`` of ``program`` node by node; the first node that fails captured alone.

    Args:
        program: the program whose capture failed.
        index: the failing piece.
        env: values of every annotated-graph node the piece reads (from the warm-up; the
            caller substitutes copies for inputs the graph writes, since each node runs
            eagerly here once).
        device: the CUDA device.

    Returns:
        the culprit, or ``None`` when every node captures alone (or the eager run of the
        piece itself fails here, which leaves the probe without an answer).
    """
    specs = [s.payload for s in program.pieces[index].steps if s.kind == StepKind.REGION]
    with exclusive():
        return _first_failing(specs, program, index, env, device)


def _first_failing(specs: list["RegionSpec"], program: "Program", index: int, env: dict[fx.Node, Any],
                   device: torch.device) -> Culprit | None:
    try:
        for opaque in (True, False):
            try:
                found = _probe(specs, env, device, opaque)
            except Exception as exc:  # noqa: BLE001 - the probe is inconclusive, not the call
                log.info("capturepass: probing piece %d of the %s failed eagerly (%s: %s)", index,
                         program.info.title, type(exc).__name__, exc)
                return None
            if found is not None:
                return found
        return None
    finally:
        clear_cublas_workspaces()  # probes made workspaces inside throwaway pools


_INLINE_STEP = torch.ops.capturepass.inline_step.default


def _probe(specs: list["RegionSpec"], env: dict[fx.Node, Any], device: torch.device, opaque: bool) -> Culprit | None:
    values = dict(env)
    for spec in specs:
        local: dict[fx.Node, Any] = {}
        inputs = iter(spec.inputs)
        outs: Any = ()
        for node in spec.graph.graph.nodes:
            if node.op == "placeholder":
                local[node] = values[next(inputs)]
            elif node.op == "get_attr":
                obj: Any = spec.graph
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                local[node] = obj
            elif node.op == "output":
                outs = fx.node.map_arg(node.args[0], local.__getitem__)
            elif node.target is _INLINE_STEP:
                # A fused segment's sync point: the probe runs every node on one stream, in
                # order, and finds the op that fails alone; the lanes play no part in that.
                local[node] = None
            else:
                args = fx.node.map_arg(node.args, local.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, local.__getitem__)
                result = node.target(*args, **kwargs)
                if _has_kernel(node) and is_opaque(node) == opaque:
                    error = fails_alone(node.target, args, kwargs, device)
                    if error is not None:
                        return Culprit(node.name, op_name(node), is_opaque(node), error)
                local[node] = result
        for node, value in zip(spec.outputs, outs):
            values[node] = value
    return None
