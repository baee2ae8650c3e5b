"""The outer program: regions and ``capturepass::`` ops, run in program order.

``Program.build`` turns emit's step list into an FX graph whose nodes call the
compiled regions and the owner's runtime (record, wait, release, retain, by
integer handle), and lets FX generate its Python code. The generated code drops
every value right after its last use, which is exactly where ``insert_syncs``
put a ``release`` when the default free would have raced another lane.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.ir import meta
from capturepass.ir.meta import LaneId
from capturepass.runtime.owner import GraphOwner


@dataclasses.dataclass
class Step:
    """One step of the outer program: a region, or a ``capturepass::`` op."""

    kind: str  # "region", "record", "wait", "release", "retain"
    lane: LaneId
    payload: Any


@dataclasses.dataclass
class RegionSpec:
    """One compiled region.

    Attributes:
        index: the region's number in program order.
        lane: the lane index it runs on.
        segment: its segment index, or ``None`` for a break run eagerly.
        eager: whether it is a non-capturable break.
        fn: the inner compiler's callable (takes the inputs, returns a sequence).
        inputs / outputs: the annotated-graph nodes it reads and provides.
        graph: its standalone FX graph (for dumps and debugging).
        compiler: which inner compiler produced ``fn``.
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


class RegionCall:
    """The callable an outer-program node invokes for one region."""

    def __init__(self, spec: RegionSpec, owner: GraphOwner) -> None:
        self.spec = spec
        self.__name__ = f"region_{spec.index}"
        self.__qualname__ = self.__name__
        self._fn = spec.fn
        self._run = owner.lanes.region_runner(spec.lane)

    def __call__(self, *args: Any) -> Sequence[Any]:
        return self._run(self._fn, args)

    def __repr__(self) -> str:
        return f"<region {self.spec.index} on s{self.spec.lane} ({self.spec.compiler})>"


class Program:
    """A compiled graph: the outer program and the owner that runs it."""

    def __init__(self, outer: fx.GraphModule, regions: list[RegionSpec], owner: GraphOwner) -> None:
        self.outer = outer
        self.regions = regions
        self.owner = owner

    @classmethod
    def build(cls, gm: fx.GraphModule, steps: list[Step], owner: GraphOwner | None = None) -> "Program":
        """Builds the outer program for an annotated graph ``gm`` from emit's steps."""
        gi = meta.graph_info(gm)
        owner = owner or GraphOwner.for_graph(gi)
        outer = fx.Graph()
        root = torch.nn.Module()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = outer.placeholder(node.name)
            elif node.op == "get_attr":
                setattr(root, node.target.replace(".", "_"), _fetch_attr(gm, node.target))
                env[node] = outer.get_attr(node.target.replace(".", "_"))
        regions: list[RegionSpec] = []
        lanes = owner.lanes
        for step in steps:
            if step.kind == "region":
                spec: RegionSpec = step.payload
                regions.append(spec)
                call = outer.call_function(RegionCall(spec, owner), tuple(env[n] for n in spec.inputs))
                for k, out in enumerate(spec.outputs):
                    env[out] = outer.call_function(operator.getitem, (call, k))
                continue
            node: fx.Node = step.payload
            rec = meta.info(node)
            if step.kind in ("record", "wait"):
                handle = owner.lease_handle(rec.lease)
                fn = lanes.record if step.kind == "record" else lanes.wait
                outer.call_function(fn, (handle, step.lane.index))
            elif step.kind == "release":
                outer.call_function(lanes.release, tuple(env[a] for a in node.all_input_nodes))
            elif step.kind == "retain":
                seg = rec.segment.index if rec.segment is not None else -1
                handles = tuple(owner.resource_handle(r) for r in rec.resources)
                outer.call_function(owner.retain, (seg, handles) + tuple(env[a] for a in node.all_input_nodes))
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outer.output(fx.node.map_arg(out_node.args[0], lambda n: env[n]))
        outer_gm = fx.GraphModule(root, outer, class_name="CapturePassProgram")
        return cls(outer_gm, regions, owner)

    def __call__(self, *args: Any) -> Any:
        return self.outer(*args)

    def code(self) -> str:
        """The generated Python of the outer program (for dumps)."""
        return self.outer.code


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["Program", "RegionCall", "RegionSpec", "Step"]
