"""The outer program: regions and ``capturepass::`` ops, run in program order.

emit hands over a plan (``capturepass.ir.plan``: region calls, records, waits,
releases, retentions), and the backend the compiled callable of every region.
``Program`` groups the steps into *pieces*: one per capture segment,
and one per break (a non-capturable region run eagerly between segments). Each
piece becomes its own FX graph taking its live-in values and returning its
live-out values; ``Program.bind`` generates the Python of every piece against
one graph owner's lanes (its streams and its event leases), so the integer
handles in the IR resolve to that owner's objects only. FX's generated code
drops every value right after its last use, which is where ``insert_syncs``
put a ``release`` when the default free would have raced another lane.

A break of a captured owner (a non-capturable op run eagerly between
segments) gets its tensor arguments on the owner's device as weak references
(:func:`capturepass.runtime.resources.weak_ref`): the arguments are graph
activations in the owner's pool or the caller's inputs, and an op that keeps
one (a cache, a deferred check) must not pin it past the call. Arguments in
host memory (a per-call number on the CPU) or on another device go in as they
are: no pool keeps their memory once its owner lets go, and a view an op kept
would read, or write, what the allocator put there since. What the break
returns is copied by the runtime into the next segment's static input buffers
(the caller-provided outputs); an output that aliases an argument is turned
back into a strong view before anything else sees it.

A region of collectives is bound to the owner's communicators
(``runtime.comms.redirected``): its collectives post on the groups of the owner
that runs it, never on the group they were traced with.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from capturepass.ir import meta
from capturepass.ir.meta import EventRole, GraphInfo
from capturepass.ir.plan import Inline, Plan, RegionPlan, Step, StepKind
from capturepass.runtime import code_lanes, comms, context, naming
from capturepass.runtime.inline import runner as inline_runner
from capturepass.runtime.lanes import run_here
from capturepass.runtime.owner import GraphOwner

if TYPE_CHECKING:
    from capturepass.runtime.lanes import Lanes


@dataclasses.dataclass
class RegionSpec:
    """One compiled region: its plan and the callable the backend compiled from it.

    Attributes:
        index: the region's number in program order.
        lane: the lane index it runs on.
        segment: its segment index, or ``None`` for a break run eagerly.
        eager: whether it is a non-capturable break.
        fn: the inner compiler's callable (takes the inputs, returns a sequence).
        inputs / outputs: the annotated-graph nodes it reads and provides.
        graph: its standalone FX graph (for dumps and debugging).
        compiler: which inner compiler produced ``fn``.
        kernels: whether it launches any kernel (views and host math do not).
        groups: the process groups its collectives were traced with.
        inline: the sync points of a segment compiled once with its lanes inline
            (``capturepass.runtime.inline``), else ``None``.
    """

    index: int
    lane: int
    segment: int | None
    eager: bool
    fn: Callable[..., Sequence[Any]]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    graph: fx.GraphModule
    compiler: str
    kernels: bool = True
    groups: tuple[str, ...] = ()
    inline: Inline | None = None

    @classmethod
    def of(cls, region: RegionPlan, fn: Callable[..., Sequence[Any]]) -> "RegionSpec":
        """The compiled form of ``region``."""
        return cls(
            index=region.index, lane=region.lane, segment=region.segment, eager=region.eager, fn=fn,
            inputs=region.inputs, outputs=region.outputs, graph=region.graph, compiler=region.compiler,
            kernels=region.kernels, groups=region.groups, inline=region.inline,
        )


@dataclasses.dataclass
class Piece:
    """A capture segment or a break, with the values it reads and provides.

    Attributes:
        kind: ``"segment"`` or ``"break"``.
        segment: the segment index (``None`` for a break).
        steps: its steps, in program order.
        live_in: annotated-graph values it reads from outside.
        live_out: values it produces that later pieces or the output read.
    """

    kind: str
    segment: int | None
    steps: list[Step]
    live_in: list[fx.Node] = dataclasses.field(default_factory=list)
    live_out: list[fx.Node] = dataclasses.field(default_factory=list)

    @functools.cached_property
    def external_joins(self) -> tuple[tuple[str, bool], ...]:
        """``(stream name, into)`` of the piece's external joins, in program order (computed once:
        the runtime asks at every replay)."""
        return tuple((meta.info(s.payload).external, meta.info(s.payload).role == EventRole.IN)
                     for s in self.steps if s.kind == StepKind.EXTERNAL)

    @property
    def has_kernels(self) -> bool:
        """Whether any region of the piece launches a kernel."""
        return any(s.kind == StepKind.REGION and s.payload.kernels for s in self.steps)


class RegionCall:
    """The callable an outer-program node invokes for one region on one owner's lane."""

    def __init__(self, spec: RegionSpec, run: Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]) -> None:
        self.spec = spec
        self.__name__ = f"region_{spec.index}"
        self.__qualname__ = self.__name__
        self._fn = spec.fn
        self._run = run
        self._direct = run is run_here  # on the current stream: no runner between

    def __call__(self, *args: Any) -> Sequence[Any]:
        inst = context.instrumentation()
        if inst is None or inst.region is None:
            return self._fn(*args) if self._direct else self._run(self._fn, args)
        with inst.region(self.spec):
            return self._run(self._fn, args)

    def __repr__(self) -> str:
        return f"<region {self.spec.index} on s{self.spec.lane} ({self.spec.compiler})>"


