"""Helpers of the end-to-end backend tests.

They compile through ``torch.compile(..., backend="capturepass")``, collect the
graph records the backend made (``capturepass.backends.compile.last_compiled``)
and check them with an oracle written independently of the verifier: a
happens-before relation built only from program order per lane and the
record/wait pairs present in the graph.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx

from capturepass.backends.compile import CompiledGraph, last_compiled
from capturepass.ir import meta
from capturepass.ir.meta import Effect


@contextlib.contextmanager
def new_compiles() -> Iterator[list[CompiledGraph]]:
    """Collects the graph records capturepass makes inside the block, oldest first."""
    before = last_compiled()  # holds the old records, so identity comparison is sound
    out: list[CompiledGraph] = []
    try:
        yield out
    finally:
        out.extend(r for r in last_compiled() if not any(r is b for b in before))


def compile_eager(model: Any, **options: Any) -> Any:
    """``torch.compile`` with the capturepass backend and the eager inner compiler."""
    dynamic = options.pop("dynamic", None)
    options.setdefault("inner", "eager")
    return torch.compile(model, backend="capturepass", options=options, dynamic=dynamic)


def unwrap(exc: BaseException) -> BaseException:
    """The error the backend raised: Dynamo wraps backend errors in ``BackendCompilerFailed``."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(exc, BackendCompilerFailed):
        return exc.inner_exception
    return exc


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that do work on a lane (not inputs, sync nodes or the output)."""
    return [
        n for n in gm.graph.nodes
        if meta.effect_of(n) is Effect.COMPUTE and n.op == "call_function"
    ]


def sync_nodes(gm: fx.GraphModule, effect: Effect) -> list[fx.Node]:
    """Nodes with ``effect`` (records, waits, ...), in program order."""
    return [n for n in gm.graph.nodes if meta.effect_of(n) is effect]


def lane_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """The name of the lane ``node`` runs on."""
    return meta.graph_info(gm).lane_name(meta.lane_of(node))


def from_function(node: fx.Node, fn_name: str) -> bool:
    """Whether ``node`` was traced inside a Python function named ``fn_name``."""
    trace = node.meta.get("stack_trace") or ""
    return re.search(rf", in {re.escape(fn_name)}\b", trace) is not None


def carries_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


class HappensBefore:
    """Happens-before on a GPU: program order on each lane, plus every record -> wait of one event."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.succ: dict[fx.Node, list[fx.Node]] = {n: [] for n in gm.graph.nodes}
        last_on_lane: dict[int, fx.Node] = {}
        records: dict[Any, list[fx.Node]] = {}
        waits: dict[Any, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            lane = meta.lane_of(node).index
            if lane in last_on_lane:
                self.succ[last_on_lane[lane]].append(node)
            last_on_lane[lane] = node
            rec = meta.info(node)
            if rec.effect is Effect.RECORD:
                records.setdefault(rec.event, []).append(node)
            elif rec.effect is Effect.WAIT:
                waits.setdefault(rec.event, []).append(node)
        for event, ws in waits.items():
            for r in records.get(event, []):
                for w in ws:
                    self.succ[r].append(w)
        self._reach: dict[fx.Node, set[fx.Node]] = {}

    def reachable(self, a: fx.Node) -> set[fx.Node]:
        if a not in self._reach:
            seen: set[fx.Node] = set()
            stack = [a]
            while stack:
                n = stack.pop()
                for s in self.succ[n]:
                    if s not in seen:
                        seen.add(s)
                        stack.append(s)
            self._reach[a] = seen
        return self._reach[a]

    def __call__(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether ``a`` is ordered before ``b``."""
        return b in self.reachable(a)


def cross_lane_reads(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Every (producer, consumer) pair where a tensor crosses lanes."""
    edges = []
    for node in gm.graph.nodes:
        eff = meta.effect_of(node)
        if eff not in (Effect.COMPUTE, Effect.OUTPUT):
            continue
        for p in node.all_input_nodes:
            if carries_tensor(p) and meta.lane_of(p) != meta.lane_of(node):
                edges.append((p, node))
    return edges


def assert_cross_lane_reads_ordered(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Every tensor read on another lane than its producer's is ordered after it; returns the edges."""
    hb = HappensBefore(gm)
    edges = cross_lane_reads(gm)
    bad = [f"%{p.name} ({lane_name(gm, p)}) -> %{c.name} ({lane_name(gm, c)})" for p, c in edges if not hb(p, c)]
    assert not bad, "cross-lane reads without a record/wait ordering them: " + ", ".join(bad)
    return edges


def assert_waits_well_formed(gm: fx.GraphModule) -> None:
    """Every wait follows a record of its event made on another lane."""
    recorded: dict[Any, fx.Node] = {}
    for node in gm.graph.nodes:
        rec = meta.info(node)
        if rec.effect is Effect.RECORD:
            recorded[rec.event] = node
        elif rec.effect is Effect.WAIT:
            r = recorded.get(rec.event)
            assert r is not None, f"wait %{node.name} for {rec.event} has no earlier record"
            assert meta.lane_of(r) != meta.lane_of(node), f"wait %{node.name} waits for its own lane"


# What a lane's stream does; a release or a retention only drops or keeps host references.
STREAM_EFFECTS = (Effect.COMPUTE, Effect.RECORD, Effect.WAIT)


def assert_main_joins(gm: fx.GraphModule) -> None:
    """Before the output, the main lane runs after the last stream operation of every auxiliary lane."""
    hb = HappensBefore(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    last: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if meta.effect_of(node) in STREAM_EFFECTS:
            last[meta.lane_of(node).index] = node
    for lane, node in last.items():
        if lane != 0:
            assert hb(node, output), f"lane s{lane} (last node %{node.name}) is not joined before the output"


def lanes_used(gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None) -> set[str]:
    """Names of the lanes ``nodes`` (default: every compute node) run on."""
    return {lane_name(gm, n) for n in (compute_nodes(gm) if nodes is None else nodes)}


def kernels(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """The nodes that launch work (no views, no tuple selections)."""
    out = []
    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        if n.target is operator.getitem:
            continue
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            continue
        out.append(n)
    return out
