"""Schedule candidates of one graph: the cost model's, and the cheaper ones derived from it.

The runtime measures these as captured graphs and keeps the fastest per shape
(:mod:`capturepass.runtime.pick`). Two kinds:

- ``model``: the cost model's schedule (the graph's own, always first), and ``one_lane``:
  every kernel on the main lane (``policy="off"``, ``max_aux_lanes=0``). Each is a program of
  its own: ``one_lane`` is derived at compile time by running the passes again, and its
  regions are compiled (once more through the inner compiler) before the first capture.
- **lane maps of the cost model's program**, compiled once for all: the same program run with
  some lanes merged onto the stream of another (:attr:`Candidate.lane_map`; the owner that
  captures it gives merged lanes one stream). Merging is always correct: the program issues
  its kernels in a topological order, so work put on one stream runs in an order its
  dependencies allow, and the waits between lanes stay where they were. Their names:

  - ``auxK``: the ``K`` busiest auxiliary lanes (by the cost model) keep a stream each, the
    others run on the main stream, for each ``K`` below what the cost model used (policy
    ``auto`` only);
  - ``merged``: every lane whose estimated busy time is below :data:`SHORT_FRACTION` of the
    busiest lane's runs on the main stream.

  A map that puts every lane on the main stream is no candidate: on the H200 the cost model's
  program run that way took 7 to 13% longer than ``one_lane``'s own compile (Llama and
  Qwen2-MoE decoders, decode and prefill; BENCHMARKS.md, fifteenth run): the sync points left
  on one lane bound Inductor's fusion and its buffers are not reused across lanes.

A program compiled with **lanes after fusion** (``regions="fused"``, the default on CUDA;
``backends.fused_lanes``) is one compile for all: ``model`` is its code run with side streams,
``one_lane`` the same code run without (one lane's own fusion and frees, so it counts as one
lane's own program), and ``auxK`` / ``merged`` its lanes merged onto fewer streams.

Candidates that put every kernel on the same stream as an earlier one of their kind are one
candidate (the earlier name is kept). A graph whose cost model used one lane has one
candidate, and nothing is measured.
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
        lanes: how many streams it runs on.
        estimate_us: the cost model's makespan of its schedule (records and waits included).
        graph: its annotated graph (a lane map's: the cost model's).
        plan: what ``emit`` planned for it (a lane map's: the cost model's).
        lane_map: for a candidate that runs the cost model's program with lanes merged, the
            stream of each of its lanes (``0`` the main one); ``None`` for a program of its own.
        own_one_lane: whether it runs one lane's own code (its own compile, or a program
            compiled with lanes after fusion run without side streams), though it has a
            ``lane_map``.
        fused: whether its program was compiled with lanes after fusion (part of the schedule
            cache's key: another route's measured choice says nothing of this one's).
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
    lane_map: tuple[int, ...] | None = None
    own_one_lane: bool = False
    fused: bool = False

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


def assignment(gm: fx.GraphModule, lane_map: Sequence[int] | None = None) -> tuple[int, tuple[tuple[str, int], ...]]:
    """The stream count and every kernel's stream (its lane, through ``lane_map`` when given):
    two candidates with equal ones are one schedule."""
    lanes = []
    for node in gm.graph.nodes:
        if meta.effect_of(node) is meta.Effect.COMPUTE:
            lane = meta.lane_of(node).index
            lanes.append((node.name, lane_map[lane] if lane_map is not None else lane))
    count = len(set(lane_map)) if lane_map is not None else len(meta.graph_info(gm).lanes)
    return count, tuple(lanes)


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


def estimate_us(gm: fx.GraphModule, lane_map: Sequence[int] | None = None) -> float:
    """The cost model's makespan of an annotated graph on per-lane clocks (the schedule
    ``capturepass show`` simulates from the dump): kernels take their roofline time, a wait
    starts its lane no earlier than its event's record, a break runs after everything before it.
    With ``lane_map``, lanes it merges share a clock (one stream)."""
    clocks: dict[int, float] = {0: 0.0}
    stamps: dict[Any, float] = {}
    for node in gm.graph.nodes:
        effect = meta.effect_of(node)
        if effect in (meta.Effect.INPUT, meta.Effect.CONSTANT, meta.Effect.OUTPUT):
            continue
        rec = meta.info(node)
        lane = meta.lane_of(node).index
        if lane_map is not None:
            lane = lane_map[lane]
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


def estimated_lane_ratio(gm: fx.GraphModule) -> float | None:
    """The cost model's makespan of ``gm``'s lanes over that of its kernels on one stream
    (``None``: one lane, or nothing to time)."""
    lanes = len(meta.graph_info(gm).lanes)
    if lanes < 2:
        return None
    one = estimate_us(gm, (0,) * lanes)
    return estimate_us(gm) / one if one > 0 else None


# The options of the one-lane candidate's compile.
ONE_LANE_OVERRIDES: dict[str, Any] = {"policy": "off", "max_aux_lanes": 0}


def variants(model: fx.GraphModule) -> list[tuple[str, dict[str, Any]]]:
    """The candidates with programs of their own beside the cost model's: names and option
    overrides, given the cost model's graph."""
    if len(meta.graph_info(model).lanes) < 2:
        return []
    return [("one_lane", dict(ONE_LANE_OVERRIDES))]