def _uses(step: Step) -> list[fx.Node]:
    if step.kind == StepKind.REGION:
        return list(step.payload.inputs)
    if step.kind in (StepKind.RELEASE, StepKind.RETAIN):
        return list(step.payload.all_input_nodes)
    return []


def _defs(step: Step) -> list[fx.Node]:
    return list(step.payload.outputs) if step.kind == StepKind.REGION else []


class Program:
    """A compiled graph: its pieces, regions and output, independent of any owner.

    Args:
        plan: what ``emit`` planned.
        compiled: the compiled callable of each region, by region index.

    Attributes:
        info: the annotated graph's record (lanes, capture mode, owner).
        inputs: the graph's placeholders, in order.
        constants: ``get_attr`` values the pieces read.
        pieces: segments and breaks in program order.
        regions: every compiled region.
        output: the output structure (annotated-graph nodes in a pytree).
        static_inputs: input positions whose storage the caller keeps fixed.
        code_lanes: for regions compiled with lanes after fusion (``backends.fused_lanes``:
            one lane's plan, each fused kernel's lane written into its generated code), the
            lanes that code runs on; ``0`` otherwise. An owner with side streams binds them
            around every region call, and the code runs its kernels there; an owner without
            runs one lane's code.
        lanes_code: the lanes' body of each such region's generated code (a function ``call``
            with its lane switches, records, waits and held frees), in compile order, for dumps.
    """

    def __init__(self, plan: Plan, compiled: Mapping[int, Callable[..., Sequence[Any]]]) -> None:
        gm = plan.graph
        steps = [
            Step(s.kind, s.lane, RegionSpec.of(s.payload, compiled[s.payload.index])) if s.kind == StepKind.REGION
            else s
            for s in plan.steps
        ]
        self.info: GraphInfo = meta.graph_info(gm)
        self.inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constants = {n: _fetch_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.output = out_node.args[0]
        self.static_inputs = self.info.static_inputs
        self.regions = [s.payload for s in steps if s.kind == StepKind.REGION]
        self.pieces = self._split(steps, out_node)
        self.code_lanes = 0
        self.fused = False  # compiled with lanes after fusion (``code_lanes`` 0: none left on a side lane)
        self.lanes_code: list[str] = []

    @property
    def lanes(self) -> int:
        """The lanes an owner of this program has: the plan's, or its code's."""
        return max(len(self.info.lanes), self.code_lanes)

    @staticmethod
    def _split(steps: list[Step], out_node: fx.Node) -> list[Piece]:
        pieces: list[Piece] = []
        for step in steps:
            if step.kind == StepKind.REGION and step.payload.eager:
                pieces.append(Piece("break", None, [step]))
                continue
            seg = step.payload.segment if step.kind == StepKind.REGION else _segment_of(step.payload)
            if not pieces or pieces[-1].kind != "segment":
                pieces.append(Piece("segment", seg, []))
            pieces[-1].steps.append(step)
        defined_in: dict[fx.Node, int] = {}
        for i, piece in enumerate(pieces):
            for step in piece.steps:
                for d in _defs(step):
                    defined_in[d] = i
        needed_later: list[set[fx.Node]] = [set() for _ in pieces]
        for i, piece in enumerate(pieces):
            seen: set[fx.Node] = set()
            for step in piece.steps:
                for u in _uses(step):
                    if defined_in.get(u) != i and u not in seen:
                        seen.add(u)
                        piece.live_in.append(u)
                        if u in defined_in:
                            needed_later[defined_in[u]].add(u)
        for u in out_node.all_input_nodes:
            if u in defined_in:
                needed_later[defined_in[u]].add(u)
        for i, piece in enumerate(pieces):
            piece.live_out = [d for step in piece.steps for d in _defs(step) if d in needed_later[i]]
        return pieces

    def bind(self, owner: "GraphOwner", lanes: "Lanes", externals: bool = True) -> "BoundProgram":
        """Generates every piece's code against ``owner``'s ``lanes`` (one event scope).

        With ``externals=False`` the pieces leave out their external-stream joins: the
        caller runs them around each segment's capture and replay (a captured graph
        cannot wait for a stream outside its capture).
        """
        bound = None
        streams = getattr(lanes, "streams", None) or ()
        if self.code_lanes and any(s is not None for s in streams):
            # The lanes' streams, not the owner's: a warm-up runs every lane on one stream.
            bound = (tuple(streams), getattr(lanes, "code_event", None))
        elif self.code_lanes and owner.device is None:
            # A host compile's lanes' body, run in program order (its lanes' calls do nothing).
            bound = ((HOST_LANE,) * (self.code_lanes - 1), None)
        return BoundProgram(self, [_piece_module(p, owner, lanes, externals, bound) for p in self.pieces])


# What stands for a side lane's stream when a host compile's lanes' body runs.
HOST_LANE = "host"


class BoundProgram:
    """A program bound to one owner's lanes: callable pieces and the value threading.

    A whole call runs generated code: one function that calls the pieces in order and passes
    their values on as locals (no environment to fill and read per call, which cost more than
    the rest of the outer program on a small host graph). Captures and replays, which run the
    pieces one at a time around their graphs, thread an environment instead.
    """

    def __init__(self, program: Program, modules: list[fx.GraphModule]) -> None:
        self.program = program
        self.modules = modules
        self._whole = _whole_call(program, modules)
        self._constants = tuple(program.constants.values())
        #: How many arguments a whole call takes (the program's inputs).
        self.arity = len(program.inputs)
        # Regions whose layout check may settle (``ExactLayouts.settled``): the direct call is
        # generated again without the check once they all have.
        self._unsettled = [spec.fn for spec in program.regions if hasattr(spec.fn, "settled")]
        self._generate_direct()

    def _generate_direct(self) -> None:
        # Without instrumentation a region on the current stream needs no call of its own: the
        # direct call invokes its compiled function.
        whole = _whole_call(self.program, self.modules, direct=True)
        self._direct = _lone_call(whole) or whole
        #: The direct call as a function of the inputs alone (``None`` where the program has
        #: constants to pass too).
        self.direct = None if self._constants else self._direct

    def settle(self) -> None:
        """Generates the direct call again without the layout checks of its regions, once every
        one has settled (after a call)."""
        if self._unsettled and all(fn.settled is not None for fn in self._unsettled):
            self._unsettled = []
            self._generate_direct()

    def run_piece(self, index: int, env: dict[fx.Node, Any]) -> None:
        """Runs piece ``index`` reading and extending ``env``."""
        piece = self.program.pieces[index]
        outs = self.modules[index](*[env[n] for n in piece.live_in])
        for node, value in zip(piece.live_out, outs):
            env[node] = value

    def initial_env(self, args: Sequence[Any]) -> dict[fx.Node, Any]:
        """The value environment for a call with ``args``."""
        env: dict[fx.Node, Any] = dict(zip(self.program.inputs, args))
        env.update(self.program.constants)
        return env

    def result(self, env: dict[fx.Node, Any]) -> Any:
        """The graph's outputs from a finished environment."""
        return fx.node.map_arg(self.program.output, lambda n: env[n])

    def __call__(self, *args: Any) -> Any:
        if len(args) == self.arity:
            inst = context.instrumentation()
            whole = self._direct if inst is None or inst.region is None else self._whole
            return whole(*args, *self._constants) if self._constants else whole(*args)
        env = self.initial_env(args)
        for i in range(len(self.modules)):
            self.run_piece(i, env)
        return self.result(env)

    def code(self) -> str:
        """The generated Python of every piece (for dumps)."""
        parts = []
        for piece, module in zip(self.program.pieces, self.modules):
            title = f"segment {piece.segment}" if piece.kind == "segment" else "break (eager)"
            parts.append(f"# {title}\n{module.code.strip()}")
        return "\n\n".join(parts)


def _on_code_lanes(runner: Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]],
                   streams: tuple[Any, ...], event_of: Callable[[int], Any] | None,
                   ) -> Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]:
    """``runner`` with ``streams`` bound as the side lanes of code compiled with lanes after
    fusion, its events leased by the owner's lanes (``event_of``)."""
    def run(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
        with code_lanes.bind(streams, event_of):
            return runner(fn, args)

    return run


def _segment_of(node: fx.Node) -> int | None:
    seg = meta.info(node).segment
    return seg.index if seg is not None else None


def _piece_module(piece: Piece, owner: "GraphOwner", lanes: "Lanes", externals: bool = True,
                  code_lanes_of: tuple[tuple[Any, ...], Any] | None = None) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in piece.live_in}
    for step in piece.steps:
        if step.kind == StepKind.REGION:
            spec: RegionSpec = step.payload
            if spec.groups:
                spec = dataclasses.replace(spec, fn=comms.redirected(spec.graph, spec.groups, naming.model_of(owner.name), spec.lane))
            runner = inline_runner(spec, owner, lanes) if spec.inline is not None else lanes.region_runner(spec.lane)
            if spec.eager and owner.captured and owner.device is not None:
                runner = _weak_args(runner, lanes, owner.device)
            if code_lanes_of is not None:
                runner = _on_code_lanes(runner, *code_lanes_of)
            call = graph.call_function(RegionCall(spec, runner), tuple(env[n] for n in spec.inputs))
            for k, out in enumerate(spec.outputs):
                env[out] = graph.call_function(operator.getitem, (call, k))
            continue
        node: fx.Node = step.payload
        rec = meta.info(node)
        if step.kind in (StepKind.RECORD, StepKind.WAIT):
            handle = lanes.lease_handle(rec.lease)
            graph.call_function(lanes.record if step.kind == StepKind.RECORD else lanes.wait, (handle, step.lane.index))
        elif step.kind == StepKind.RELEASE:
            graph.call_function(lanes.release, tuple(env[a] for a in node.all_input_nodes))
        elif step.kind == StepKind.EXTERNAL:
            if externals:
                graph.call_function(lanes.join_external, (rec.external, rec.role == EventRole.IN))
        elif step.kind == StepKind.RETAIN:
            seg = rec.segment.index if rec.segment is not None else -1
            handles = tuple(owner.resource_handle(r) for r in rec.resources)
            graph.call_function(owner.retain, (seg, handles) + tuple(env[a] for a in node.all_input_nodes))
    graph.output(tuple(env[n] for n in piece.live_out))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="CapturePassPiece")


