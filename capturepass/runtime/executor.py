"""The compiled callable: runs a program eagerly, or captures and replays it.

Modes, per graph:

- host graph, or ``cudagraphs="none"``: the program runs eagerly, its lanes on
  the owner's streams (CUDA) or in program order (host);
- ``monolithic`` / ``breakable`` on CUDA: one :class:`GraphOwner` per model
  instance and input shape (an instance is the set of addresses of the static
  inputs: Dynamo serves every instance of a module class with one compiled
  graph, and a target and a draft model must still never share an owner).
  The first call with a shape warms the program up on a side stream,
  clears cuBLAS's workspaces (so that the graphs allocate and own theirs: a
  graph that recorded a workspace it did not own is corrupted when the
  workspace is freed), and captures every segment into its own CUDA graph, all
  in one private pool on one capture stream; breaks run eagerly between
  segments. Calls then copy new input values into the static input buffers and
  replay. A new shape gets a new owner, up to ``max_captures``; beyond it the
  program runs uncaptured, and says so once.
- called while a capture that capturepass did not start is in progress (an
  engine capturing around the model): the program runs without starting its
  own capture, forking from and joining to the capturing stream, with events of
  a scope reserved for outer captures.

While an owner captures, its workspaces and every engine workspace manager
made with ``lock_on_capture=True`` are locked (a request that would grow one
raises), and every registered resource pool is entered for the capturing
owner. Inside :func:`capturepass.profiling_capture` new captures go to
throwaway owners that the block releases at its end.

With ``check_replay=True`` every replay first checks that the addresses the
graphs baked in are still there: the static input buffers, and every retained
tensor on the storage it had at capture (a binding's scratch resized under the
graph, say). A difference raises :class:`~capturepass.errors.ResourceError`
naming the buffer or the retained object (instead of replaying into freed
memory). Static inputs need no check: their addresses are part of the key.

Outputs of a replay live in the owner's pool and would be overwritten by the
next replay, so they are copied out unless ``static_outputs=True`` (for callers
that consume them before the next call, as engines do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import CapturePassError, ResourceError
from capturepass.runtime import context, pools, profiling
from capturepass.runtime.owner import GraphOwner
from capturepass.runtime.program import Program
from capturepass.runtime.workspaces import locked_for_capture

log = logging.getLogger("capturepass")


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _shape_key(args: Sequence[Any]) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # torch.Size is a hashable tuple already; this runs on every call.
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif isinstance(a, (int, float, bool)):
            key.append(a)
        else:
            key.append(type(a))
    return tuple(key)


def _args_for_size(program: Program, args: Sequence[Any], size: int) -> list[Any] | None:
    """``args`` with the batch symbol (dim 0 of the first dynamic non-static input) set to ``size``."""
    symbol = None
    for i, node in enumerate(program.inputs):
        val = node.meta.get("val")
        if i in program.static_inputs or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        d0 = val.shape[0]
        if isinstance(d0, torch.SymInt) and d0.node.expr.free_symbols:
            symbol = d0.node.expr
            break
    if symbol is None:
        return None
    out: list[Any] = []
    for i, (node, arg) in enumerate(zip(program.inputs, args)):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr == symbol:
            out.append(size)
        elif isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor) and i not in program.static_inputs:
            shape = [
                size if isinstance(d, torch.SymInt) and d.node.expr == symbol else int(a)
                for d, a in zip(val.shape, arg.shape)
            ]
            out.append(torch.zeros(shape, dtype=arg.dtype, device=arg.device))
        else:
            out.append(arg)
    return out


class _Capture:
    """One capture shape: its owner, graphs and static buffers."""

    def __init__(self, program: Program, owner: GraphOwner, static_outputs: bool) -> None:
        self.program = program
        self.owner = owner
        self.static_outputs = static_outputs
        self.eager_lanes = owner.lanes("eager")
        self.eager = program.bind(owner, self.eager_lanes)
        self.inputs: dict[int, torch.Tensor] = {}  # input position -> static buffer
        self.seg_in: dict[int, list[tuple[fx.Node, torch.Tensor]]] = {}  # piece -> (value, buffer)
        self.seg_out: dict[int, list[torch.Tensor]] = {}
        self.uncaptured: set[int] = set()
        self.snapshot: _Snapshot | None = None

    def capture(self, args: Sequence[Any]) -> None:
        program, owner = self.program, self.owner
        device = owner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with context.running(owner), torch.cuda.stream(stream):
            self.eager(*args)  # warm-up: autotuning, lazy init, cuBLAS handles
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        _clear_cublas_workspaces()
        owner.pool = torch.cuda.graph_pool_handle()
        owner.capture_stream = stream
        # External joins run outside the graphs, around each segment's replay.
        bound = program.bind(owner, owner.lanes("capture:0"), externals=False)
        env = bound.initial_env(args)
        for i, (node, arg) in enumerate(zip(program.inputs, args)):
            if not isinstance(arg, torch.Tensor):
                continue
            if i in program.static_inputs:
                continue  # read in place: its address is part of this capture's key
            buf = torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device)
            buf.copy_(arg)
            self.inputs[i] = buf
            env[node] = buf
        breaks_out: set[fx.Node] = set()
        reason = f"capture of {owner.name}"
        with context.running(owner), owner.workspaces.locked(reason), locked_for_capture(reason), \
                pools.entered_for_capture(owner.name, stream):
            for p, piece in enumerate(program.pieces):
                if piece.kind == "break" or not piece.has_kernels:
                    # Breaks run eagerly; a segment without a kernel (only views and host
                    # scalar math) has nothing to capture.
                    bound.run_piece(p, env)
                    breaks_out.update(piece.live_out)
                    self.uncaptured.add(p)
                    continue
                staged = []
                for node in piece.live_in:
                    if node in breaks_out and isinstance(env[node], torch.Tensor):
                        buf = env[node].clone()
                        env[node] = buf
                        staged.append((node, buf))
                self.seg_in[p] = staged
                graph = torch.cuda.CUDAGraph()
                owner.graphs[piece.segment] = graph
                owner.capturing = piece.segment
                try:
                    with torch.cuda.graph(graph, pool=owner.pool, stream=stream):
                        bound.run_piece(p, env)
                finally:
                    owner.capturing = None
                self.seg_out[p] = [env[n] for n in piece.live_out]
        torch.cuda.synchronize(device)
        self.snapshot = _Snapshot.of(self)

    def replay(self, args: Sequence[Any], check: bool = False) -> Any:
        program = self.program
        if check and self.snapshot is not None:
            self.snapshot.check(self, args)
        # Static inputs are where the capture saw them: their addresses are part of the key.
        for i, buf in self.inputs.items():
            arg = args[i]
            if arg.data_ptr() != buf.data_ptr():
                buf.copy_(arg)
        env: dict[fx.Node, Any] = dict(zip(program.inputs, args))
        env.update(program.constants)
        graphs = self.owner.graphs
        with context.running(self.owner):
            for p, piece in enumerate(program.pieces):
                if piece.kind == "break" or p in self.uncaptured:
                    self.eager.run_piece(p, env)
                    continue
                for node, buf in self.seg_in[p]:
                    value = env[node]
                    if value.shape != buf.shape or value.stride() != buf.stride():
                        log.warning(
                            "capturepass: %s: segment %s reads %%%s with shape %s, captured with %s; "
                            "running the segment uncaptured from now on",
                            self.owner.name, piece.segment, node.name, tuple(value.shape), tuple(buf.shape),
                        )
                        self.uncaptured.add(p)
                        self.eager.run_piece(p, env)
                        break
                    buf.copy_(value)
                else:
                    joins = piece.external_joins
                    for name, into in joins:
                        if into:
                            self.eager_lanes.join_external(name, True)
                    graphs[piece.segment].replay()
                    for name, into in joins:
                        if not into:
                            self.eager_lanes.join_external(name, False)
                    for node, value in zip(piece.live_out, self.seg_out[p]):
                        env[node] = value
        out = self.eager.result(env)
        if self.static_outputs:
            return out
        static = {id(t) for outs in self.seg_out.values() for t in outs if isinstance(t, torch.Tensor)}
        return fx.node.map_aggregate(
            out, lambda v: v.clone() if isinstance(v, torch.Tensor) and id(v) in static else v
        )


def _storage_of(obj: Any) -> tuple[int, int] | None:
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
        st = obj.untyped_storage()
        return st.data_ptr(), st.nbytes()
    return None


@dataclasses.dataclass
class _Snapshot:
    """What a capture baked in: its input buffers' addresses and the storage of every retained tensor.

    Static inputs need no entry: their addresses are part of the capture's key, so a call
    whose parameters moved never replays this capture.
    """

    buffer_ptrs: dict[int, int]
    retained: dict[int, list[tuple[int, str, tuple[int, int] | None]]]

    @classmethod
    def of(cls, cap: "_Capture") -> "_Snapshot":
        retained = {
            seg: [(id(o), type(o).__name__, _storage_of(o)) for o in objs]
            for seg, objs in cap.owner.retained.items()
        }
        return cls({i: b.data_ptr() for i, b in cap.inputs.items()}, retained)

    def check(self, cap: "_Capture", args: Sequence[Any]) -> None:
        owner = cap.owner
        names = [n.name for n in cap.program.inputs]
        for i, ptr in self.buffer_ptrs.items():
            if cap.inputs[i].data_ptr() != ptr:
                raise ResourceError(
                    f"check_replay: the static buffer of input {i} (%{names[i]}) of {owner.name} moved since capture"
                )
        for seg, entries in self.retained.items():
            objs = owner.retained.get(seg, [])
            if len(objs) != len(entries):
                raise ResourceError(
                    f"check_replay: segment {seg} of {owner.name} retained {len(entries)} object(s) at capture, "
                    f"{len(objs)} now"
                )
            for k, (obj, (oid, tname, storage)) in enumerate(zip(objs, entries)):
                if id(obj) != oid:
                    raise ResourceError(
                        f"check_replay: retained object {k} ({tname}) of segment {seg} of {owner.name} "
                        "was replaced since capture"
                    )
                if _storage_of(obj) != storage:
                    raise ResourceError(
                        f"check_replay: retained {tname} {k} of segment {seg} of {owner.name} changed storage "
                        f"since capture ({storage} -> {_storage_of(obj)}: resized or set_ to other memory); "
                        "the graph still uses the old address"
                    )


@dataclasses.dataclass
class _EagerOwner:
    """The owner of one model instance's uncaptured runs, and its bound programs."""

    owner: GraphOwner
    program: Any
    outer: Any = None