def lane_maps(model: fx.GraphModule, opts: Options) -> list[tuple[str, tuple[int, ...]]]:
    """The candidates that run the cost model's program with lanes merged: names and lane maps
    (each lane's stream: ``0`` the main one, then ``1..K`` in the order of the lanes kept)."""
    lanes = len(meta.graph_info(model).lanes)
    if lanes < 2:
        return []
    busy = lane_busy_us(model)
    aux = sorted((i for i in range(lanes) if i != MAIN_LANE.index), key=lambda i: (-busy.get(i, 0.0), i))

    def keeping(kept: Sequence[int]) -> tuple[int, ...]:
        streams = {lane: k for k, lane in enumerate(sorted(kept), start=1)}
        return tuple(streams.get(i, 0) for i in range(lanes))

    out: list[tuple[str, tuple[int, ...]]] = []
    if opts.policy == "auto":
        out += [(f"aux{k}", keeping(aux[:k])) for k in range(lanes - 2, 0, -1)]
    threshold = SHORT_FRACTION * max(busy.values(), default=0.0)
    if any(busy.get(i, 0.0) < threshold for i in aux):
        out.append(("merged", keeping([i for i in aux if busy.get(i, 0.0) >= threshold])))
    return [(name, lane_map) for name, lane_map in out if max(lane_map) > 0]


def derive(
    model: fx.GraphModule, model_plan: Any, model_program: Any, opts: Options,
    plan_with: Callable[[dict[str, Any]], tuple[fx.GraphModule, Any]],
    compile_plan: Callable[[Any], Any],
) -> list[Candidate]:
    """The schedule candidates of a graph, deduplicated by the stream of each kernel, the cost
    model's first, then those with programs of their own, then the cost model's lane maps.

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
    if getattr(model_program, "code_lanes", 0):
        return _fused(first, opts)
    if getattr(model_program, "fused", False):
        return [first]  # compiled with lanes after fusion, and no kernel left on a side lane
    out = [first]
    own = {assignment(model): first.name}
    for name, overrides in variants(model):
        gm, plan = plan_with(overrides)
        sig = assignment(gm)
        if sig in own:
            continue
        own[sig] = name
        out.append(Candidate(name, overrides, sig[0], estimate_us(gm), gm, plan, None, compile_plan))
    mapped = {assignment(model): first.name}
    for name, lane_map in lane_maps(model, opts):
        sig = assignment(model, lane_map)
        if sig in mapped:
            continue
        mapped[sig] = name
        out.append(Candidate(name, {}, sig[0], estimate_us(model, lane_map), model, model_plan, model_program,
                             compile_plan, lane_map=lane_map))
    return out


def _fused(first: Candidate, opts: Options) -> list[Candidate]:
    """The candidates of a program compiled with lanes after fusion: all of them that one
    compile. One lane is its code without side streams (one lane's own, frees included);
    the cost model's, fewer lanes and short lanes merged back are its lanes' code with lanes
    merged onto fewer streams."""
    model, program = first.graph, first.program
    first.fused = True
    lanes = len(meta.graph_info(model).lanes)
    one = Candidate("one_lane", dict(ONE_LANE_OVERRIDES), 1, estimate_us(model, (0,) * lanes), model, first.plan,
                    program, lane_map=(0,) * lanes, own_one_lane=True, fused=True)
    out, seen = [first, one], {assignment(model), assignment(model, (0,) * lanes)}
    for name, lane_map in lane_maps(model, opts):
        sig = assignment(model, lane_map)
        if sig in seen:
            continue
        seen.add(sig)
        out.append(Candidate(name, {}, sig[0], estimate_us(model, lane_map), model, first.plan, program,
                             lane_map=lane_map, fused=True))
    return out


def graph_key(gm: fx.GraphModule, opts: Options, candidates: Sequence[Candidate], breaks: Sequence[str] = ()) -> str:
    """A stable hash of a graph before lane assignment, the options that change its schedule,
    the candidates' names (and whether they are lanes after fusion), the nodes made breaks after
    a failed capture and the torch build (the graph part of the schedule cache's key)."""
    parts = [str(gm.graph), opts.key(), [f"{c.name}@fused" if getattr(c, "fused", False) else c.name
                                         for c in candidates], list(breaks), torch.__version__]
    vals = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta.get("val")
            vals.append(str(getattr(v, "dtype", type(v).__name__)))
    parts.append(vals)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]