def _whole_call(program: Program, modules: list[fx.GraphModule], direct: bool = False) -> Callable[..., Any]:
    """The generated function of a whole call: ``f(*inputs, *constants)`` -> the outputs.

    With ``direct``, a region run on the current stream is called as its compiled function, not
    through its :class:`RegionCall` (for calls without instrumentation)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in program.inputs:
        env[n] = graph.placeholder(n.name)
    for n in program.constants:
        env[n] = graph.placeholder(f"const_{n.name}")
    for piece, module in zip(program.pieces, modules):
        # Each piece's code is copied in: one function for the whole call, no call per piece.
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        first = len(graph.nodes)
        outs = graph.graph_copy(module.graph, {p: env[n] for p, n in zip(placeholders, piece.live_in, strict=True)})
        if direct:
            for node in list(graph.nodes)[first:]:
                if isinstance(node.target, RegionCall) and node.target._direct:
                    fn = node.target._fn
                    node.meta["capturepass_results"] = len(node.target.spec.outputs)
                    node.target = _nameable(getattr(fn, "settled", None) or fn) or node.target
        for node, value in zip(piece.live_out, outs, strict=True):
            env[node] = value
    graph.output(fx.node.map_arg(program.output, lambda n: env[n]))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="CapturePassCall").forward


def _lone_call(whole: Callable[..., Any]) -> Callable[..., Any] | None:
    """The one function a generated whole call ``whole`` consists of, where calling it is the
    same as calling ``whole``: it takes the inputs in order and its results are the outputs, all
    of them, in order (a program of one region on the current stream). ``None`` otherwise.

    Then the whole call's own frame is left out too: a small graph's uncaptured call costs a few
    microseconds on the host, and each Python call about a tenth of one.
    """
    graph: fx.Graph = whole.__self__.graph  # type: ignore[attr-defined]
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes[len(inputs):-1] if n.target is not operator.getitem]
    if len(calls) != 1 or calls[0].op != "call_function" or calls[0].kwargs or list(calls[0].args) != inputs:
        return None
    call = calls[0]
    items = nodes[len(inputs) + 1:-1]
    outputs = nodes[-1].args[0]
    if not isinstance(outputs, tuple) or list(outputs) != items or any(
            n.op != "call_function" or n.target is not operator.getitem or n.args != (call, i) for i, n in enumerate(items)):
        return None
    # All of the region's results must be outputs, not only the ones read.
    return call.target if call.meta.get("capturepass_results") == len(items) else None


def _nameable(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn`` (a callable object by its ``__call__``) where generated code can name it: FX
    names a call's target by its module and qualified name. ``None`` otherwise (a generated
    module's ``forward`` has no module)."""
    for f in (fn, getattr(fn, "__call__", None)):
        if f is not None and getattr(f, "__module__", None) and hasattr(f, "__qualname__") and hasattr(f, "__name__"):
            return f
    return None