class Executor:
    """The compiled callable of one ATen graph (boxed: takes a list of arguments).

    Args:
        program: the emitted program.
        max_captures: capture shapes kept before falling back to uncaptured runs.
        static_outputs: return replay outputs without copying them.
        capture_sizes: batch sizes to capture on the first call.
        check_replay: check at every replay that baked-in addresses are unchanged.
    """

    def __init__(
        self,
        program: Program,
        max_captures: int = 16,
        static_outputs: bool = False,
        capture_sizes: Sequence[int] = (),
        check_replay: bool = False,
    ) -> None:
        self.program = program
        self.check_replay = check_replay
        self.capture_sizes = tuple(capture_sizes)
        info = program.info
        self.captured = info.captured and info.on_cuda
        self.max_captures = max_captures
        self.static_outputs = static_outputs
        self._captures: dict[tuple, _Capture] = {}
        # Owners of uncaptured runs, per model instance (the addresses of the static inputs).
        self._eager_owners: dict[tuple, _EagerOwner] = {}
        self._profile_owners: dict[tuple, _EagerOwner] = {}
        self._warned_bound = False
        self._uncaptured_depth = 0
        self._static_positions = tuple(sorted(program.static_inputs))
        self._lock = threading.Lock()
        self.closed = False

    # -- owners --------------------------------------------------------------------------------
    def _device(self, args: Sequence[Any]) -> torch.device | None:
        if not self.program.info.on_cuda:
            return None
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type == "cuda":
                return a.device
        return torch.device("cuda", torch.cuda.current_device())

    def _instance(self, args: Sequence[Any]) -> tuple:
        """The model instance a call runs: the addresses of its static inputs (parameters).

        Dynamo compiles a class's ``forward`` once and serves every instance with the same
        graph (parameters are inputs); a target and a draft model of one class would then
        share this callable. Owners are therefore kept per instance, so that two models
        never share graphs, pools, channels or workspaces.
        """
        return tuple(
            args[i].data_ptr() for i in self._static_positions if i < len(args) and isinstance(args[i], torch.Tensor)
        )

    def _eager_owner_for(self, args: Sequence[Any]) -> "_EagerOwner":
        instance = self._instance(args)
        rec = self._eager_owners.get(instance)
        if rec is None:
            if len(self._eager_owners) >= self.max_captures:
                oldest = next(iter(self._eager_owners))
                log.info(
                    "capturepass: %s graph: more than max_captures=%d model instances ran uncaptured; "
                    "releasing the owner of the oldest", self.program.info.name, self.max_captures,
                )
                self._eager_owners.pop(oldest).owner.close()
            info = self.program.info
            owner = GraphOwner(info.name, len(info.lanes), self._device(args), captured=info.captured)
            rec = self._eager_owners[instance] = _EagerOwner(owner, self.program.bind(owner, owner.lanes("eager")))
        return rec

    def _eager_program(self, args: Sequence[Any]) -> Any:
        return self._eager_owner_for(args).program

    @property
    def owners(self) -> list[GraphOwner]:
        """Every owner this callable holds (one per model instance and capture shape, and one
        per model instance that ran uncaptured)."""
        return [c.owner for c in self._captures.values()] + [r.owner for r in self._eager_owners.values()]

    # -- calls -----------------------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> Any:
        inst = context.instrumentation()
        if inst is None or inst.graph is None:
            return self._call(args)
        with inst.graph(self):
            return self._call(args)

    @contextlib.contextmanager
    def uncaptured(self) -> Iterator[None]:
        """Inside the block this callable runs its program uncaptured, on its eager owner's
        lanes (its captures are kept, and replay again afterwards). For measurements that
        need each lane on its own stream."""
        self._uncaptured_depth += 1
        try:
            yield
        finally:
            self._uncaptured_depth -= 1

    def _call(self, args: list[Any]) -> Any:
        if self.closed:
            raise CapturePassError(f"this compiled {self.program.info.name} graph was closed; compile it again")
        if not self.captured or self._uncaptured_depth:
            return self._run_eager(args)
        if torch.cuda.is_current_stream_capturing():
            return self._run_in_outer_capture(args)
        if self.capture_sizes and not self._captures:
            self._precapture(args)
        key = (self._instance(args), _shape_key(args))
        cap = self._captures.get(key)
        if cap is not None:
            return cap.replay(args, self.check_replay)
        if len(self._captures) >= self.max_captures:
            if not self._warned_bound:
                self._warned_bound = True
                log.warning(
                    "capturepass: %s graph reached max_captures=%d capture shapes; new shapes run uncaptured "
                    "(raise max_captures, or give capture_sizes)",
                    self.program.info.name, self.max_captures,
                )
            return self._run_eager(args)
        return self.capture(args, key).replay(args)

    def capture(self, args: Sequence[Any], key: tuple | None = None) -> _Capture:
        """Captures the program for the shapes (and model instance) of ``args``, kept for later calls."""
        key = (self._instance(args), _shape_key(args)) if key is None else key
        with self._lock:
            info = self.program.info
            owner = GraphOwner(info.name, len(info.lanes), self._device(args), captured=True)
            cap = _Capture(self.program, owner, self.static_outputs)
            prof = profiling.active()
            try:
                cap.capture(args)
            except Exception:
                owner.close()
                raise
            self._captures[key] = cap
            if prof is not None:
                prof.adopt(owner, lambda: self._forget(key, cap))
        return cap

    def _forget(self, key: tuple, cap: "_Capture") -> None:
        if self._captures.get(key) is cap:
            del self._captures[key]

    def _precapture(self, args: Sequence[Any]) -> None:
        """Captures every size of ``capture_sizes`` (the batch is dim 0 of the first dynamic input)."""
        for size in self.capture_sizes:
            sized = _args_for_size(self.program, args, size)
            if sized is None:
                log.warning(
                    "capturepass: capture_sizes given, but the %s graph has no dynamic batch dimension; "
                    "capturing the shapes it is called with instead",
                    self.program.info.name,
                )
                return
            key = (self._instance(sized), _shape_key(sized))
            if key not in self._captures and len(self._captures) < self.max_captures:
                self.capture(sized, key)

    def _run_eager(self, args: Sequence[Any]) -> Any:
        prof = profiling.active()
        if prof is not None and self.program.info.captured and not self.captured:
            return self._run_profiled_on_host(args, prof)
        rec = self._eager_owner_for(args)
        with context.running(rec.owner):
            return rec.program(*args)

    def _run_profiled_on_host(self, args: Sequence[Any], prof: "profiling.ProfilingCapture") -> Any:
        # A host graph's first run stands for its capture: inside a profiling capture it
        # runs on a throwaway owner, which the block releases with what it retained.
        instance = self._instance(args)
        rec = self._profile_owners.get(instance)
        if rec is None or rec.owner.closed:
            info = self.program.info
            owner = GraphOwner(info.name, len(info.lanes), None, captured=True)
            rec = self._profile_owners[instance] = _EagerOwner(owner, self.program.bind(owner, owner.lanes("eager")))
            prof.adopt(owner, lambda: self._profile_owners.pop(instance, None))
        with context.running(rec.owner):
            return rec.program(*args)

    def _run_in_outer_capture(self, args: Sequence[Any]) -> Any:
        # An engine is capturing around us: emit streams and events into its capture,
        # with events of a scope reserved for it, and retain for our own owner's life
        # (torch gives no handle to the outer graph).
        rec = self._eager_owner_for(args)
        owner = rec.owner
        if rec.outer is None:
            rec.outer = self.program.bind(owner, owner.lanes("outer"))
        owner.capturing = -1
        reason = f"outer capture around {owner.name}"
        try:
            with context.running(owner), owner.workspaces.locked(reason), locked_for_capture(reason), \
                    pools.entered_for_capture(owner.name, torch.cuda.current_stream()):
                return rec.outer(*args)
        finally:
            owner.capturing = None

    @property
    def num_captures(self) -> int:
        """How many capture shapes are held."""
        return len(self._captures)

    def release_captures(self) -> None:
        """Closes every capture owner (graphs, pools, leases, retained objects); the callable
        stays usable and captures again on its next call."""
        for cap in self._captures.values():
            cap.owner.close()
        self._captures.clear()
        self._warned_bound = False

    def close(self) -> None:
        """Synchronizes and releases every owner (graphs, pools, leases, retained objects)."""
        for cap in self._captures.values():
            cap.owner.close()
        self._captures.clear()
        for rec in self._eager_owners.values():
            rec.owner.close()
        self._eager_owners.clear()
        self.closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
