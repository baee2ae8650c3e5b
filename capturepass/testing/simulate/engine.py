"""The interleaving engine: the host and each lane as queues, stepped by a seeded adversarial scheduler."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import SimulationError
from capturepass.ir import analysis, effects, meta
from capturepass.ir.meta import Effect, Overlap
from capturepass.testing.simulate.graph import _fetch, _mutated_arg, _Plan
from capturepass.testing.simulate.memory import (
    _RNG_KEY,
    Race,
    SimResult,
    _Access,
    _buffer_like,
    _clone,
    _copy_into,
    _Memory,
    _poison,
    _run_node,
    _storage_key,
    _tensors,
)


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
