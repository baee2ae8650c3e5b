"""Typed capturepass metadata on FX nodes and graphs, and its only accessors.

Every piece of capturepass data on a node lives under ``node.meta["capturepass"]``
as one frozen :class:`NodeInfo`; graph-wide data lives under
``gm.meta["capturepass"]`` as one frozen :class:`GraphInfo`. Nothing outside
``capturepass.ir`` touches those keys: passes call :func:`info`,
:func:`update`, :func:`graph_info` and :func:`update_graph`.

Identifiers are small typed values (:class:`LaneId`, :class:`EventId`,
:class:`LeaseId`, :class:`OwnerId`, :class:`SegmentId`), never stream or event
handles or pointers: the runtime maps them to real objects per owner. Each
record carries its provenance (``created_by`` and ``changed_by``) so that an
error can say which pass introduced a node.

The effect vocabulary (:class:`Effect`) is what partitioning, retention and the
verifier query instead of matching op names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import logging
from collections.abc import Iterator
from typing import Any

import torch.fx as fx

META_KEY = "capturepass"
# Where a lane hint sits in ``node.meta["custom"]`` (``torch.fx.traceback.annotate``):
# ``{HINT_KEY: {"lane": name}}``; ``read_hints`` turns it into ``NodeInfo.hint``.
HINT_KEY = "capturepass"


class Effect(enum.Enum):
    """What a node does, as far as synchronisation is concerned."""

    INPUT = "input"  # placeholder: storage owned by the caller
    CONSTANT = "constant"  # get_attr: storage owned by the module
    COMPUTE = "compute"  # a tensor op that runs on its lane
    RECORD = "record"  # records an event on its lane
    WAIT = "wait"  # makes its lane wait for an event
    RELEASE = "release"  # drops the last reference to storage (deferred free)
    RETAIN = "retain"  # keeps storage owners alive for a captured segment's life
    EXTERNAL = "external"  # joins a stream capturepass does not own to the main lane, or back
    OUTPUT = "output"


SYNC_EFFECTS = frozenset({Effect.RECORD, Effect.WAIT})


class _StrEnum(str, enum.Enum):
    """A closed set of names that prints, formats, reprs and serializes as its plain value.

    Members compare equal to their values (``Overlap.SAFE == "safe"``), so records
    read back from JSON and options given as strings need no conversion to be compared,
    and messages and dumps read as before.
    """

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    # NOTE: Enum hashes a member by its name; a member must hash as the string it equals, or a
    # dict keyed by one misses the other.
    __hash__ = str.__hash__


class EventRole(_StrEnum):
    """Why an event exists; the event pool keeps one free list per role."""

    FORK = "fork"  # recorded on the capture lane (main), waited on by an auxiliary lane
    JOIN = "join"  # recorded on an auxiliary lane, waited on by main or another auxiliary lane
    IN = "in"  # a join_external into the main lane: main waits for an external stream
    OUT = "out"  # a join_external out of the main lane: an external stream waits for main
    EXTERNAL = "external"  # the pooled event of an external join


class Overlap(_StrEnum):
    """How an op may run beside work on other lanes (``Capability.overlap``)."""

    SAFE = "safe"  # beside any other lane
    JOIN = "join"  # other lanes' independent work first; every lane joined before it starts
    SERIALIZE = "serialize"  # nothing beside it, before or after its start


class CaptureMode(_StrEnum):
    """How a graph's segments are captured (``GraphInfo.cudagraphs``)."""

    MONOLITHIC = "monolithic"  # one CUDA graph for the whole graph
    BREAKABLE = "breakable"  # one CUDA graph per segment, breaks run eagerly between them
    NONE = "none"  # not captured


class Stage(_StrEnum):
    """Which graph a pass runs on."""

    DYNAMO = "dynamo"  # Dynamo's torch-level graph, before AOT autograd
    ATEN = "aten"  # the functional ATen graph


class Property(_StrEnum):
    """A named IR property: what holds of the graph from the pass that ensures it on.

    Passes declare which they ``require`` and ``ensure``; the pipeline checks the order when
    it is built, and the verifier checks each rule once its property is established.
    """

    HINTS = "hints"  # user and Dynamo lane hints are typed metadata
    CAPABILITIES = "capabilities"  # every compute node has a capability and a cost
    LANES = "lanes"  # every compute node has a lane; breaks are marked
    SYNCED = "synced"  # every cross-lane dependency is ordered by a record/wait pair
    LEASED = "leased"  # every event has a lease of its owner
    BOUND = "bound"  # owner-bound resources are bound to owner and lane
    RETAINED = "retained"  # captured segments retain their storage owners
    PARTITIONED = "partitioned"  # nodes carry segment ids; breaks have reasons
    VERIFIED = "verified"  # all of the above, checked together
    EMITTED = "emitted"  # the plan exists; the graph is not changed after this


