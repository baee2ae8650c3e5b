"""The emitted plan: what ``emit`` hands over, as data.

``emit`` cuts the annotated graph's program order into *regions* (maximal runs of
one lane's nodes between that lane's sync points, segment boundaries and breaks)
and the ``capturepass::`` steps between them. The plan says, for every region,
which nodes it holds, the standalone FX graph that computes them, the values it
reads and provides, and which inner compiler should compile it; nothing in it
is compiled or bound to a device. The backend compiles each region
(``capturepass.backends.compile``) and the runtime binds the plan with the
compiled regions to one graph owner's lanes (``capturepass.runtime.program``).
"""

from __future__ import annotations

import dataclasses
from typing import Union

import torch.fx as fx

from capturepass.ir.meta import LaneId, _StrEnum


class StepKind(_StrEnum):
    """What one step of the plan does."""

    REGION = "region"  # call a compiled region on its lane
    RECORD = "record"  # record an event on a lane
    WAIT = "wait"  # make a lane wait for an event
    RELEASE = "release"  # the point where storage may be freed (a deferred free)
    RETAIN = "retain"  # keep storage owners alive for a captured segment's life
    EXTERNAL = "external"  # join an external stream into the main lane, or out of it


@dataclasses.dataclass
class RegionPlan:
    """One region: a lane's run of nodes, to be compiled on its own.

    Attributes:
        index: the region's number in program order.
        lane: the lane index it runs on.
        segment: its segment index, or ``None`` for a break run eagerly.
        eager: whether it is a non-capturable break.
        nodes: the annotated-graph nodes it computes, in program order.
        inputs / outputs: the annotated-graph nodes it reads and provides.
        graph: its standalone FX graph (placeholders for ``inputs``, a tuple of ``outputs``).
        compiler: the inner compiler it is to be compiled with.
        kernels: whether it launches any kernel (views and host math do not).
        groups: the process groups its collectives were traced with (a collective is a
            region of its own; the runtime redirects it to the running owner's communicators).
        inline: for a segment compiled once with its lanes inline (option ``regions``), the
            sync points its graph calls (``None`` for a region of one lane).
    """

    index: int
    lane: int
    segment: int | None
    eager: bool
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    graph: fx.GraphModule
    compiler: str
    kernels: bool = True
    groups: tuple[str, ...] = ()
    inline: "Inline | None" = None


@dataclasses.dataclass(frozen=True)
class SyncPoint:
    """One call of ``capturepass::inline_step`` in a segment compiled with its lanes inline.

    It runs the plan's records, waits, releases and retentions that lie between two of the
    segment's lane regions, then makes the next region's lane current.

    Attributes:
        steps: the plan steps it runs, in order.
        lane: the lane the code after it runs on.
        takes: for each step, how many of the call's read values are its arguments (a release's
            or a retention's values; the values come first in the call's ``reads``, in order).
    """

    steps: tuple["Step", ...]
    lane: int
    takes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Inline:
    """The sync points of a segment compiled once with its lanes inline.

    Attributes:
        key: the number its ``capturepass::inline_step`` calls carry (unique in the process),
            by which each call checks it runs under its own segment's runner.
        points: the sync points, by the index the calls carry.
    """

    key: int
    points: tuple[SyncPoint, ...]


@dataclasses.dataclass
class Step:
    """One step of the plan: a region, or a ``capturepass::`` op (its annotated-graph node)."""

    kind: StepKind
    lane: LaneId
    payload: Union[RegionPlan, fx.Node, object]


@dataclasses.dataclass
class Plan:
    """The emitted plan of one annotated graph.

    Attributes:
        graph: the annotated graph (not changed after ``emit``).
        steps: regions and ``capturepass::`` ops, in the order the outer program runs them.
    """

    graph: fx.GraphModule
    steps: list[Step]

    @property
    def regions(self) -> list[RegionPlan]:
        """Every region, in program order."""
        return [s.payload for s in self.steps if s.kind == StepKind.REGION]
