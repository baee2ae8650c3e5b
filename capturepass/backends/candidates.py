"""Schedule candidates of one graph: the cost model's, and the cheaper ones derived from it.

The runtime measures these as captured graphs and keeps the fastest per shape
(:mod:`capturepass.runtime.pick`). Derived at compile time from the graph as it was
before the passes, each by running the passes again with other scheduling options
(never the inner compiler: a candidate's regions are compiled when it is first
measured, so a compile costs the passes once more per candidate, and Inductor only
for the candidates that run):

- ``model``: the cost model's schedule (the graph's own; always first);
- ``one_lane``: every kernel on the main lane (``policy="off"``, ``max_aux_lanes=0``);
- ``auxK``: at most ``K`` auxiliary lanes, for each ``K`` below what the cost model
  used (policy ``auto`` only: hinted lanes beyond ``K`` would fold with a warning);
- ``merged``: the cost model's schedule with every lane whose estimated busy time is
  below :data:`SHORT_FRACTION` of the busiest lane's put back on the main lane
  (``merge_lanes_below_us``).

Candidates that assign every kernel to the same lane as an earlier one are one
candidate (the earlier name is kept). A graph whose cost model used one lane has
one candidate, and nothing is measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.ir import cost, meta
from capturepass.ir.meta import MAIN_LANE
from capturepass.ir.options import Options

# A lane busy for less than this fraction of the busiest lane is "short" (the merged candidate).
SHORT_FRACTION = 0.2


@dataclasses.dataclass
class Candidate:
    """One schedule candidate.

    Attributes:
        name: ``model``, ``one_lane``, ``auxK`` or ``merged``.
        overrides: the options it was compiled with, beside the graph's own.
        lanes: how many lanes it uses.
        estimate_us: the cost model's makespan of its schedule (records and waits included).
        graph: its annotated graph.
        plan: what ``emit`` planned for it.
    """

    name: str
    overrides: dict[str, Any]
    lanes: int
    estimate_us: float
    graph: fx.GraphModule
    plan: Any
    _program: Any = None
    _compile: Callable[[Any], Any] | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def compiled(self) -> bool:
        """Whether its regions are compiled."""
        return self._program is not None

    @property
    def program(self) -> Any:
        """Its program, compiling its regions on first use.

        Raises:
            EmitError: the inner compiler failed on one of its regions.
        """
        with self._lock:
            if self._program is None:
                assert self._compile is not None
                self._program = self._compile(self.plan)
            return self._program


def assignment(gm: fx.GraphModule) -> tuple[int, tuple[tuple[str, int], ...]]:
    """The lane count and every kernel's lane: two candidates with equal ones are one schedule."""
    lanes = []
    for node in gm.graph.nodes:
        if meta.effect_of(node) is meta.Effect.COMPUTE:
            lanes.append((node.name, meta.lane_of(node).index))
    return len(meta.graph_info(gm).lanes), tuple(lanes)


def lane_busy_us(gm: fx.GraphModule) -> dict[int, float]:
    """The cost model's busy time of each lane (microseconds; kernels only)."""
    busy: dict[int, float] = {i: 0.0 for i in range(len(meta.graph_info(gm).lanes))}
    for node in gm.graph.nodes:
        if meta.effect_of(node) is not meta.Effect.COMPUTE:
            continue
        c = meta.info(node).cost
        if c is not None:
            busy[meta.lane_of(node).index] = busy.get(meta.lane_of(node).index, 0.0) + cost.node_time(c) * 1e6
    return busy


# Records and waits take no device time; the hair ``show`` gives them keeps the two estimates equal.
SYNC_US = 0.01


def estimate_us(gm: fx.GraphModule) -> float:
    """The cost model's makespan of an annotated graph on per-lane clocks (the schedule
    ``capturepass show`` simulates from the dump): kernels take their roofline time, a wait
    starts its lane no earlier than its event's record, a break runs after everything before it."""
    clocks: dict[int, float] = {0: 0.0}
    stamps: dict[Any, float] = {}
    for node in gm.graph.nodes:
        effect = meta.effect_of(node)
        if effect in (meta.Effect.INPUT, meta.Effect.CONSTANT, meta.Effect.OUTPUT):
            continue
        rec = meta.info(node)
        lane = meta.lane_of(node).index
        clocks.setdefault(lane, 0.0)
        if effect is meta.Effect.WAIT and rec.event in stamps:
            clocks[lane] = max(clocks[lane], stamps[rec.event])
        if effect is meta.Effect.COMPUTE and rec.brk is not None:
            clocks[lane] = max(clocks.values())
        if effect is meta.Effect.COMPUTE:
            clocks[lane] += cost.node_time(rec.cost) * 1e6 if rec.cost is not None else 0.0
        elif effect in meta.SYNC_EFFECTS:
            clocks[lane] += SYNC_US
        if effect is meta.Effect.RECORD and rec.event is not None:
            stamps[rec.event] = clocks[lane]
    return max(clocks.values())


def variants(model: fx.GraphModule, opts: Options) -> list[tuple[str, dict[str, Any]]]:
    """The derived candidates' names and option overrides, given the cost model's graph."""
    lanes = len(meta.graph_info(model).lanes)
    if lanes < 2:
        return []
    out: list[tuple[str, dict[str, Any]]] = [("one_lane", {"policy": "off", "max_aux_lanes": 0})]
    if opts.policy == "auto":
        out += [(f"aux{k}", {"max_aux_lanes": k}) for k in range(lanes - 2, 0, -1)]
    busy = lane_busy_us(model)
    aux = [us for i, us in busy.items() if i != MAIN_LANE.index]
    threshold = SHORT_FRACTION * max(busy.values(), default=0.0)
    if any(us < threshold for us in aux):
        out.append(("merged", {"merge_lanes_below_us": round(threshold, 6)}))
    return out


def derive(
    model: fx.GraphModule, model_plan: Any, model_program: Any, opts: Options,
    plan_with: Callable[[dict[str, Any]], tuple[fx.GraphModule, Any]],
    compile_plan: Callable[[Any], Any],
) -> list[Candidate]:
    """The schedule candidates of a graph, deduplicated by lane assignment, the cost model's first.

    Args:
        model: the cost model's annotated graph.
        model_plan: its plan.
        model_program: its compiled program.
        opts: the graph's resolved options.
        plan_with: runs the passes on a fresh copy of the graph as it was before them with
            option overrides; returns the annotated graph and its plan (regions not compiled).
        compile_plan: compiles a plan's regions into a program.
    """
    first = Candidate("model", {}, len(meta.graph_info(model).lanes), estimate_us(model), model, model_plan,
                      model_program, compile_plan)
    out = [first]
    seen = {assignment(model): first.name}
    for name, overrides in variants(model, opts):
        gm, plan = plan_with(overrides)
        sig = assignment(gm)
        if sig in seen:
            continue
        seen[sig] = name
        out.append(Candidate(name, overrides, sig[0], estimate_us(gm), gm, plan, None, compile_plan))
    return out


def graph_key(gm: fx.GraphModule, opts: Options, candidates: Sequence[Candidate], breaks: Sequence[str] = ()) -> str:
    """A stable hash of a graph before lane assignment, the options that change its schedule,
    the candidates' names, the nodes made breaks after a failed capture and the torch build
    (the graph part of the schedule cache's key)."""
    parts = [str(gm.graph), opts.key(), [c.name for c in candidates], list(breaks), torch.__version__]
    vals = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta.get("val")
            vals.append(str(getattr(v, "dtype", type(v).__name__)))
    parts.append(vals)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]