class BreakSource(_StrEnum):
    """Who cut the graph where a :class:`Break` is."""

    PARTITION = "partition"  # a non-capturable op capturepass runs eagerly between segments
    DYNAMO = "dynamo"  # a Dynamo graph break, before capturepass saw the graph


@dataclasses.dataclass(frozen=True, order=True)
class LaneId:
    """A logical stream. Lane 0 is the capture (main) lane."""

    index: int

    def __str__(self) -> str:
        return f"s{self.index}"


MAIN_LANE = LaneId(0)
MAIN_LANE_NAME = "main"


@dataclasses.dataclass(frozen=True, order=True)
class EventId:
    """One record point; every wait names the record it waits for."""

    index: int

    def __str__(self) -> str:
        return f"e{self.index}"


@dataclasses.dataclass(frozen=True, order=True)
class OwnerId:
    """A graph owner: one per compiled graph, numbered by the compile driver across the process
    (``g3``). The runtime names its owners after it (``g3.m0.c1``: ``runtime.naming``)."""

    index: int

    def __str__(self) -> str:
        return f"g{self.index}"


@dataclasses.dataclass(frozen=True, order=True)
class SegmentId:
    """A capture segment (one CUDA graph when captured)."""

    index: int

    def __str__(self) -> str:
        return f"k{self.index}"


@dataclasses.dataclass(frozen=True, order=True)
class LeaseId:
    """An event lease: a pooled event object, owned by exactly one graph owner."""

    owner: OwnerId
    role: EventRole
    index: int

    def __str__(self) -> str:
        return f"l{self.index}"


@dataclasses.dataclass(frozen=True)
class ResourceBinding:
    """A workspace, scratch or channel buffer bound to one owner and lane."""

    name: str
    owner: OwnerId
    lane: LaneId

    def __str__(self) -> str:
        return f"{self.name}@{self.owner}/{self.lane}"


@dataclasses.dataclass(frozen=True)
class Capability:
    """What the capability registry answered for one node.

    Attributes:
        capturable: the op may run inside a CUDA graph capture.
        overlap: ``"safe"`` (may run beside other lanes), ``"join"`` (other
            lanes' independent work is enqueued before it, and every lane is
            joined before it starts; lanes may run beside it afterwards), or
            ``"serialize"`` (nothing may run concurrently with it).
        reason: why the answer is what it is (shown in dumps and errors).
        resources: names of owner-bound resources the op needs.
        source: where the answer came from (``"default"``, ``"registry"``,
            ``"launch-plan"``).
        resident_grid: the launch needs all its CTAs resident at once (a
            persistent kernel); work on other lanes is then enqueued before it,
            so that the launch cannot block that work's submission.
        barrier_free: the resident launch has no grid-wide barrier; one with a
            barrier is always serialized (other lanes could keep CTAs from
            becoming resident, and the barrier would never open).
        ctas: the launch's CTA count, when the launch plan says.
        monolithic: the op needs the whole forward in one CUDA graph (it
            communicates across what would be segments); a breakable partition
            is then refused.
    """

    capturable: bool = True
    overlap: Overlap = Overlap.SAFE
    reason: str = ""
    resources: tuple[str, ...] = ()
    source: str = "default"
    resident_grid: bool = False
    barrier_free: bool = True
    ctas: int | None = None
    monolithic: bool = False


@dataclasses.dataclass(frozen=True)
class Cost:
    """Estimated work of one node.

    Attributes:
        flops: floating-point operations (evaluated at the shape hints).
        bytes: bytes read plus bytes written.
        symbolic: the FLOP formula over the graph's symbols, when shapes are
            dynamic; ``None`` for static shapes.
        exact: ``False`` when the estimate fell back to a guess.
    """

    flops: float = 0.0
    bytes: float = 0.0
    symbolic: str | None = None
    exact: bool = True


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """All capturepass data of one node. Frozen: passes replace it via :func:`update`."""

    effect: Effect = Effect.COMPUTE
    lane: LaneId | None = None
    hint: str | None = None
    capability: Capability | None = None
    cost: Cost | None = None
    event: EventId | None = None
    role: EventRole | None = None
    lease: LeaseId | None = None
    owner: OwnerId | None = None
    segment: SegmentId | None = None
    resources: tuple[ResourceBinding, ...] = ()
    brk: str | None = None
    why: str | None = None
    external: str | None = None
    created_by: str | None = None
    changed_by: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Break:
    """A non-capturable node that separates two capture segments."""

    node: str
    reason: str
    source: BreakSource = BreakSource.PARTITION