def _weak_args(run: "Callable[[Callable[..., Sequence[Any]], tuple], Sequence[Any]]", lanes: "Lanes",
               device: torch.device) -> Any:
    """Wraps a break's runner: tensor arguments on ``device``, whose graph pool holds their
    memory, go in as weak references; any other as it is (see the module doc)."""
    from capturepass.runtime.resources import weak_ref

    if getattr(torch._C, "_construct_storage_from_data_pointer", None) is None:
        return run  # this torch cannot make non-owning storage: arguments stay strong
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def call(fn: Callable[..., Sequence[Any]], args: tuple) -> Sequence[Any]:
        strong: dict[int, torch.Tensor] = {}
        weak_args = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.requires_grad and a.numel() \
                    and a.device == device:
                w = weak_ref(a)
                strong[w.untyped_storage()._cdata] = a
                weak_args.append(w)
            else:
                weak_args.append(a)
        lanes.counters["weak_args"] += len(strong)
        outs = run(fn, tuple(weak_args))
        del weak_args
        return type(outs)(_strengthen(o, strong) for o in outs) if strong else outs

    return call


def _strengthen(value: Any, strong: dict[int, torch.Tensor]) -> Any:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return value
    orig = strong.get(value.untyped_storage()._cdata)
    if orig is None:
        return value
    out = torch.empty(0, dtype=value.dtype, device=value.device)
    out.set_(orig.untyped_storage(), value.storage_offset(), value.size(), value.stride())
    return out


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_describe_ids = itertools.count()


def describe(program: Program) -> str:
    """The outer program's generated code, bound to a throwaway host owner (handles as in the IR)."""
    owner = GraphOwner(f"{program.info.owner}.describe{next(_describe_ids)}", program.lanes, None,
                       captured=False)
    try:
        return program.bind(owner, owner.lanes("eager")).code().strip()
    finally:
        owner.close()
