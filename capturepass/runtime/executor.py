"""The compiled callable: runs a program eagerly, or captures and replays it.

Modes, per graph:

- host graph, or ``cudagraphs="none"``: the program runs eagerly, its lanes on
  the owner's streams (CUDA) or in program order (host);
- ``monolithic`` / ``breakable`` on CUDA: one :class:`GraphOwner` per model
  instance and input shape (an instance is the set of addresses of the static
  inputs: Dynamo serves every instance of a module class with one compiled
  graph, and a target and a draft model must still never share an owner).
  The first call with a shape is the warm-up, eager, and returns its results;
  then every segment is captured into its own CUDA graph, all in one private
  pool on one capture stream (``runtime.replay``). Calls then copy new input
  values into the static input buffers, replay, and copy the inputs the graph
  writes back to the caller's tensors. A new shape gets a new owner, up to
  ``max_captures``; beyond it the program runs uncaptured, and says so once.
  Some inputs are captured *in place* instead, on the caller's own tensor,
  with no buffer and no copy (see `In-place inputs` below).
- called while a capture that capturepass did not start is in progress (an
  engine capturing around the model), in any mode: the program runs without
  starting its own capture, forking from and joining to the capturing stream,
  with events of a scope reserved for outer captures; ``capturepass.retain``
  ties objects to the callable's owner there.

A capture that fails on one op becomes a break, not a crash: the failed capture
is ended and discarded (``runtime.capture``), the failing segment is probed node
by node for the op that cannot be captured (an opaque custom op that calls
``.tolist()``, say), the registry learns it (for every graph compiled later),
and the backend's ``rebuild`` callback re-runs the passes with that node a
break. The call returns the warm-up's results; the next call captures the new
program. Where no break can help (no single op fails alone, the op needs a
monolithic graph, the rebuild fails), the graph runs uncaptured from then on,
with the reason logged (``Executor.uncaptured_reason``). Errors of the model's
own code are raised by the warm-up, as eager raises them.

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

Outputs of a replay live in the model's pool: they are returned over aliases copied out only
when still held at the next replay (``runtime.outputs``), or as they are with ``static_outputs``.

In-place inputs (``runtime.in_place``): inputs the graph writes and slices of larger buffers
are captured on the caller's own tensor, their addresses in the capture's key; an input that
later comes at another address is copied from then on, and the captures made on the old
address are released (logged). A capture made on a caller's tensor is released when that
tensor's storage dies (``lifetime.watch_capture``). A whole input the graph only reads starts
copied; once a call finds it where the call before had it, the shape is captured again with it
in place (not watched: a capture keyed on a dead address serves the next tensor there). The
in-place capture and the copy capture that replaces it are one capture shape of the model
(``g3.m0.c0``). Outputs a replay handed out are never read in place: a replay that finds an
in-place input moved by its rescue of held outputs runs the call again, copied.

Owners die with their model: the executor watches each instance's static input
tensors and releases that instance's owners when the model is collected
(``runtime.lifetime``); ``capturepass.release(model)`` does it explicitly.

Owners are named after the graph owner the dump prints (``g3``): ``g3.m1`` is the
second model instance the graph ran, ``g3.m1.c0`` the owner of its first capture
shape, ``g3.m1.eager`` that of its uncaptured runs (``runtime.naming``). Messages
and errors use these names; given the graph's dump folder, the executor lists its
owners in ``owners.json`` there, which ``capturepass show`` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import threading
import types
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from capturepass.errors import CapturePassError
from capturepass.ir.options import Options
from capturepass.runtime import context, lifetime, naming, outputs, pools, profiling, sizes
from capturepass.runtime.capture_failures import CaptureFailures
from capturepass.runtime.choices import PickRecord, shape_text
from capturepass.runtime.in_place import STEADY_CALLS, InPlacePlans, capture_key
from capturepass.runtime.owner import ONE_STREAM as ONE_STREAM_SCOPE
from capturepass.runtime.owner import CaptureMemory, GraphOwner, capture_memory
from capturepass.runtime.program import Program
from capturepass.runtime.releases import Releases
from capturepass.runtime.replay import Capture, CaptureFailure, InPlaceMoved
from capturepass.runtime.snapshot import Snapshot
from capturepass.runtime.scalars import ScalarMisses
from capturepass.runtime.uncaptured import MODEL, ONE_STREAM, UncapturedChoice
from capturepass.runtime.workspaces import locked_for_capture

log = logging.getLogger("capturepass")

# What ``Executor._captured_call`` returns for a call that must run uncaptured.
_UNCAPTURED = object()

_Snapshot = Snapshot  # the name tests and tools have imported from here
_Capture = Capture


def mutated_inputs(program: Program) -> frozenset[int]:
    """Placeholder positions the graph writes (an input, a buffer or a view of one updated in
    place; functionalization's write-back ``copy_``): ``GraphInfo.mutated_inputs``, which
    ``annotate_capabilities`` reads from the ops' schemas (``capturepass.ir.effects``)."""
    return program.info.mutated_inputs


# Compares a call's tensors' addresses at given positions with recorded ones, in C++ (what
# PyTorch's cudagraph trees use for their static inputs); absent from some builds.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_data_ptr = torch.Tensor.data_ptr


def _shape_key(args: Sequence[Any], positions: Sequence[int] | None = None) -> tuple:
    """Shapes, strides, dtypes and devices of the tensors at ``positions`` (all by default),
    and the values of host scalars: what a capture is specific to."""
    key = []
    for i in range(len(args)) if positions is None else positions:
        if i >= len(args):
            continue
        a = args[i]
        if isinstance(a, torch.Tensor):
            # torch.Size is a hashable tuple already; this runs on every call.
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif isinstance(a, (int, float, bool)):
            key.append(a)
        else:
            key.append(type(a))
    return tuple(key)


@dataclasses.dataclass
class _Model:
    """One model instance the callable ran: its name (``g3.m1``) and its capture shapes' numbers."""

    name: str
    shapes: dict[tuple, int] = dataclasses.field(default_factory=dict)
    memory: dict[torch.device, CaptureMemory] = dataclasses.field(default_factory=dict)
    # Names the model across graphs (``owner.capture_memory``): None, its memory is its own.
    scope: tuple | None = None

    def shared(self, device: torch.device | None) -> CaptureMemory | None:
        """The pool and streams its capture owners share on ``device`` (``None`` on a host)."""
        if device is None or device.type != "cuda":
            return None
        mem = self.memory.get(device)
        if mem is None:
            mem = self.memory[device] = capture_memory(device, self.scope)
        return mem


@dataclasses.dataclass
class _EagerOwner:
    """The owner of one model instance's uncaptured runs, and its bound programs: ``program``
    on the owner's lanes; ``choice``, where uncaptured calls choose per shape between those lanes
    and one stream by timing them (``runtime.uncaptured``); ``outer``, for outer captures."""

    owner: GraphOwner
    program: Any
    outer: Any = None
    choice: UncapturedChoice | None = None


class Executor(CaptureFailures, Releases):
    """The compiled callable of one ATen graph (boxed: takes a list of arguments).

    Args:
        program: the emitted program.
        options: the graph's resolved options (:meth:`Options.for_graph`); the executor reads
            ``max_captures`` (capture shapes kept before falling back to uncaptured runs),
            ``static_outputs`` (return replay outputs as they are, overwritten by the next
            call), ``capture_sizes`` (batch sizes to capture on the first call) and
            ``check_replay`` (check at every replay that baked-in addresses are unchanged).
            Defaults: :class:`Options`' own.
        rebuild: re-runs the passes on the graph as it was before them, with the named
            nodes made breaks (``{node name: reason}``), and returns the new program;
            without it a capture that fails on one op turns capture off for this graph.
        record_dir: the graph's dump folder: the executor lists the owners it creates in
            ``owners.json`` there (``runtime.naming``).
        picker: chooses among schedule candidates by measuring them when a shape is first
            captured (:class:`~capturepass.runtime.pick.Picker`; ``None``: the program's
            schedule, as the cost model chose it).
        memory_scope: names the code this graph is one shape of (Dynamo's frame, and the
            kind of graph): the captures of graphs with the same scope that run the same
            parameters share one pool and its streams, as one graph's shapes do (``None``:
            this graph's models keep their own).
        on_choice: called with each shape's choice of uncaptured calls on CUDA between the
            cost model's lanes and one stream, with ``options.pick == "measure"``
            (:mod:`capturepass.runtime.uncaptured`; the backend adds it to the graph's record and
            dump folder).

    Attributes:
        graph_owner: the graph owner's name, as the dump prints it (``"g3"``); every owner
            of this callable is named after it.
        uncaptured_reason: why this graph stopped capturing, if it did.
        not_capturable: nodes made breaks after they failed under capture (name -> reason).
    """

    def __init__(
        self,
        program: Program,
        options: Options | None = None,
        rebuild: Callable[[dict[str, str]], Program] | None = None,
        record_dir: str | None = None,
        picker: Any = None,
        memory_scope: Hashable | None = None,
        on_choice: Callable[[PickRecord], None] | None = None,
    ) -> None:
        options = options if options is not None else Options()
        self._memory_scope = memory_scope
        self.options = options
        self.check_replay = options.check_replay
        self.capture_sizes = tuple(options.capture_sizes)
        self.max_captures = options.max_captures
        self.static_outputs = options.static_outputs
        self._captures: dict[tuple, Capture] = {}
        # Owners of uncaptured runs, per model instance (the addresses of the static inputs).
        self._eager_owners: dict[tuple, _EagerOwner] = {}
        self._profile_owners: dict[tuple, _EagerOwner] = {}
        self._watchers: dict[tuple, list] = {}  # instance -> finalizers of its static inputs
        self._models: dict[tuple, _Model] = {}  # instance -> its name and capture shapes, while it lives
        self._uncaptured_depth = 0
        self._rebuild = rebuild
        self._picker = picker
        self._on_choice = on_choice
        self._rebuilds = 0
        self.not_capturable: dict[str, str] = {}
        self.uncaptured_reason: str | None = None
        self._lock = threading.RLock()
        self.closed = False
        self._adopt(program)
        self._record = (naming.OwnersRecord(record_dir, self.graph_owner, program.info.name)
                        if record_dir is not None else None)
        lifetime.register(self)

    def _adopt(self, program: Program) -> None:
        self.program = program
        info = program.info
        # A rebuilt program keeps the graph record, and with it the owner id.
        self.graph_owner = str(info.owner)
        self._what = info.title
        self.captured = info.captured and info.on_cuda and self.uncaptured_reason is None
        self._on_cuda = info.on_cuda
        # A host graph marked captured runs apart inside a profiling capture (``_run_eager``).
        self._host_captured = info.captured and not info.on_cuda
        self._static_positions = tuple(sorted(program.static_inputs))
        self._static_getter = operator.itemgetter(*self._static_positions) if len(self._static_positions) > 1 else None
        # NOTE: the static inputs (parameters, buffers) are left out of the shape key: Dynamo
        # guards their shapes (another shape is another graph), and their addresses are the
        # instance key. A model has hundreds; keying each call on them cost more than a replay.
        self._dynamic_positions = tuple(i for i in range(len(program.inputs)) if i not in program.static_inputs)
        self._last_instance: tuple | None = None
        self._last_ptrs: list[int | None] = []
        self._static_indices: list[int] = []
        self._written = mutated_inputs(program)
        self._warned_bound = False
        self._places = InPlacePlans(program.static_inputs, self._written)
        self._scalars = ScalarMisses()

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
        if not self._static_positions:
            return ()
        last = self._last_instance
        if (
            last is not None and _ptrs_equal is not None and len(self._last_ptrs) == len(args)
            and _ptrs_equal(args, self._last_ptrs, self._static_indices)
        ):
            return last
        indices: Sequence[int] | None = None
        if self._static_getter is not None:
            try:
                # One C-level pass (a model has hundreds of parameters; without the C++ check
                # above this runs at every call).
                instance = tuple(map(_data_ptr, self._static_getter(args)))
                indices = self._static_positions
            except (TypeError, IndexError):  # a static position missing, or not a tensor
                pass
        if indices is None:
            indices = [i for i in self._static_positions if i < len(args) and isinstance(args[i], torch.Tensor)]
            instance = tuple(args[i].data_ptr() for i in indices)
        if _ptrs_equal is not None:
            ptrs: list[int | None] = [None] * len(args)
            for i, ptr in zip(indices, instance):
                ptrs[i] = ptr
            self._last_instance, self._last_ptrs, self._static_indices = instance, ptrs, list(indices)
        return instance

    def _watch(self, instance: tuple, args: Sequence[Any]) -> None:
        """Releases the owners of ``instance`` when one of its static input tensors is collected."""
        if not instance or instance in self._watchers:
            return
        tensors = [args[i] for i in self._static_positions if i < len(args) and isinstance(args[i], torch.Tensor)]
        self._watchers[instance] = lifetime.watch(self, instance, tensors)

    def _model(self, instance: tuple) -> _Model:
        """The model instance of these static-input addresses, named on first use (``g3.m1``)."""
        model = self._models.get(instance)
        if model is None:
            # The same parameters, as a set (another graph may take them in another order);
            # a graph without any shares nothing: it cannot tell one model from another.
            scope = (self._memory_scope, frozenset(instance)) if self._memory_scope is not None and instance else None
            model = self._models[instance] = _Model(naming.next_model(self.graph_owner), scope=scope)
        return model

    def _capture_owner_name(self, key: tuple) -> tuple[_Model, str]:
        """The model of a capture key (instance, shape) and the name of its capture owner: shapes
        are numbered per model in the order first captured (``g3.m1.c0``, ``g3.m1.c1``)."""
        model = self._model(key[0])
        shape = model.shapes.setdefault(key[1], len(model.shapes))
        return model, naming.capture_owner(model.name, shape)

    def _new_owner(self, name: str, model: _Model, role: str, args: Sequence[Any], device: torch.device | None,
                   captured: bool, share: bool = False, places: frozenset[int] = frozenset()) -> GraphOwner:
        shared = model.shared(device) if share else None
        owner = GraphOwner(name, self.program.lanes, device, captured=captured, shared=shared)
        if self._record is not None:
            self._record.add(name, model.name, role, naming.describe_inputs(args, self._static_positions, places),
                             str(owner.device) if owner.device is not None else "cpu")
        return owner

    def _eager_owner_for(self, args: Sequence[Any]) -> "_EagerOwner":
        instance = self._instance(args)
        rec = self._eager_owners.get(instance)
        if rec is None:
            if len(self._eager_owners) >= self.max_captures:
                oldest = next(iter(self._eager_owners))
                evicted = self._eager_owners.pop(oldest).owner
                log.info(
                    "capturepass: %s: more than max_captures=%d model instances ran uncaptured; "
                    "releasing %s, the owner of the oldest", self._what, self.max_captures, evicted.name,
                )
                evicted.close()
            info = self.program.info
            model = self._model(instance)
            owner = self._new_owner(naming.eager_owner(model.name), model, "eager", args, self._device(args),
                                    captured=info.captured)
            rec = self._eager_owners[instance] = _EagerOwner(owner, self.program.bind(owner, owner.lanes("eager")))
            rec.choice = self._uncaptured_choice(owner, rec.program)
            self._watch(instance, args)
        return rec

    def _uncaptured_choice(self, owner: GraphOwner, program: Any) -> UncapturedChoice | None:
        """The measured choice between lanes and one stream for ``owner``'s uncaptured calls, or
        ``None``: on the host, without side streams, with ``pick="model"``, or posting collectives."""
        if owner.device is None or not owner.side_streams or self.options.pick != "measure":
            return None
        if any(spec.groups for spec in self.program.regions):
            log.info("capturepass: %s: posts collectives; its uncaptured calls run the cost model's lanes, not "
                     "measured (ranks measuring on their own clocks could run different schedules)", self._what)
            return None
        one = self.program.bind(owner, owner.lanes(ONE_STREAM_SCOPE))
        return UncapturedChoice(self._what, {MODEL: program, ONE_STREAM: one}, self.program.lanes, owner.device,
                                on_choice=self._on_choice,
                                shape_of=lambda args: shape_text(args, self._static_positions))

    def _eager_program(self, args: Sequence[Any]) -> Any:
        """The bound program an uncaptured call with ``args`` runs: the one chosen for its shape
        (``runtime.uncaptured``), else the owner's lanes."""
        rec = self._eager_owner_for(args)
        chosen = rec.choice.chosen.get(_shape_key(args, self._dynamic_positions)) if rec.choice is not None else None
        return rec.program if chosen is None else chosen

    @property
    def owners(self) -> list[GraphOwner]:
        """Every owner this callable holds (one per model instance and capture shape, and one
        per model instance that ran uncaptured)."""
        return [c.owner for c in self._captures.values()] + [r.owner for r in self._eager_owners.values()]

    # -- calls -----------------------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> Any:
        state = context.state
        inst = state.instrumentation
        if inst is None:
            # An uncaptured call of a model instance run before, in one frame: on a small graph
            # the general path's layers cost as much as Inductor's own call of its code, and
            # each function call here about a tenth of a microsecond (the thread's owner is set
            # in place for that reason).
            if not (self.captured or self._uncaptured_depth or self.closed or lifetime.PENDING or lifetime.DEFERRED):
                rec = self._eager_owners.get(self._instance(args))
                program = None if rec is None else rec.program if rec.choice is None else \
                    rec.choice.chosen.get(_shape_key(args, self._dynamic_positions))
                if (program is not None and program.direct is not None and len(args) == program.arity
                        and not (self._host_captured and profiling.active() is not None)
                        and not (self._on_cuda and torch.cuda.is_current_stream_capturing())):
                    prev = state.owner
                    state.owner = rec.owner
                    try:
                        return program.direct(*args)
                    finally:
                        state.owner = prev
            return self._call(args)
        if inst.graph is None:
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
            raise CapturePassError(f"this compiled {self._what} was closed (its owners {self.graph_owner}.m* "
                                   "are released); compile it again")
        if lifetime.PENDING or lifetime.DEFERRED:
            lifetime.drain()
        # An engine capturing around us comes first, whatever our own mode: its graph must
        # receive our lanes' forks and joins, and retain what our ops retain.
        if self._on_cuda and torch.cuda.is_current_stream_capturing():
            return self._run_in_outer_capture(args)
        if not self.captured or self._uncaptured_depth:
            return self._run_eager(args)
        # One thread at a time from the key to the replay or capture: another thread's call may
        # release the capture this one found (an input that moved, or stayed put).
        with self._lock:
            out = self._captured_call(args)
        return self._run_eager(args) if out is _UNCAPTURED else out

    def _captured_call(self, args: list[Any]) -> Any:
        """The call of a captured graph: a replay, or a capture; ``_UNCAPTURED`` when it must run
        uncaptured (outside the lock)."""
        if self.capture_sizes and not self._captures:
            self._precapture(args)
            if not self.captured:
                return _UNCAPTURED
        base = (self._instance(args), _shape_key(args, self._dynamic_positions))
        plan = self._places.get(base) or self._places.plan(base, args)
        key = capture_key(base, plan, args)
        cap = self._captures.get(key)
        if cap is not None:
            if self._scalars.misses:
                self._scalars.came_back(base[1])
            if self._places.watching(base) is None:
                return self._replay(cap, args)
            steady = self._places.observe(base, args)
            if not steady:
                return self._replay(cap, args)
            key = self._promote(base, args, steady)
        elif plan[0]:
            key = self._replan(base, args)
            cap = self._captures.get(key)
            if cap is not None:
                return self._replay(cap, args)
        if self._scalars.stop(base[1], args, self._dynamic_positions, lambda i: self.program.inputs[i].name,
                              self._what):
            return _UNCAPTURED
        if len(self._captures) >= self.max_captures:
            if not self._warned_bound:
                self._warned_bound = True
                log.warning(
                    "capturepass: %s reached max_captures=%d capture owners; new shapes and models run uncaptured "
                    "(raise max_captures, or give capture_sizes)",
                    self._what, self.max_captures,
                )
            return _UNCAPTURED
        if self._places.watching(base) is not None:
            self._places.saw(base, args)  # a call too: the next must find its inputs where this one had them
        try:
            return self._capture_new(args, key, real=True)[1]
        except CaptureFailure as failure:
            self._capture_failed(failure)
            return failure.outputs  # the warm-up was this call

    def _replay(self, cap: Capture, args: list[Any]) -> Any:
        try:
            return cap.replay(args, self.check_replay)
        except InPlaceMoved as moved:
            # The replay copied a held output out of the graph's memory, and it was an input
            # captured in place: the graph would read where it was. The call goes again on
            # its new address, where the input is copied until it stays put there.
            log.warning("capturepass: %s: input(s) %s, captured in place, were moved by the replay (an output of "
                        "the model's handed back); copied into buffers while they move", self._what,
                        ", ".join(f"%{self.program.inputs[i].name}" for i in moved.positions))
            return self._captured_call(args)  # ``_UNCAPTURED`` runs eagerly in ``_call``, outside the lock

    def _promote(self, base: tuple, args: Sequence[Any], positions: Sequence[int]) -> tuple:
        """Captures ``base`` again with ``positions`` (inputs read whole, found at one address
        call after call) in place; returns the key of the capture to make."""
        released = self._release_base(base)
        plan = self._places.promote(base, args, positions)
        log.info("capturepass: %s: input(s) %s stayed at one address for %d calls; captured in place from now on "
                 "(no copy per call)%s", self._what, ", ".join(f"%{self.program.inputs[i].name}" for i in positions),
                 STEADY_CALLS + 1, f"; released {', '.join(released)}, which copied them" if released else "")
        return capture_key(base, plan, args)

    def _release_base(self, base: tuple) -> list[str]:
        """Releases every capture of ``base`` (model instance and shapes); returns their owners' names."""
        released = []
        for key in [k for k in self._captures if k[:2] == base]:
            cap = self._captures.pop(key)
            released.append(cap.owner.name)
            cap.release()
        return released

    def _watch_in_place(self, key: tuple, cap: Capture, args: Sequence[Any], places: frozenset[int]) -> None:
        """Releases ``cap`` when the storage of an input it was captured on in place (``places``) dies
        (whole read-only inputs, in place because they stayed put, are not: ``InPlacePlans.watched``)."""
        places = self._places.watched(places, args)
        if places:
            cap.watchers = lifetime.watch_capture(self, key, cap, [args[i].untyped_storage() for i in sorted(places)])

    def _replan(self, base: tuple, args: Sequence[Any]) -> tuple:
        """A call with the shapes of ``base`` but an in-place input elsewhere; returns its key.

        An input back at its first address (its capture was released when the tensor died)
        is captured in place again; one at another address is copied from now on, and the
        captures made on it, now unreachable, are released.
        """
        # What the capture on the old addresses served, if it is still there (one released when its
        # input's storage died served an unknown while: no short turn is counted for it).
        served = max((c.replays for k, c in self._captures.items() if k[:2] == base), default=None)
        moved = self._places.moved(base, args, served)
        if moved:
            by_rule: dict[str, list[str]] = {}
            for i, rule in moved.items():
                by_rule.setdefault(rule, []).append(f"%{self.program.inputs[i].name}")
            released = self._release_base(base)
            said = f"; released {', '.join(released)}, made on the old address" if released else ""
            for rule, names in by_rule.items():
                log.info("capturepass: %s: input(s) %s came at another address than at their capture; %s%s",
                         self._what, ", ".join(names), rule, said)
        return capture_key(base, self._places.get(base), args)

    def capture(self, args: Sequence[Any], key: tuple | None = None) -> Capture | None:
        """Captures the program for the shapes (and model instance) of ``args``, kept for later calls.

        The warm-up runs on copies of the inputs the graph writes: this is not a call, and
        leaves no visible effect. A capture that fails on one op makes it a break and
        captures the rebuilt program; returns ``None`` when the graph stopped capturing.
        """
        if key is None:
            base = (self._instance(args), _shape_key(args, self._dynamic_positions))
            key = capture_key(base, self._places.plan(base, args), args)
        while self.captured:
            program = self.program
            try:
                return self._capture_new(args, key, real=False)[0]
            except CaptureFailure as failure:
                self._capture_failed(failure)
                if self.program is program:
                    break
        return None

    def _capture_new(self, args: Sequence[Any], key: tuple, real: bool) -> tuple[Capture, Any]:
        try:
            return self._capture_shape(args, key, real)
        finally:
            if self._on_cuda and lifetime.release_allowed():
                # NOTE: what the warm-ups and the candidates the measured choice did not keep
                # left in the allocator's caches (their pools, side streams' blocks) stays
                # reserved to this process until its next cache release (torch.cuda.graph
                # empties the cache before each capture for the same reason).
                torch.cuda.empty_cache()

    def _capture_shape(self, args: Sequence[Any], key: tuple, real: bool) -> tuple[Capture, Any]:
        if self._picker is not None and profiling.active() is None:
            self._picker = self._picker.for_program(self.program)  # another picker after a rebuild
            if self._picker is not None:
                return self._pick_new(args, key, real)
        with self._lock, lifetime.capturing():
            model, name = self._capture_owner_name(key)
            prof = profiling.active()
            places = frozenset(self._places.plan(key[:2], args)[0])
            # A profiling capture is thrown away: it keeps to a pool and streams of its own.
            owner = self._new_owner(name, model, "capture", args, self._device(args), captured=True,
                                    share=prof is None, places=places)
            cap = Capture(self.program, owner, self.static_outputs, self._written, places)
            try:
                out = cap.run(args, real)
            except BaseException:
                owner.close()
                raise
            self._captures[key] = cap
            self._watch(key[0], args)
            self._watch_in_place(key, cap, args, places)
            if prof is not None:
                prof.adopt(owner, lambda: self._forget(key, cap))
        return cap, out

    def _pick_new(self, args: Sequence[Any], key: tuple, real: bool) -> tuple[Capture, Any]:
        """Captures the schedule candidate the picker chooses for this shape (measured, or cached)."""
        with self._lock, lifetime.capturing():
            model, name = self._capture_owner_name(key)
            places = frozenset(self._places.plan(key[:2], args)[0])
            static = set(self.program.static_inputs) | places
            # Timed replays write these at the caller's addresses: the picker restores them.
            protect = [args[i] for i in sorted(self._written & static) if isinstance(args[i], torch.Tensor)]
            device = self._device(args)
            shared = model.shared(device)
            # Owner names are unique among open owners: each other candidate's bears its schedule's name.
            def owner_name(candidate: str | None) -> str:
                return name if candidate is None else naming.candidate_owner(name, candidate)

            def capturing(warm_only: bool) -> Callable[..., tuple[Capture, Any]]:
                return lambda program, a, r, candidate, lane_map=None, before=None: self._capture_program(
                    program, a, r, owner_name(candidate), device, places, shared, warm_only, lane_map, before)

            captures = types.SimpleNamespace(
                _capture_program=capturing(False), _warm_program=capturing(True),
                static_positions=self._static_positions,  # left out of the shapes the choice shows
                written=tuple(sorted(self._written)),  # each timed replay starts from their values before the call
            )
            # Its timed replays run graphs of the model's shared pool: not beside another replay of
            # it, and not over outputs of the model's other captures that the caller still holds.
            with shared.lock if shared is not None else contextlib.nullcontext():
                if shared is not None:
                    outputs.rescue_group(shared.held_outputs)
                cap, out = self._picker.capture(captures, args, real, protect, device)
            self._watch_in_place(key, cap, args, places)
            if self._record is not None:
                inputs = naming.describe_inputs(args, self._static_positions, cap.in_place)
                self._record.add(cap.owner.name, model.name, "capture", inputs,
                                 str(cap.owner.device) if cap.owner.device is not None else "cpu")
            self._captures[key] = cap
            self._watch(key[0], args)
        return cap, out

    def _capture_program(self, program: Program, args: Sequence[Any], real: bool, name: str,
                         device: torch.device | None, places: frozenset[int] = frozenset(),
                         shared: CaptureMemory | None = None, warm_only: bool = False,
                         lane_map: Sequence[int] | None = None,
                         before: Mapping[int, torch.Tensor] | None = None) -> tuple[Capture, Any]:
        """Captures ``program`` for ``args`` into a new owner named ``name``, not kept (the picker keeps
        one); the inputs at ``places`` are captured in place, into the model's ``shared`` pool.
        With ``warm_only`` it only warms up: ``capture_warmed(args)`` captures it later.
        ``lane_map``: the owner's stream of each lane (``GraphOwner``; ``None``: one each).
        ``before``: what the written inputs held before the call, where it already ran
        (``Capture.run``)."""
        owner = GraphOwner(name, program.lanes, device, captured=True, shared=shared, lane_map=lane_map)
        cap = Capture(program, owner, self.static_outputs, mutated_inputs(program), places)
        try:
            out = cap.warm(args, real, before) if warm_only else cap.run(args, real, before)
        except BaseException:
            owner.close()
            raise
        return cap, out

    def _forget(self, key: tuple, cap: Capture) -> None:
        if self._captures.get(key) is cap:
            del self._captures[key]

    def _precapture(self, args: Sequence[Any]) -> None:
        """Captures every size of ``capture_sizes`` (the batch is dim 0 of the first dynamic input),
        largest first: the smaller captures' temporaries then fit in memory the larger ones freed
        in the model's shared pool."""
        if sizes.batch_dim(self.program) is None:
            log.warning(
                "capturepass: capture_sizes given, but the %s has no dynamic batch dimension%s; "
                "capturing the shapes it is called with instead", self._what, sizes.why_no_batch(self.program, args),
            )
            return
        wanted, outside, served = sizes.served(self.program, self.capture_sizes)
        if outside:
            # A call at such a size never reaches this graph: its capture would be wasted, and
            # would count against max_captures.
            log.info(
                "capturepass: %s: capture_sizes %s are outside the batch sizes this graph serves (%d to %s; "
                "Dynamo compiles another graph for them, which captures them at their first call); not "
                "captured here", self._what, ", ".join(map(str, outside)), served[0],
                "any" if served[1] is None else served[1],
            )
        for size in wanted:
            sized = sizes.args_for_size(self.program, args, size)
            assert sized is not None  # the graph has a batch dimension
            base = (self._instance(sized), _shape_key(sized, self._dynamic_positions))
            key = capture_key(base, self._places.plan(base, sized, given=args), sized)
            if key not in self._captures and len(self._captures) < self.max_captures:
                if self.capture(sized, key) is None:
                    return

    # -- uncaptured runs -------------------------------------------------------------------------
    def _run_eager(self, args: Sequence[Any]) -> Any:
        prof = profiling.active()
        if prof is not None and self.program.info.captured and not self.program.info.on_cuda:
            return self._run_profiled_on_host(args, prof)
        rec = self._eager_owner_for(args)
        if rec.choice is not None and not self._uncaptured_depth and context.instrumentation() is None:
            return rec.choice.call(_shape_key(args, self._dynamic_positions), args,
                                   lambda program: self._run_bound(rec.owner, program, args))
        return self._run_bound(rec.owner, rec.program, args)

    @staticmethod
    def _run_bound(owner: GraphOwner, program: Any, args: Sequence[Any]) -> Any:
        with context.running(owner):
            out = program(*args)
        program.settle()
        return out

    def _run_profiled_on_host(self, args: Sequence[Any], prof: "profiling.ProfilingCapture") -> Any:
        # A host graph's first run stands for its capture: inside a profiling capture it
        # runs on a throwaway owner, which the block releases with what it retained.
        instance = self._instance(args)
        rec = self._profile_owners.get(instance)
        if rec is None or rec.owner.closed:
            model = self._model(instance)
            owner = self._new_owner(naming.profile_owner(model.name), model, "profile", args, None, captured=True)
            rec = self._profile_owners[instance] = _EagerOwner(owner, self.program.bind(owner, owner.lanes("eager")))
            prof.adopt(owner, lambda: self._profile_owners.pop(instance, None))
            self._watch(instance, args)
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
    def schedule_choices(self) -> list[Any]:
        """The measured (or cached) schedule choices of this callable's captured shapes, oldest
        first, then those of its uncaptured calls per model instance
        (:class:`~capturepass.runtime.choices.PickRecord`); empty without a measured choice."""
        captured = list(self._picker.records) if self._picker is not None else []
        return captured + [r for rec in self._eager_owners.values() if rec.choice is not None
                           for r in rec.choice.records]

    @property
    def static_positions(self) -> tuple[int, ...]:
        """The input positions whose storage the caller keeps fixed (parameters, buffers)."""
        return self._static_positions

    # -- release ---------------------------------------------------------------------------------
    @property
    def num_captures(self) -> int:
        """How many capture shapes are held."""
        return len(self._captures)

    def close(self) -> None:
        """Synchronizes and releases every owner (graphs, pools, leases, retained objects)."""
        self._release(lambda inst: True, forget=True)
        self.closed = True

    def __del__(self) -> None:
        try:
            if not self.closed:
                lifetime.defer(self.close)
        except Exception:
            pass