@dataclasses.dataclass(frozen=True)
class GraphInfo:
    """Graph-wide capturepass data.

    Attributes:
        name: ``"forward"``, ``"backward"`` or ``"inference"``.
        owner: the graph owner of every node.
        lanes: lane names, indexed by :class:`LaneId` (index 0 is ``"main"``).
        cudagraphs: resolved capture mode (``"monolithic"``, ``"breakable"``, ``"none"``).
        on_cuda: whether the graph's tensors live on a CUDA device.
        static_inputs: placeholder positions whose storage the caller keeps fixed
            (parameters, buffers).
        segments: segment ids, once partitioned.
        breaks: partition breaks and upstream (Dynamo) graph breaks, with reasons.
        decisions: one line per non-trivial decision a pass took.
        properties: the IR properties established so far (see ``passes.base``).
        mutated_inputs: placeholder positions whose storage the graph writes (an
            in-place update of an input, a buffer or a view of one; a KV-cache
            write): the caller must see the write once per call, on every path.
        external: streams capturepass does not own, as ``(name, relation)``:
            ``"before"`` (the graph reads what the stream produced: the main lane
            waits for it where each segment starts), ``"after"`` (the stream reads
            what the graph produced: it waits for the main lane where each
            segment ends, every lane joined) or ``"both"``.
    """

    name: str = "graph"
    owner: OwnerId = OwnerId(0)
    lanes: tuple[str, ...] = (MAIN_LANE_NAME,)
    cudagraphs: CaptureMode = CaptureMode.NONE
    on_cuda: bool = False
    static_inputs: frozenset[int] = frozenset()
    segments: tuple[SegmentId, ...] = ()
    breaks: tuple[Break, ...] = ()
    decisions: tuple[str, ...] = ()
    properties: frozenset[Property] = frozenset()
    external: tuple[tuple[str, str], ...] = ()
    mutated_inputs: frozenset[int] = frozenset()

    def lane_name(self, lane: LaneId) -> str:
        """The user-facing name of ``lane``."""
        if 0 <= lane.index < len(self.lanes):
            return self.lanes[lane.index]
        return f"<unknown lane {lane.index}>"

    @property
    def title(self) -> str:
        """How messages name the graph: its kind and its owner, ``"inference graph g3"``."""
        return f"{self.name} graph {self.owner}"

    @property
    def captured(self) -> bool:
        """Whether segments become CUDA graphs."""
        return self.cudagraphs != CaptureMode.NONE


_DEFAULT_INFO = NodeInfo()
_NODE_FIELDS = frozenset(f.name for f in dataclasses.fields(NodeInfo))


def info(node: fx.Node) -> NodeInfo:
    """The capturepass record of ``node`` (a default record when it has none)."""
    return node.meta.get(META_KEY, _DEFAULT_INFO)


def has_info(node: fx.Node) -> bool:
    """Whether ``node`` carries a capturepass record."""
    return META_KEY in node.meta


def set_info(node: fx.Node, record: NodeInfo) -> None:
    """Replaces the record of ``node``."""
    node.meta[META_KEY] = record


# While a pass runs (shared_records), update() remembers each change it made: key (the old
# record, the pass, the changed fields and their values, by identity) -> the new record. Every
# old record a key names stays in ``keep`` while the table lives, so that its id is not reused.
_SHARED: contextvars.ContextVar[tuple[dict, list] | None] = contextvars.ContextVar(
    "capturepass_shared_records", default=None
)


@contextlib.contextmanager
def shared_records() -> Iterator[None]:
    """Within the block, nodes whose records get the same change share the new record.

    Records are frozen and passes only replace them, so sharing one between nodes is not
    visible to a pass; what it saves is a new record per node and pass (two objects that
    live until the next pass replaces them) on graphs of many alike nodes. The pass manager
    runs each pass inside it; what it remembers is dropped at the end of the block.
    """
    token = _SHARED.set(({}, []))
    try:
        yield
    finally:
        _SHARED.reset(token)


