"""An interleaving simulator of a compiled graph's lanes, with an adversarial allocator.

The simulator runs the annotated ATen graph that the pipeline produced (or the one an emitted
:class:`~capturepass.runtime.program.Program` was built from) node by node with real tensors,
the way a GPU would run it: the host walks the program order and *issues* each node onto its
lane's queue; each lane runs its queue in order; a seeded adversarial scheduler interleaves the
host and the lanes, honouring only

- the order within each lane,
- the inserted events: a ``capturepass.wait`` blocks its lane until the record it is bound to has
  run. As with CUDA events, a wait is bound when the host issues it, to the last record of the
  same event object (the lease) issued before it; a wait on an event never recorded does nothing;
- host synchronisations: a node whose value the host needs (``.item()``) blocks the host until
  it has run.

Host model. View ops, tuple selections and size arithmetic run on the host when issued (they
touch no data). FX frees a value right after its last use in program order, and a
``capturepass.release`` is such a use: the storage of a root (the node that allocated it) is freed
by the host right after the last use of the root or of any of its views. The allocator hands
every block freed on a lane to the next allocation issued on the same lane (the caching
allocator's per-stream free list); when that allocation's kernel runs, it overwrites the block
with poison (NaN, a sentinel for integers, flipped booleans). Each allocation itself starts out
poisoned (uninitialised memory). So a read that runs before its producer, or after its block was
handed on, sees poison, and the result differs from serial execution: that is the oracle.

Given an emitted :class:`~capturepass.runtime.program.Program`, the host issues the nodes in
the program's own order instead (its steps in turn, each region's nodes when the region is
called), and values that cross pieces stay alive until the call returns, as in the program's
environment: this checks emit's ordering of regions, waits and releases too.

Capture model (``replay=True``, captured graphs only). A captured segment bakes in the addresses
of the static inputs and constants it reads; after the capture the caller may drop them. Those a
segment does not retain (``capturepass.retain``) are freed and reused before the replay, which is
simulated by poisoning them before the run.

Happens-before. Independently of the interleaving, a vector clock per lane (and one for the host)
follows the same events; every storage access is checked against the last write and the reads
since, and each unordered pair is reported as a :class:`Race` naming both nodes. A race is
reported even when no interleaving of this run happened to expose it.

Example::

    report = explore(gm, inputs, seeds=range(20))
    assert report.ok, report.describe()
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import SimulationError
from capturepass.ir import analysis, effects, meta
from capturepass.ir.meta import Effect, Overlap
from capturepass.ir.plan import StepKind

__all__ = ["Race", "SimResult", "SimulationError", "Report", "serial", "simulate", "explore", "same", "seeded_rng"]

_HOST_ONLY_OPS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


_RNG_KEY = -2  # the generator's hidden state, as a storage block random ops read and write


@contextlib.contextmanager
def seeded_rng() -> Iterator[None]:
    """Within the block the CPU generator starts from the state every simulated and serial run
    starts from (the caller's state is restored after it), so that random ops drawn in another
    order than serial execution's give other values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0x5EED)
        yield


@dataclasses.dataclass(frozen=True, order=True)
class Race:
    """Two accesses to one storage block that no event orders.

    Attributes:
        first / second: the two nodes, earlier in program order first (``output`` for the
            graph's output, read on the main lane).
        storage: the node that allocated the block (or the input / constant).
        kind: ``"read-write"`` (a read and a later write, such as a reuse after free),
            ``"write-read"`` (a read not ordered after the write it needs), ``"write-write"``,
            or ``"serialize"`` (a node not ordered with a serialized op; ``storage`` is empty).
    """

    first: str
    second: str
    storage: str
    kind: str

    def __str__(self) -> str:
        if self.kind == "serialize":
            return f"%{self.first} and %{self.second} may run concurrently, but one of them is serialized"
        return f"%{self.first} and %{self.second} race on the storage of %{self.storage} ({self.kind})"


@dataclasses.dataclass
class SimResult:
    """One simulated run.

    Attributes:
        outputs: the graph's outputs as read by the main lane at the output.
        inputs: the inputs after the run (copies; in-place mutations show here).
        trace: the executed order, ``"s1:%mm"`` per lane step.
        races: unordered access pairs (empty for a correctly synchronised graph).
        reused: how many freed blocks the allocator handed to a later allocation.
    """

    outputs: Any
    inputs: list[Any]
    trace: list[str]
    races: list[Race]
    reused: int


@dataclasses.dataclass
class Report:
    """Several seeded interleavings compared with serial execution."""

    runs: int = 0
    mismatches: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    races: list[Race] = dataclasses.field(default_factory=list)
    deadlocks: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    reused: int = 0

    @property
    def ok(self) -> bool:
        """No mismatch, no race and no deadlock."""
        return not (self.mismatches or self.races or self.deadlocks)

    @property
    def observed(self) -> bool:
        """Whether some run computed a wrong result or deadlocked (a race alone is not observed)."""
        return bool(self.mismatches or self.deadlocks)

    def describe(self) -> str:
        lines = [f"{self.runs} interleavings, {self.reused} reused blocks"]
        lines += [f"seed {s}: result differs from serial execution: {d}" for s, d in self.mismatches[:5]]
        lines += [f"seed {s}: {d}" for s, d in self.deadlocks[:5]]
        lines += [f"race: {r}" for r in self.races[:10]]
        return "\n".join(lines)


# -- the graph -----------------------------------------------------------------------------


def graph_module(obj: Any) -> fx.GraphModule:
    """The annotated graph of ``obj``: a graph module, or a Program emitted from one."""
    if isinstance(obj, fx.GraphModule):
        return obj
    nodes: list[fx.Node] = list(getattr(obj, "inputs", []))
    for spec in getattr(obj, "regions", []):
        nodes.extend(spec.inputs)
        nodes.extend(spec.outputs)
    for node in nodes:
        gm = node.graph.owning_module
        if gm is not None:
            return gm
    raise SimulationError(f"cannot find the annotated graph of {obj!r}")


def _program_plan(program: Any) -> "_Plan":
    """The host order of an emitted Program: its steps in order, each region's nodes in turn.

    Values that cross pieces stay in the program's environment until the call returns, so
    the host frees them only then; everything else is freed after its last use in this order.
    """
    gm = graph_module(program)
    by_name = {n.name: n for n in gm.graph.nodes}
    order = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")]
    held: set[fx.Node] = set()
    for piece in program.pieces:
        held.update(piece.live_out)
        for step in piece.steps:
            if step.kind == StepKind.REGION:
                for rn in step.payload.graph.graph.nodes:
                    if rn.op in ("call_function", "call_method", "call_module"):
                        node = by_name.get(rn.name)
                        if node is None:
                            raise SimulationError(f"region {step.payload.index}: no node %{rn.name} in the graph")
                        order.append(node)
            else:
                order.append(step.payload)
    order.extend(n for n in gm.graph.nodes if n.op == "output")
    missing = [n.name for n in gm.graph.nodes if n not in set(order)]
    if missing:
        raise SimulationError(f"the program does not issue %{', %'.join(missing[:5])}")
    return _Plan(gm, order, frozenset(held))


def _plan_of(obj: Any) -> "_Plan":
    if hasattr(obj, "pieces") and not isinstance(obj, fx.GraphModule):
        return _program_plan(obj)
    return _Plan(graph_module(obj))


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _writes_in_place(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def _mutated_arg(node: fx.Node) -> fx.Node:
    """The argument an in-place op writes (and returns)."""
    schema = node.target._schema
    for i, formal in enumerate(schema.arguments):
        if formal.alias_info is not None and formal.alias_info.is_write:
            value = node.kwargs.get(formal.name) if i >= len(node.args) else node.args[i]
            if isinstance(value, fx.Node):
                return value
    raise SimulationError(f"%{node.name}: cannot tell which argument {node.target} writes")


def _kind(node: fx.Node) -> str:
    """How the simulator runs ``node``."""
    eff = meta.effect_of(node)
    if eff is Effect.INPUT:
        return "input"
    if eff is Effect.CONSTANT:
        return "constant"
    if eff is Effect.OUTPUT:
        return "output"
    if eff in (Effect.RECORD, Effect.WAIT, Effect.RELEASE, Effect.RETAIN, Effect.EXTERNAL):
        return eff.value  # release, retain, external: host bookkeeping (no lane other than main runs them)
    if analysis.is_getitem(node):
        return "host"
    if analysis.aliases_input(node) is not None:
        return "host"  # a view: metadata only
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in _HOST_ONLY_OPS:
        return "host"  # size arithmetic and other Python on host values
    if _writes_in_place(target):
        return "mutate"
    val = node.meta.get("val")
    if not analysis.carries_tensor(node) and val is not None:
        return "sync"  # a host value computed from device data: the host waits for it
    return "alloc"


def _poison(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        elif t.dtype == torch.int8:
            t.fill_(-91)
        else:
            t.fill_(-1234567)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _storage_key(t: torch.Tensor) -> int | None:
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _buffer_like(ref: Any) -> Any:
    if isinstance(ref, torch.Tensor):
        if torch._debug_has_internal_overlap(ref) == 1:
            buf = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
        else:
            buf = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=ref.device)
        _poison(buf)
        return buf
    if isinstance(ref, (tuple, list)):
        return type(ref)(_buffer_like(r) for r in ref)
    return ref


def _copy_into(buf: Any, value: Any) -> None:
    if isinstance(buf, torch.Tensor):
        with torch.no_grad():
            buf.copy_(value)
    elif isinstance(buf, (tuple, list)):
        for b, v in zip(buf, value):
            _copy_into(b, v)


def _run_node(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    return node.target(*args, **kwargs)


def serial(gm_or_program: Any, inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Serial execution in program order: ``(outputs, inputs after the run)``. The oracle."""
    gm = graph_module(gm_or_program)
    args = [_clone(x) for x in inputs]
    with seeded_rng():
        env = _reference(gm, args)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return fx.node.map_arg(out_node.args[0], lambda n: _clone(env[n])), args


def same(a: Any, b: Any) -> str | None:
    """``None`` when ``a`` and ``b`` are equal bit for bit (NaN equal to NaN), else why not."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        except AssertionError as exc:
            return str(exc).splitlines()[0] if str(exc) else "tensors differ"
        return None
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return f"{len(a)} vs {len(b)} values"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same(x, y)
            if why is not None:
                return f"[{i}]: {why}"
        return None
    return None if a == b else f"{a!r} vs {b!r}"


# -- the simulation --------------------------------------------------------------------------


class _Plan:
    """What the host does at each program point, computed once per graph."""

    def __init__(self, gm: fx.GraphModule, host_order: list[fx.Node] | None = None, held: frozenset = frozenset()) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes) if host_order is None else host_order
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.kind = {n: _kind(n) for n in self.nodes}
        self.nlanes = max([len(meta.graph_info(gm).lanes)] + [meta.lane_of(n).index + 1 for n in self.nodes])
        outputs = analysis.output_roots(gm.graph)
        # Storage roots the host frees, by the program index after which they are freed.
        self.frees: dict[int, list[fx.Node]] = {}
        for node in self.nodes:
            if self.kind[node] not in ("alloc", "host") or not analysis.is_tensor_node(node):
                continue
            if analysis.alias_source(node) is not None or node in outputs:
                continue
            if self.kind[node] == "host" and not (analysis.is_getitem(node) and self.kind.get(node.args[0]) == "alloc"):
                continue
            members = analysis.view_members(node)
            if any(m in held for m in members):
                continue  # kept by the caller's environment until the call returns
            holders = [u for m in members for u in m.users]
            last = max((self.order[u] for u in holders), default=self.order[node])
            self.frees.setdefault(last, []).append(node)
        self.unretained = self._unretained(gm)
        self.captured = meta.graph_info(gm).captured

    @staticmethod
    def _unretained(gm: fx.GraphModule) -> set[fx.Node]:
        """Static inputs and constants read by a captured segment that does not retain them."""
        if not meta.graph_info(gm).captured:
            return set()
        external = analysis.external_owners(gm)
        out: set[fx.Node] = set()
        used: set[fx.Node] = set()
        retained: set[fx.Node] = set()
        for node in gm.graph.nodes:
            eff = meta.effect_of(node)
            if eff is Effect.OUTPUT or (eff is Effect.COMPUTE and meta.info(node).brk is not None):
                out |= used - retained
                used, retained = set(), set()
            elif eff is Effect.RETAIN:
                retained.update(node.all_input_nodes)
            elif eff is Effect.COMPUTE:
                used.update(a for a in node.all_input_nodes if a in external)
        return out


class _Scheduler:
    """Seeded choice among the runnable participants (the host is participant ``lanes``).

    Seeds cycle through three strategies: ``seed % 3 == 0`` picks uniformly at random;
    ``1`` starves one lane (lane ``seed // 3`` modulo the lane count), which runs only when
    nothing else can, so that its work lands as late as the events allow; ``2`` uses random
    priorities (the highest runnable participant runs) with a few random points where the
    running participant drops to the lowest priority.
    """

    def __init__(self, seed: int, lanes: int, length: int) -> None:
        self.rng = random.Random(seed)
        self.mode = seed % 3
        self.starved = (seed // 3) % lanes
        self.priority = list(range(lanes + 1))
        self.rng.shuffle(self.priority)
        changes = self.rng.randint(0, 3)
        self.change_at = set(self.rng.sample(range(max(length, 1)), min(changes, max(length, 1))))
        self.step = 0

    def pick(self, runnable: list[int]) -> int:
        self.step += 1
        if self.mode == 0:
            return self.rng.choice(runnable)
        if self.mode == 1:
            others = [p for p in runnable if p != self.starved]
            return self.rng.choice(others) if others else runnable[0]
        best = max(runnable, key=self.priority.__getitem__)
        if self.step in self.change_at:
            self.priority[best] = min(self.priority) - 1
        return best


@dataclasses.dataclass(eq=False)
class _Mark:
    """A capture's begin or end on the main lane (captured graphs only)."""

    what: str  # "begin" or "end"
    segment: int
    name: str = ""

    def __post_init__(self) -> None:
        self.name = f"{self.what} of capture k{self.segment}"


@dataclasses.dataclass
class _Access:
    node: str
    order: int
    lane: int
    epoch: int


class _Memory:
    """Vector-clock happens-before over storage blocks."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.write: dict[int, _Access] = {}
        self.reads: dict[int, list[_Access]] = {}
        self.races: dict[tuple[str, str, str], Race] = {}

    @staticmethod
    def _before(a: _Access, clock: list[int]) -> bool:
        return a.epoch <= clock[a.lane]

    def _race(self, a: _Access, b: _Access, key: int, kind: str) -> None:
        first, second = (a, b) if a.order <= b.order else (b, a)
        storage = "" if key == -1 else self.owner.get(key, "?")
        self.races.setdefault((first.node, second.node, storage), Race(first.node, second.node, storage, kind))

    def read(self, key: int, acc: _Access, clock: list[int]) -> None:
        w = self.write.get(key)
        if w is not None and not self._before(w, clock):
            self._race(w, acc, key, "write-read")
        self.reads.setdefault(key, []).append(acc)

    def do_write(self, key: int, acc: _Access, clock: list[int]) -> None:
        w = self.write.get(key)
        if w is not None and not self._before(w, clock):
            self._race(w, acc, key, "write-write")
        for r in self.reads.get(key, ()):
            if r.node != acc.node and not self._before(r, clock):
                self._race(r, acc, key, "read-write")
        self.write[key] = acc
        self.reads[key] = []


class _Sim:
    def __init__(self, plan: _Plan, inputs: Sequence[Any], seed: int, poison: bool, replay: bool) -> None:
        self.plan = plan
        self.seed = seed
        self.poison = poison
        self.replay = replay
        self.ref: dict[fx.Node, Any] = {}
        n = plan.nlanes
        self.host = n
        self.clock = [[0] * (n + 1) for _ in range(n + 1)]
        self.queues: list[deque] = [deque() for _ in range(n)]
        self.env: dict[fx.Node, Any] = {}
        self.keep: list[Any] = []
        self.free_list: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.handed: dict[fx.Node, list[torch.Tensor]] = {}
        self.issue_clock: dict[Any, list[int]] = {}
        self.done: set[Any] = set()
        self.record_clock: dict[fx.Node, list[int]] = {}
        self.last_record: dict[Any, fx.Node] = {}
        self.bound: dict[fx.Node, fx.Node | None] = {}
        self.blocked_on: fx.Node | None = None
        self.pos = 0
        self.trace: list[str] = []
        self.mem = _Memory()
        self.reused = 0
        self.inputs = [_clone(x) for x in inputs]
        self.outputs: Any = None
        self.copy_in: dict[fx.Node, list[torch.Tensor]] = {}
        self.executed: list[_Access] = []  # compute nodes, for the serialization check
        self.serialized: list[tuple[_Access, list[int]]] = []
        self.cur_seg: int | None = None
        self.begun: dict[int, int] = {}
        self.ended: set[int] = set()
        self.aux_last: dict[tuple[int, int], tuple[str, int]] = {}
        self.clock_at_done: dict[fx.Node, list[int]] = {}
        self._next_input = 0

    # -- bookkeeping ---
    def _tick(self, p: int) -> list[int]:
        c = self.clock[p]
        c[p] += 1
        return c

    @staticmethod
    def _join(into: list[int], other: list[int]) -> None:
        for i, v in enumerate(other):
            if v > into[i]:
                into[i] = v

    def _own(self, value: Any, node: fx.Node) -> None:
        for t in _tensors(value):
            key = _storage_key(t)
            if key is not None:
                self.mem.owner.setdefault(key, node.name)
        self.keep.append(value)

    def _reads(self, node: fx.Node) -> list[torch.Tensor]:
        out = []
        for a in node.all_input_nodes:
            if analysis.carries_tensor(a) or a.op in ("placeholder", "get_attr"):
                out.extend(_tensors(self.env.get(a)))
        return out

    # -- the host ---
    def host_runnable(self) -> bool:
        if self.pos >= len(self.plan.nodes):
            return False
        if self.blocked_on is not None:
            if self.blocked_on not in self.done:
                return False
        return True

    def host_step(self) -> None:
        if self.blocked_on is not None:
            self._join(self.clock[self.host], self.clock_at_done[self.blocked_on])
            self.blocked_on = None
        node = self.plan.nodes[self.pos]
        kind = self.plan.kind[node]
        hc = self._tick(self.host)
        if self.plan.captured:
            self._capture_marks(node, hc)
        lane = meta.lane_of(node).index
        if kind == "input":
            # The caller writes the inputs on the main lane (into the static input buffers,
            # before a replay): a lane that reads one before it forks from main sees poison.
            value = self.inputs[self._next_input]
            self._next_input += 1
            if self.replay and node in self.plan.unretained:
                for t in _tensors(value):
                    _poison(t)
            self.env[node] = value
            self._own(value, node)
            if any(t.numel() for t in _tensors(value)):
                self.copy_in[node] = [t.clone() for t in _tensors(value)]
                for t in _tensors(value):
                    _poison(t)
                self.issue_clock[node] = list(hc)
                self.queues[0].append(node)
        elif kind == "constant":
            value = _clone(_fetch(self.plan.gm, node.target))
            if self.replay and node in self.plan.unretained:
                for t in _tensors(value):
                    _poison(t)
            self.env[node] = value
            self._own(value, node)
        elif kind == "host":
            self.env[node] = _run_node(node, self.env)
        elif kind in ("alloc", "mutate", "sync", "record", "wait", "output"):
            if kind == "alloc":
                buf = _buffer_like(self.ref[node])
                self.env[node] = buf
                self._own(buf, node)
                if self.free_list[lane]:
                    self.handed[node] = self.free_list[lane]
                    self.free_list[lane] = []
            elif kind == "mutate":
                # The value is the mutated argument itself (the schema says so).
                self.env[node] = self.env[_mutated_arg(node)]
            elif kind == "record":
                self.last_record[self._event_key(node)] = node
            elif kind == "wait":
                self.bound[node] = self.last_record.get(self._event_key(node))
            elif kind == "sync":
                self.blocked_on = node
            if kind == "output":
                lane = 0
            self.issue_clock[node] = list(hc)
            self.queues[lane].append(node)
        # release and retain: host bookkeeping only; the free below is what a release delays.
        for root in self.plan.frees.get(self.pos, ()):
            block = self.env.get(root)
            if isinstance(block, torch.Tensor):
                self.free_list[meta.lane_of(root).index].append(block)
        self.pos += 1

    def _capture_marks(self, node: fx.Node, hc: list[int]) -> None:
        """Begins and ends the capture of each segment on the main lane, as the host would."""
        rec = meta.info(node)
        if meta.effect_of(node) in (Effect.INPUT, Effect.CONSTANT):
            return
        seg = rec.segment.index if rec.segment is not None and rec.brk is None and node.op != "output" else None
        if seg == self.cur_seg:
            return
        marks = []
        if self.cur_seg is not None:
            marks.append(_Mark("end", self.cur_seg))
        if seg is not None:
            marks.append(_Mark("begin", seg))
        self.cur_seg = seg
        for mark in marks:
            self.issue_clock[mark] = list(hc)
            self.queues[0].append(mark)

    def _captured_on(self, node: fx.Node, lane: int, clock: list[int]) -> None:
        """Work on an auxiliary lane is captured only between its fork and its join."""
        rec = meta.info(node)
        if rec.segment is None or rec.brk is not None:
            return
        seg = rec.segment.index
        if seg in self.ended:
            self.mem.races.setdefault(
                (node.name, f"end of capture k{seg}", ""),
                Race(node.name, f"end of capture k{seg}", "", "capture"),
            )
        elif clock[0] < self.begun.get(seg, 1 << 60):
            self.mem.races.setdefault(
                (f"begin of capture k{seg}", node.name, ""),
                Race(f"begin of capture k{seg}", node.name, "", "capture"),
            )
        self.aux_last[(seg, lane)] = (node.name, clock[lane])

    def _mark(self, mark: _Mark, clock: list[int]) -> None:
        if mark.what == "begin":
            self.begun[mark.segment] = clock[0]
            return
        self.ended.add(mark.segment)
        for (seg, lane), (name, epoch) in self.aux_last.items():
            if seg == mark.segment and clock[lane] < epoch:
                self.mem.races.setdefault(
                    (name, mark.name, ""), Race(name, mark.name, "", "capture")
                )

    @staticmethod
    def _event_key(node: fx.Node) -> Any:
        rec = meta.info(node)
        return rec.lease if rec.lease is not None else ("event", rec.event)

    # -- the lanes ---
    def lane_runnable(self, lane: int) -> bool:
        q = self.queues[lane]
        if not q:
            return False
        head = q[0]
        if isinstance(head, _Mark):
            return True
        if self.plan.kind[head] == "wait":
            rec = self.bound.get(head)
            return rec is None or rec in self.done
        return True

    def lane_step(self, lane: int) -> None:
        node = self.queues[lane].popleft()
        c = self.clock[lane]
        self._join(c, self.issue_clock[node])
        c[lane] += 1
        if isinstance(node, _Mark):
            self.trace.append(f"s{lane}:{node.name}")
            self._mark(node, c)
            return
        kind = self.plan.kind[node]
        acc = _Access(node.name, self.plan.order[node], lane, c[lane])
        self.trace.append(f"s{lane}:%{node.name}")
        if kind == "input":
            for t, v in zip(_tensors(self.env[node]), self.copy_in.pop(node)):
                with torch.no_grad():
                    t.copy_(v)
                key = _storage_key(t)
                if key is not None:
                    self.mem.do_write(key, acc, c)
        elif kind == "record":
            self.record_clock[node] = list(c)
        elif kind == "wait":
            rec = self.bound.get(node)
            if rec is not None:
                self._join(c, self.record_clock[rec])
        elif kind == "output":
            for t in self._reads(node):
                key = _storage_key(t)
                if key is not None:
                    self.mem.read(key, acc, c)
            self.outputs = fx.node.map_arg(node.args[0], lambda n: _clone(self.env[n]))
        else:
            for t in self._reads(node):
                key = _storage_key(t)
                if key is not None:
                    self.mem.read(key, acc, c)
            for block in self.handed.pop(node, ()):
                key = _storage_key(block)
                if key is not None:
                    self.mem.do_write(key, acc, c)
                if self.poison:
                    _poison(block)
                self.reused += 1
            if effects.is_random(node):
                # Hidden state: each draw reads and advances the generator's offset.
                self.mem.owner.setdefault(_RNG_KEY, "rng")
                self.mem.do_write(_RNG_KEY, acc, c)
            value = _run_node(node, self.env)
            if kind == "alloc":
                _copy_into(self.env[node], value)
                written = _tensors(self.env[node])
            elif kind == "mutate":
                written = _tensors(self.env[node])
            else:  # sync: a host value
                self.env[node] = value
                written = []
            for t in written:
                key = _storage_key(t)
                if key is not None:
                    self.mem.do_write(key, acc, c)
        if kind in ("alloc", "mutate", "sync"):
            self._check_serialized(node, acc, c)
        if lane != 0 and self.plan.captured and kind != "input":
            self._captured_on(node, lane, c)
        self.clock_at_done[node] = list(c)
        self.done.add(node)

    def _check_serialized(self, node: fx.Node, acc: _Access, clock: list[int]) -> None:
        """A serialized op (capability ``overlap="serialize"``) is ordered with every other node;
        a joined one (``"join"``) after every node issued before it."""
        for s_acc, s_clock in self.serialized:  # serialized ops that ran before this node
            if s_acc.lane != acc.lane and not _Memory._before(s_acc, clock) and not _Memory._before(acc, s_clock):
                self.mem._race(s_acc, acc, -1, "serialize")
        cap = meta.info(node).capability
        if cap is not None and cap.overlap != Overlap.SAFE:
            for other in self.executed:
                if other.lane != acc.lane and not _Memory._before(other, clock):
                    self.mem._race(other, acc, -1, cap.overlap)
            if cap.overlap == Overlap.SERIALIZE:
                self.serialized.append((acc, list(clock)))
        self.executed.append(acc)

    def run(self) -> SimResult:
        n = self.plan.nlanes
        sched = _Scheduler(self.seed, n, 2 * len(self.plan.nodes))
        while True:
            runnable = [lane for lane in range(n) if self.lane_runnable(lane)]
            if self.host_runnable():
                runnable.append(self.host)
            if not runnable:
                break
            who = sched.pick(runnable)
            if who == self.host:
                self.host_step()
            else:
                self.lane_step(who)
        if self.pos < len(self.plan.nodes) or any(self.queues):
            stuck = []
            for lane, q in enumerate(self.queues):
                if q:
                    head = q[0]
                    rec = self.bound.get(head)
                    stuck.append(f"s{lane} at %{head.name}" + (f" (waits for %{rec.name})" if rec is not None else ""))
            if self.pos < len(self.plan.nodes):
                stuck.append(f"host at %{self.plan.nodes[self.pos].name}")
            raise SimulationError(f"deadlock: {', '.join(stuck)}")
        return SimResult(self.outputs, self.inputs, self.trace, sorted(self.mem.races.values()), self.reused)


def _reference(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """Every node's value in serial execution (``inputs`` are used as they are)."""
    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "get_attr":
            env[node] = _clone(_fetch(gm, node.target))
        elif meta.effect_of(node) is Effect.COMPUTE:
            env[node] = _run_node(node, env)
    return env


def simulate(
    gm_or_program: Any,
    inputs: Sequence[Any],
    seed: int = 0,
    *,
    poison: bool = True,
    replay: bool = False,
    _plan: _Plan | None = None,
    _ref: dict[fx.Node, Any] | None = None,
) -> SimResult:
    """Runs the graph once in the interleaving chosen by ``seed``.

    Args:
        gm_or_program: the annotated ATen graph after the pipeline, or its emitted Program.
        inputs: real input values (copied; the caller's are not changed).
        seed: picks the interleaving.
        poison: poison reused and fresh blocks (off: only the race check finds bugs).
        replay: simulate a replay after capture: unretained static inputs and constants of
            captured segments are freed and reused first.

    Raises:
        SimulationError: the lanes deadlock (a wait on a record that can never run).
    """
    plan = _plan or _plan_of(gm_or_program)
    sim = _Sim(plan, inputs, seed, poison, replay)
    with seeded_rng():
        sim.ref = _ref if _ref is not None else _reference(plan.gm, [_clone(x) for x in inputs])
    with seeded_rng():
        return sim.run()


def explore(
    gm_or_program: Any, inputs: Sequence[Any], seeds: Iterable[int] = range(20), *, replay: bool = False
) -> Report:
    """Simulates every seed and compares each result with serial execution."""
    plan = _plan_of(gm_or_program)
    expected, expected_inputs = serial(plan.gm, inputs)
    with seeded_rng():
        ref = _reference(plan.gm, [_clone(x) for x in inputs])
    report = Report()
    races: set[Race] = set()
    for seed in seeds:
        report.runs += 1
        try:
            res = simulate(gm_or_program, inputs, seed, replay=replay, _plan=plan, _ref=ref)
        except SimulationError as exc:
            report.deadlocks.append((seed, str(exc)))
            continue
        report.reused += res.reused
        races.update(res.races)
        why = same(res.outputs, expected)
        if why is None:
            why = same(res.inputs, expected_inputs)
            if why is not None:
                why = f"inputs after the run: {why}"
        if why is not None:
            report.mismatches.append((seed, why))
    pairs: dict[tuple[str, str, str], Race] = {}
    for race in sorted(races):
        pairs.setdefault((race.first, race.second, race.storage), race)
    report.races = sorted(pairs.values())
    return report
