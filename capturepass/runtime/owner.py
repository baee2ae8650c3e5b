"""GraphOwner: one per model instance and capture shape of a compiled graph; owns what its captures reference.

Owners are named after their graph's owner id, the one the dump prints
(``g3.m0.c0``: graph ``g3``, model instance 0, capture shape 0; see
``runtime.naming``); a name is unique among the open owners of the process.

An owner holds its lanes' streams, its event leases (one lane runtime per event
scope: eager, each capture), its CUDA graphs and their private memory pool, the
static buffers its graphs read and write, the storage owners its captures
retain, and the owner-bound resources bound to it: its workspaces and its
channels in every registered resource pool. ``close()`` (or garbage
collection) synchronizes its streams and releases all of it; a lease, a
workspace, a channel or a retained object is never valid for another owner.

On a machine without CUDA nothing is captured, but the bookkeeping runs as on a
GPU: when the graph's mode is a capturing one, a segment's first run stands for
its capture and retains the segment's storage owners until ``close()``.

A segment's own retention (the static inputs and constants it reads, listed by
``insert_retention``) keeps each tensor's *storage* (:class:`HeldStorage`), not
the tensor: a replay can never read freed memory, and yet the parameters do not
outlive their model, whose death releases the owner (``Executor`` watches them).
Objects a custom op passes to ``capturepass.retain`` are kept as they are.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from capturepass.errors import CapturePassError
from capturepass.ir.meta import ResourceBinding
from capturepass.runtime import capture, lifetime, pools
from capturepass.runtime.events import POOL
from capturepass.runtime.lanes import CudaLanes, HostLanes, Lanes
from capturepass.runtime.workspaces import Workspaces

log = logging.getLogger("capturepass")

_ids = itertools.count()
_live: "weakref.WeakSet[GraphOwner]" = weakref.WeakSet()
_lock = threading.Lock()
_warned_pool = False  # warm-ups outside the pool: said once

_HAS_RETAIN_OBJECT = hasattr(torch.cuda.CUDAGraph, "retain_object")

# The lane scope of a capture's warm-up: every lane on one stream (``GraphOwner.lanes``).
WARM_UP = "warm-up"
# The lane scope of uncaptured calls measured or chosen to run on one stream (``runtime.uncaptured``).
ONE_STREAM = "one-stream"


@dataclasses.dataclass(frozen=True, eq=False)
class HeldStorage:
    """The storage of a tensor a capture reads in place, held without the tensor itself.

    Attributes:
        storage: the tensor's untyped storage (keeps the memory at its address).
        kind: the tensor's type name (``"Parameter"``, ``"Tensor"``), for messages.
    """

    storage: Any
    kind: str

    def __repr__(self) -> str:
        return f"<storage of a {self.kind}: {self.storage.nbytes()} bytes at {self.storage.data_ptr():#x}>"


def hold(obj: Any) -> Any:
    """What an owner keeps for ``obj``: a strided tensor's storage, anything else itself."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
        return HeldStorage(obj.untyped_storage(), type(obj).__name__)
    return obj


def retained_kind(obj: Any) -> str:
    """A retained object's kind, for messages: the tensor type of a held storage, else the type."""
    return obj.kind if isinstance(obj, HeldStorage) else type(obj).__name__