def update(node: fx.Node, by: str, **changes: Any) -> NodeInfo:
    """Replaces fields of ``node``'s record and notes ``by`` as a pass that changed it."""
    old = info(node)
    shared = _SHARED.get()
    if shared is not None:
        key = (id(old), by, *changes, *map(id, changes.values()))
        new = shared[0].get(key)
        if new is not None:
            node.meta[META_KEY] = new
            return new
    changed_by = old.changed_by
    if by and old.created_by != by and (not changed_by or changed_by[-1] != by):
        changed_by = changed_by + (by,)
    if type(old) is not NodeInfo or not changes.keys() <= _NODE_FIELDS or "changed_by" in changes:
        new = dataclasses.replace(old, changed_by=changed_by, **changes)  # raises the usual TypeError
    else:
        # dataclasses.replace without re-running __init__ (NodeInfo has no validation): hot path.
        new = object.__new__(NodeInfo)
        fields = new.__dict__
        fields.update(old.__dict__)
        fields.update(changes)
        fields["changed_by"] = changed_by
    if shared is not None:
        shared[0][key] = new  # the new record holds every changed value, so their ids stay theirs
        shared[1].append(old)
    node.meta[META_KEY] = new
    return new


def create(node: fx.Node, by: str, **fields: Any) -> NodeInfo:
    """Gives a node a pass created a fresh record naming that pass."""
    record = NodeInfo(created_by=by, **fields)
    node.meta[META_KEY] = record
    return record


def graph_info(gm: fx.GraphModule) -> GraphInfo:
    """The graph-wide record of ``gm``."""
    gi = gm.meta.get(META_KEY)
    if gi is None:
        gi = GraphInfo()
        gm.meta[META_KEY] = gi
    return gi


def set_graph_info(gm: fx.GraphModule, gi: GraphInfo) -> None:
    """Replaces the graph-wide record of ``gm``."""
    gm.meta[META_KEY] = gi


def update_graph(gm: fx.GraphModule, **changes: Any) -> GraphInfo:
    """Replaces fields of the graph-wide record."""
    gi = dataclasses.replace(graph_info(gm), **changes)
    gm.meta[META_KEY] = gi
    return gi


class Decision(str):
    """One decision line of the graph record; ``level`` is the log level it is reported at.

    A plain ``str`` everywhere else (dumps, ``graph.json``, comparisons).
    """

    level: int

    def __new__(cls, text: str, level: int = logging.INFO) -> "Decision":
        self = super().__new__(cls, text)
        self.level = level
        return self


def add_decision(gm: fx.GraphModule, line: str, level: int = logging.INFO) -> None:
    """Appends one decision line to the graph record (shown by the dump and ``show``, and logged
    at ``level`` by the pass manager's logging instrument: a pass itself never logs)."""
    gi = graph_info(gm)
    gm.meta[META_KEY] = dataclasses.replace(gi, decisions=gi.decisions + (Decision(line, level),))


def lane_of(node: fx.Node) -> LaneId:
    """The lane of ``node``; nodes without one run on the main lane."""
    lane = info(node).lane
    return MAIN_LANE if lane is None else lane


def effect_of(node: fx.Node) -> Effect:
    """The effect of ``node``, derived from its op when it has no record."""
    if META_KEY in node.meta:
        return node.meta[META_KEY].effect
    if node.op == "placeholder":
        return Effect.INPUT
    if node.op == "get_attr":
        return Effect.CONSTANT
    if node.op == "output":
        return Effect.OUTPUT
    return Effect.COMPUTE


# The default record of a node without one, by op: its effect is what effect_of derives.
_DERIVED_INFO = {
    "placeholder": NodeInfo(effect=Effect.INPUT),
    "get_attr": NodeInfo(effect=Effect.CONSTANT),
    "output": NodeInfo(effect=Effect.OUTPUT),
}


def record_of(node: fx.Node) -> NodeInfo:
    """The record of ``node``, or for a node without one a default record with its derived effect.

    One lookup for loops that need both: ``record_of(n).effect == effect_of(n)``, and
    every other field equals that of ``info(n)``.
    """
    rec = node.meta.get(META_KEY)
    if rec is None:
        return _DERIVED_INFO.get(node.op, _DEFAULT_INFO)
    return rec


def strip(gm: fx.GraphModule) -> None:
    """Removes every capturepass record from ``gm`` (before it leaves capturepass)."""
    for node in gm.graph.nodes:
        node.meta.pop(META_KEY, None)
    gm.meta.pop(META_KEY, None)