class CaptureMemory:
    """What the capture owners of one model instance share on one device: one private memory
    pool for the graphs of all its capture shapes (and schedule candidates), one capture stream,
    and a side stream per lane role.

    As vLLM captures its batch sizes into one pool, a capture's temporaries reuse the memory
    another capture of the same model freed when its capture ended, so the memory held grows
    with the largest shape, not with the number of shapes. cuBLAS's workspace is cached per
    stream: side streams shared by role keep it to one per lane. This is safe because (1) the
    objects its captures retain stay alive while their graph lives, so no other capture is
    handed their memory, while outputs and static input buffers go back to the pool once
    captured (``Capture._let_go``: an output is written and read within one call, a buffer is
    written by the copy in at the start of every call), as vLLM keeps only weak references to
    its graphs' outputs, so that the memory held grows with the largest shape, not with the
    sum of all shapes' outputs; (2) the captures of one model never run at once:
    replays, warm-ups and captures hold :attr:`lock`, and a replay on another stream waits for
    the last one (:func:`order_after_last`); (3) a capture's outputs may lie in memory an *earlier*
    capture used for temporaries, which that capture's replays write again: outputs handed out
    as aliases are therefore rescued before a replay of *any* capture of the model
    (:attr:`held_outputs`), not only of their own; where outputs are copied out after each
    replay there is nothing to rescue. Captures of *another* model
    instance (a target and its draft) never share, so they may replay in either order or at once.

    Warm-ups run in the pool too while no graph lives there (:meth:`warms_up_in_pool`), on
    the capture stream (every lane of a warm-up runs there: ``GraphOwner.lanes``), so that
    their temporaries, autotuning buffers and workspace are blocks the captures then take; an
    empty keeper graph holds the pool open from the first warm-up on.

    The pool handle is renewed once no capture owner uses it any more (the keeper is dropped
    with it, and torch frees a pool whose graphs are all gone).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.RLock()
        self.capture_stream = torch.cuda.Stream(device)
        self._side: list[torch.cuda.Stream] = []
        self._pool: Any = None
        self._keeper: torch.cuda.CUDAGraph | None = None
        self._users = 0
        self._holders: "weakref.WeakSet[Any]" = weakref.WeakSet()  # owners whose graphs may be in the pool
        self.last_stream: Any = None  # the stream the last replay of one of its captures ran on
        self.last_raw: int | None = None  # its handle
        # Output aliases of its captures handed out since their last rescue
        # (``outputs.OutputAliases.group``): a replay of any capture of the model writes the
        # pool they share, so it rescues these first.
        self.held_outputs: list[Any] = []

    def side_streams(self, n: int) -> list[torch.cuda.Stream]:
        """The side streams of lanes 1..n (made on first use, then the same ones)."""
        with self.lock:
            while len(self._side) < n:
                self._side.append(torch.cuda.Stream(self.device))
            return self._side[:n]

    @property
    def streams(self) -> list[torch.cuda.Stream]:
        """The capture stream and every side stream made so far."""
        return [self.capture_stream, *self._side]

    def acquire_pool(self, owner: Any = None) -> Any:
        """The shared pool's handle, for one more owner's graphs (``owner``: the owner, whose
        ``graphs`` :meth:`warms_up_in_pool` looks at)."""
        with self.lock:
            if self._pool is None or self._users == 0:
                self._pool = torch.cuda.graph_pool_handle()
                if capture.POOL_WARM_UP_UNSUPPORTED is None:
                    self._keeper = capture.keep_pool(self._pool, self.capture_stream)
            self._users += 1
            if owner is not None:
                self._holders.add(owner)
            return self._pool

    def release_pool(self, owner: Any = None) -> bool:
        """One owner's graphs are gone; returns whether they were the pool's last (the pool is
        then torch's to free)."""
        with self.lock:
            self._users = max(0, self._users - 1)
            if owner is not None:
                self._holders.discard(owner)
            if self._users == 0 and self._pool is not None:
                self._keeper = self._pool = None
                return True
            return False

    def warms_up_in_pool(self) -> bool:
        """Whether a warm-up runs in the pool: only while no graph lives there.

        A capture's temporaries are free blocks of the pool, which its replays write again.
        A warm-up's temporaries may take them (nothing replays while it runs), but an
        allocation that outlives the warm-up (an op's cache made on its first call, as many
        kernels' workspaces and tables are) would be overwritten by those replays. So only the
        warm-ups before the model's first capture run in the pool (the measured choice warms
        every candidate of that shape up before it captures any); that is where autotuning,
        cuBLAS and first-call caches allocate. Later ones run on the caller's stream, outside
        any pool. Where torch cannot route a thread's allocations,
        none does (logged once).
        """
        if capture.POOL_WARM_UP_UNSUPPORTED is not None:
            global _warned_pool
            if not _warned_pool:
                _warned_pool = True
                log.info("capturepass: warm-ups run outside the capture's pool: %s", capture.POOL_WARM_UP_UNSUPPORTED)
            return False
        return not any(o.graphs for o in list(self._holders))

    def warm_up(self) -> Any:
        """The context a warm-up in the pool runs in (:meth:`warms_up_in_pool`; the pool
        acquired): on the capture stream, its allocations in the pool, after the last replay of
        the model's captures."""
        return capture.in_pool(self._pool, self.capture_stream, after=(self.last_stream,))

    @property
    def users(self) -> int:
        """Open capture owners that captured into the pool."""
        return self._users


# Capture memories shared by the graphs of one model (see :func:`capture_memory`).
_memories: "weakref.WeakValueDictionary[tuple, CaptureMemory]" = weakref.WeakValueDictionary()


def capture_memory(device: torch.device, scope: tuple | None) -> CaptureMemory:
    """The :class:`CaptureMemory` of the model ``scope`` names on ``device``, made on first use
    and shared while a graph uses it; a new one when ``scope`` is ``None``.

    Graphs that are one model's shapes (Dynamo's recompilations of one frame for another
    shape, run on the same parameters) name the same scope, so their captures share one pool
    and one set of streams, as all the shapes of one graph do.
    """
    if scope is None:
        return CaptureMemory(device)
    with _lock:
        mem = _memories.get((device, scope))
        if mem is None:
            mem = _memories[(device, scope)] = CaptureMemory(device)
        return mem


# The current stream's handle, without making a Stream object (what Inductor's code calls).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def order_after_last(tracker: Any, raw: int, current: Callable[[], Any]) -> None:
    """Orders a replay on the current stream (handle ``raw``; ``current()`` makes its Stream)
    after the last replay of ``tracker``'s captures (a :class:`CaptureMemory`, or an owner with
    memory of its own); call it holding their lock.

    The host lock serializes the launches only: a graph replayed on another stream than the last
    one (two micro-batches of one model on two streams, say) would run beside it on the GPU,
    writing the temporaries, static buffers and outputs they share. Waiting costs nothing when the
    stream is the same (stream order already holds), so it is done only on a change.
    """
    if raw == tracker.last_raw:
        return
    stream = current()
    if tracker.last_stream is not None:
        stream.wait_stream(tracker.last_stream)
    tracker.last_stream, tracker.last_raw = stream, raw


class GraphOwner:
    """Owns one model instance's (and capture shape's) streams, events, graphs and retained objects.

    Args:
        name: its name, unique among the open owners of the process (leases, channels and
            workspaces are keyed by it); the executor names its owners after the graph owner
            (``"g3.m0.c0"``, ``"g3.m0.eager"``: see ``runtime.naming``).
        num_lanes: lanes of the graph (lane 0 is the caller's stream).
        device: the CUDA device, or ``None`` for a host graph.
        captured: whether its segments are captured (CPU: simulated for bookkeeping).
        shared: the pool and streams it shares with the other capture owners of its model
            (``None``: its own).
        lane_map: the stream each lane runs on, by lane (``lane_map[i]``: ``0`` the caller's
            stream, ``k`` the ``k``-th side stream); ``None`` gives every lane its own. A
            schedule candidate derived from another's program runs that program with lanes
            merged onto fewer streams (``backends.candidates``): correct as it stands, since
            the program issues its kernels in a topological order and its waits stay.

    Attributes:
        name: its name, as given.
        retained: per segment, the objects its capture keeps alive.
        graphs: segment index -> captured CUDA graph.
        pool: the private memory pool of its graphs.
        capture_stream: the stream its segments were captured on (an engine that
            captures more graphs into ``pool`` should use it too).
        streams: the stream of each lane 1..n-1 (index ``i - 1`` is lane ``i``), or ``None`` for
            a lane its ``lane_map`` puts on the caller's stream.
        workspaces: its scratch storage, a slot per lane (locked while capturing).
        profiling: it belongs to a profiling capture and is released at its end.
        before_close: callables ``close()`` runs first (copying out held outputs).
        lock: held by its replays, warm-ups and captures (its model's, when shared).
    """

    def __init__(self, name: str, num_lanes: int, device: torch.device | None, captured: bool,
                 shared: CaptureMemory | None = None, lane_map: Sequence[int] | None = None) -> None:
        with _lock:
            # NOTE: leases, channels and workspaces are keyed by the name, and closing an owner
            # releases every lease of its name: two open owners of one name would share them.
            clash = next((o for o in _live if o.name == name and not o.closed), None)
            if clash is not None:
                raise CapturePassError(f"an open owner is named {name!r} already ({clash!r}); owner names must be "
                                       "unique among open owners")
            self.id = next(_ids)
            self.name = name
            self.closed = False
            _live.add(self)
        self.device = device if device is not None and device.type == "cuda" else None
        self.num_lanes = num_lanes
        self.captured = captured
        self.shared = shared if self.device is not None else None
        self.lock = self.shared.lock if self.shared is not None else threading.RLock()
        self.lane_map = tuple(lane_map) if lane_map is not None else tuple(range(max(num_lanes, 1)))
        if len(self.lane_map) != max(num_lanes, 1) or self.lane_map[0] != 0 \
                or any(not 0 <= k < len(self.lane_map) for k in self.lane_map):
            raise CapturePassError(f"owner {name}: lane map {list(self.lane_map)} does not map {num_lanes} lane(s) "
                                   f"each to a stream 0..{max(num_lanes, 1) - 1}, with lane 0 on the caller's stream")
        side = max(self.lane_map)
        if self.device is None:
            sides: list[torch.cuda.Stream] = []
        elif self.shared is not None:
            sides = self.shared.side_streams(side)
        else:
            sides = [torch.cuda.Stream(self.device) for _ in range(side)]
        self.streams: list[torch.cuda.Stream | None] = (
            [sides[k - 1] if k else None for k in self.lane_map[1:]] if self.device is not None else [])
        self._holds_pool = False
        self.last_stream: Any = None  # see order_after_last (when it has memory of its own)
        self.last_raw: int | None = None
        self._scopes: dict[str, Lanes] = {}
        self.retained: dict[int, list[Any]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.capture_stream: torch.cuda.Stream | None = None
        self.static: dict[str, Any] = {}
        self.capturing: int | None = None
        self._resources: dict[ResourceBinding, int] = {}
        self.workspaces = Workspaces(
            self.name, max(num_lanes, 1), device=self.device if self.device is not None else device or "cpu"
        )
        self.profiling = False
        # Called first by close(), while the pool and buffers still hold their values: the
        # replayed outputs a caller still holds are copied out of them there.
        self.before_close: list[Any] = []

    # -- lanes and events ---------------------------------------------------------------------
    def lanes(self, scope: str = "eager") -> Lanes:
        """The lane runtime of ``scope`` (``"eager"``, ``"capture:<n>"``, ``"outer"``,
        :data:`WARM_UP`, :data:`ONE_STREAM`), made on first use."""
        lanes = self._scopes.get(scope)
        if lanes is None:
            if self.device is None:
                lanes = HostLanes(self.num_lanes)
            elif scope in (WARM_UP, ONE_STREAM):
                # Every lane on the caller's stream (an uncaptured call on one stream: no switch,
                # no cross-stream wait). For a warm-up: its matrix products use that
                # stream's cuBLAS workspace alone and Triton tunes its kernels (a flush buffer
                # the size of L2 per benchmark) beside that one, not beside a workspace per side
                # stream. The capture then allocates the side streams' workspaces in the pool,
                # as it does anyway (it clears cuBLAS's cache first). The program issues its
                # kernels in a topological order, so one stream runs them correctly.
                lanes = CudaLanes([None] * len(self.streams), self.name, scope)
            else:
                lanes = CudaLanes(self.streams, self.name, scope)
            self._scopes[scope] = lanes
        return lanes

    @property
    def num_leases(self) -> int:
        """How many event leases this owner holds over all scopes."""
        return sum(lanes.num_events for lanes in self._scopes.values())

    def lane_of_stream(self, stream: Any) -> int:
        """The lane a stream is, for this owner (0 when it is not one of the owner's streams)."""
        for i, s in enumerate(self.streams):
            if s is not None and s == stream:
                return i + 1
        return 0

    @property
    def side_streams(self) -> list[torch.cuda.Stream]:
        """Its lanes' streams other than the caller's, each once."""
        out: list[torch.cuda.Stream] = []
        for s in self.streams:
            if s is not None and all(s != o for o in out):
                out.append(s)
        return out

    # -- retention and resources ----------------------------------------------------------------
    def retain(self, segment: int, resources: tuple[int, ...], *objs: Any) -> None:
        """Keeps ``objs`` alive as long as ``segment``'s capture (called at capture time)."""
        if not self.captured:
            return
        if self.device is not None and self.capturing not in (segment, -1):
            return  # replays and eager runs retain nothing new; -1 is a capture around us
        if segment in self.retained and self.device is None:
            return  # host: the first run stood for the capture
        self.keep(segment, [hold(o) for o in objs] + [self._resource_obj(h) for h in resources])

    def keep(self, segment: int, objs: list[Any]) -> None:
        """Ties ``objs`` to the capture of ``segment`` (``CUDAGraph.retain_object`` where torch has it)."""
        self.retained.setdefault(segment, []).extend(objs)
        graph = self.graphs.get(segment)
        if _HAS_RETAIN_OBJECT and graph is not None:
            for obj in objs:
                graph.retain_object(obj)

    def resource_handle(self, binding: ResourceBinding) -> int:
        """The integer handle of an owner-bound resource."""
        return self._resources.setdefault(binding, len(self._resources))

    def _resource_obj(self, handle: int) -> Any:
        for binding, h in self._resources.items():
            if h == handle:
                return binding
        return handle

    @property
    def num_retained(self) -> int:
        """How many objects this owner's captures retain."""
        return sum(len(v) for v in self.retained.values())

    def order_replay(self) -> None:
        """Orders a replay on the current stream after the last replay that shares its memory
        (:func:`order_after_last`); call it holding :attr:`lock`."""
        device = self.device
        assert device is not None
        current = lambda: torch.cuda.current_stream(device)  # noqa: E731
        if _raw_stream is not None:
            raw = _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
        else:
            raw = current().cuda_stream
        order_after_last(self.shared if self.shared is not None else self, raw, current)

    def begin_capture(self) -> torch.cuda.Stream:
        """Sets :attr:`pool` (its model's shared pool, or a pool of its own) and
        :attr:`capture_stream`; returns the capture stream."""
        if self.pool is None:
            if self.shared is not None:
                self.pool = self.shared.acquire_pool(self)
                self._holds_pool = True
            else:
                self.pool = torch.cuda.graph_pool_handle()
        if self.capture_stream is None:
            self.capture_stream = (self.shared.capture_stream if self.shared is not None
                                   else torch.cuda.Stream(self.device))
        return self.capture_stream

    # -- teardown ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Waits for every lane of this owner."""
        if self.device is not None:
            for s in self.side_streams:
                s.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Synchronizes, then releases graphs, pool, static buffers, leases, retained objects,
        workspaces and channels."""
        if self.closed:
            return
        self.closed = True
        try:
            hooks, self.before_close = self.before_close, []
            for hook in hooks:
                hook()
            self.synchronize()
        finally:
            for lanes in self._scopes.values():
                lanes.close()
            self._scopes.clear()
            POOL.release_owner(self.name)
            had_graphs = bool(self.graphs)
            self.graphs.clear()
            self.static.clear()
            self.retained.clear()
            self._resources.clear()
            self.workspaces.release()
            pools.release_owner(self.name)
            pool_gone = self._holds_pool and self.shared is not None and self.shared.release_pool(self)
            self._holds_pool = False
            self.pool = None
            self.capture_stream = None
            self.streams = []
            if (had_graphs or self.device is not None and self.num_lanes > 1) and lifetime.release_allowed():
                # cuBLAS caches a workspace per (handle, stream); the one our capture
                # allocated lives in our pool and would pin it past close, and those of our
                # auxiliary streams outlive the streams' use. Dropping the cache is what
                # every capture does before capturing (as cudagraph trees do). Not while a
                # capture is in progress (on any thread of ours, or this thread's stream): the
                # cache is the process's, and that capture's workspace would be freed under it.
                capture.clear_cublas_workspaces()
            if pool_gone and lifetime.release_allowed():
                # NOTE: a pool whose last graph is gone is only freed at the allocator's next
                # cache release (an out-of-memory retry, or empty_cache): until then its memory
                # stays reserved, to this process alone. A process that captured and released
                # grew by a pool per cycle (the soak on the H200: 100 MiB per cycle, to 128 GiB,
                # when the other processes on the device ran out of memory).
                torch.cuda.empty_cache()

    def __del__(self) -> None:
        try:
            if not self.closed:
                lifetime.defer(self.close)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.graphs)} graph(s), {self.num_retained} retained"
        return f"<GraphOwner {self.name}: {state}>"


def live_owners() -> list[GraphOwner]:
    """Every owner not yet collected (open or closed)."""
    return list(_live)
