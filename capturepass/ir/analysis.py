"""Read-only analyses over an annotated graph, shared by passes and the verifier.

- Storage aliasing: which nodes share storage (views of one allocation), read
  from op schemas, so that a view read on another lane counts as a read of its
  base. A functional collective's ``wait_tensor`` returns its argument, which its
  schema does not say (``ir.collectives``); the collective keeps reading its
  inputs until that wait, so the wait counts as a read of them.
- Segment structure: the program order cut at break nodes.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from capturepass.ir import collectives, meta
from capturepass.ir.meta import Effect


def aliases_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output aliases, or ``None``.

    Uses the op schema: an aten view (``aten.view``, ``aten.t``, ``aten.slice``,
    ...) declares an alias annotation on its return.
    """
    if node.op != "call_function":
        return None
    args = node.args
    for i in _alias_positions(node.target):
        if i >= len(args):
            break
        arg = args[i]
        if isinstance(arg, fx.Node):
            return arg
    return None


# id(op) -> (op, positions): what aliases_input reads from an op's schema, once per op
# overload. The op is kept so that its id is not reused while the entry exists.
_ALIAS_POSITIONS: dict[int, tuple[object, tuple[int, ...]]] = {}


def _alias_positions(target: object) -> tuple[int, ...]:
    """Positions of the formal arguments a view return may alias (none unless it is a view)."""
    entry = _ALIAS_POSITIONS.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    schema = getattr(target, "_schema", None)
    positions: tuple[int, ...] = ()
    if schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    ):
        positions = tuple(i for i, formal in enumerate(schema.arguments) if formal.alias_info is not None)
    if isinstance(target, torch._ops.OpOverload):  # other targets may be short-lived: not kept
        _ALIAS_POSITIONS[id(target)] = (target, positions)
    return positions


# id(op) -> (op, positions): the written formal a write-alias return (``Tensor(a!)``) aliases.
_WRITE_ALIAS: dict[int, tuple[object, tuple[int, ...]]] = {}


def _write_alias_positions(target: object) -> tuple[int, ...]:
    """Positions of the written formals an op's ``Tensor(a!)`` return aliases (``add_``, ``copy_``,
    an ``out=`` variant), if the op returns one."""
    entry = _WRITE_ALIAS.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    schema = getattr(target, "_schema", None)
    positions: tuple[int, ...] = ()
    if schema is not None:
        sets = [
            r.alias_info.before_set for r in schema.returns if r.alias_info is not None and r.alias_info.is_write
        ]
        if sets:
            positions = tuple(
                i for i, formal in enumerate(schema.arguments)
                if formal.alias_info is not None and formal.alias_info.is_write
                and any(formal.alias_info.before_set & s for s in sets)
            )
    if isinstance(target, torch._ops.OpOverload):
        _WRITE_ALIAS[id(target)] = (target, positions)
    return positions


# id(op) -> (op, view positions, written-and-returned positions): alias_source's schema facts.
_SOURCES: dict[int, tuple[object, tuple[int, ...], tuple[int, ...]]] = {}


def alias_source(node: fx.Node) -> fx.Node | None:
    """The argument whose storage ``node``'s value lives in, or ``None`` for a fresh allocation.

    A view (:func:`aliases_input`), an in-place op that returns the tensor it wrote
    (``add_`` returns ``self``, ``copy_`` its destination), or a collective's
    ``wait_tensor`` (which returns its argument, though its schema declares no alias):
    either way the value holds the argument's storage, which stays allocated while the
    value lives.
    """
    if node.op != "call_function":
        return None
    target = node.target
    entry = _SOURCES.get(id(target))
    if entry is None or entry[0] is not target:
        # NOTE: wait_tensor is not a view (it has an effect: it completes the collective, so it
        # is never "free" like a view in the scheduler), but its value is its argument's storage.
        entry = (target, _alias_positions(target),
                 _write_alias_positions(target) + collectives.returns_argument(target))
        if isinstance(target, torch._ops.OpOverload):
            _SOURCES[id(target)] = entry
    _, views, writes = entry
    if not views and not writes:
        return None
    args = node.args
    for i in views:
        if i >= len(args):
            break
        if isinstance(args[i], fx.Node):
            return args[i]
    for i in writes:
        value = args[i] if i < len(args) else node.kwargs.get(target._schema.arguments[i].name)
        if isinstance(value, fx.Node):
            return value
    return None


def storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the storage ``node`` refers to (through views and in-place ops)."""
    seen = 0
    while True:
        src = alias_source(node)
        if src is None:
            return node
        node = src
        seen += 1
        if seen > 10_000:  # a cycle would be a malformed graph; fail loudly
            raise RuntimeError(f"alias chain through {node.name} does not terminate")


def fake_value(node: fx.Node) -> object:
    """The fake value of ``node`` as a compiler can take it as an example input.

    NOTE: AOT autograd may leave a value that functionalization produced (the output of an
    opaque custom op, on torch 2.11) as a ``FunctionalTensor``; used outside a functionalization
    mode (Inductor's trace of a region that reads it) it raises "Attempting to use
    FunctionalTensor on its own". Such a value is unwrapped to the fake tensor inside it.
    """
    val = node.meta.get("val")
    functional = getattr(getattr(torch._subclasses, "functional_tensor", None), "FunctionalTensor", None)
    if functional is not None and isinstance(val, functional):
        unwrap = getattr(torch, "_from_functional_tensor", None)
        if unwrap is not None:
            return unwrap(val.elem)
    return val


def is_tensor_node(node: fx.Node) -> bool:
    """Whether ``node`` produces a tensor (per its fake value)."""
    return isinstance(node.meta.get("val"), torch.Tensor)


def carries_tensor(node: fx.Node) -> bool:
    """Whether ``node``'s value holds device data (a tensor, or a tuple with one).

    Scalars (sizes, ``SymInt`` arithmetic) live on the host: reading them on
    another lane needs no event.
    """
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return "val" not in node.meta and node.op != "placeholder"


def is_getitem(node: fx.Node) -> bool:
    """Whether ``node`` selects one output of a multi-output node."""
    return node.op == "call_function" and node.target is operator.getitem


def compute_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    """The nodes that run on a lane (tensor ops and other calls), in program order."""
    for node in graph.nodes:
        if meta.effect_of(node) is Effect.COMPUTE and node.op in ("call_function", "call_method", "call_module"):
            yield node


def split_segments(graph: fx.Graph) -> list[list[fx.Node]]:
    """The program order cut at break nodes.

    Returns the compute and sync nodes of each segment, in order; break nodes
    themselves and the graph's inputs and output belong to no segment. A graph
    without breaks has exactly one (possibly empty) segment.
    """
    segments: list[list[fx.Node]] = [[]]
    for node in graph.nodes:
        eff = meta.effect_of(node)
        if eff in (Effect.INPUT, Effect.CONSTANT, Effect.OUTPUT):
            continue
        if meta.info(node).brk is not None:
            segments.append([])
            continue
        segments[-1].append(node)
    return segments


def node_device(node: fx.Node) -> torch.device | None:
    """The device of ``node``'s first tensor output, if any."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.device
    if isinstance(val, (tuple, list)):
        for v in val:
            if isinstance(v, torch.Tensor):
                return v.device
    return None


def reads_of(root: fx.Node) -> list[fx.Node]:
    """Compute nodes that read ``root``'s storage, directly or through any chain of views.

    A collective that reads it keeps reading it until its ``wait_tensor``: the wait counts
    as a read too (:func:`pending_reads`).
    """
    reads = []
    stack = [root]
    seen = {root}
    while stack:
        n = stack.pop()
        for u in n.users:
            if meta.effect_of(u) is not Effect.COMPUTE:
                continue
            reads.append(u)
            if collectives.is_collective(u):
                reads.extend(collectives.waits_of(u))
            if u not in seen and alias_source(u) is n:
                seen.add(u)
                stack.append(u)
    return reads


def pending_reads(node: fx.Node) -> list[fx.Node]:
    """Values ``node`` reads beyond its arguments: a ``wait_tensor`` reads the inputs of the
    collective it completes (NCCL reads them on its own stream until then)."""
    return collectives.pending_inputs(node)


def view_members(root: fx.Node) -> list[fx.Node]:
    """``root`` and every value that holds its storage (views, in-place results), transitively."""
    out = [root]
    stack = [root]
    while stack:
        n = stack.pop()
        for u in n.users:
            if alias_source(u) is n:
                out.append(u)
                stack.append(u)
    return out


def output_roots(graph: fx.Graph) -> set[fx.Node]:
    """Storage roots returned by the graph (the caller frees them, never capturepass)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            out.update(storage_root(a) for a in node.all_input_nodes)
    return out


class LaneLayout:
    """Where each lane's compute nodes sit, per segment (a break is a segment of its own)."""

    def __init__(self, nodes: list[fx.Node], records: list[meta.NodeInfo] | None = None) -> None:
        """``records``: ``meta.record_of`` of each node, when the caller has them already."""
        if records is None:
            records = [meta.record_of(n) for n in nodes]
        self.order = {n: i for i, n in enumerate(nodes)}
        self.segment_of: dict[fx.Node, int] = {}
        self._by_lane: dict[tuple[int, int], list[int]] = {}
        self._breaks: list[int] = []
        segment_of = self.segment_of
        by_lane = self._by_lane
        seg = 0
        current: dict[int, list[int]] = {}  # lane number -> its positions in segment ``seg``
        for i, (node, rec) in enumerate(zip(nodes, records)):
            if rec.effect is not Effect.COMPUTE:
                continue
            if rec.brk is not None:
                segment_of[node] = seg + 1
                self._breaks.append(i)
                seg += 2
                current = {}
                continue
            segment_of[node] = seg
            li = 0 if rec.lane is None else rec.lane.index
            positions = current.get(li)
            if positions is None:
                positions = current[li] = by_lane[(seg, li)] = []
            positions.append(i)

    def segment_at(self, index: int) -> int:
        """The segment number of program index ``index`` (odd for a break itself)."""
        before = bisect.bisect_left(self._breaks, index)
        if before < len(self._breaks) and self._breaks[before] == index:
            return 2 * before + 1
        return 2 * before

    def issues_after(self, root: fx.Node, index: int) -> bool:
        """Whether ``root``'s lane issues another node after ``index``, in the segment of ``index``.

        NOTE: the segment is that of the free point, not of ``root``: storage allocated
        in one segment and freed in a later one races the allocating lane's later work
        in the later segment; only the next fork orders that lane after the reads.
        """
        return self.lane_issues_after(meta.lane_of(root).index, index)

    def lane_issues_after(self, lane: int, index: int) -> bool:
        """Whether lane number ``lane`` issues another node after ``index``, in the segment of ``index``."""
        return self.last_index(self.segment_at(index), lane) > index

    def last_index(self, segment: int, lane: int) -> int:
        """The program index of the last node of lane number ``lane`` in ``segment`` (-1 if none)."""
        positions = self._by_lane.get((segment, lane))
        return positions[-1] if positions else -1


def external_owners(gm: fx.GraphModule) -> set[fx.Node]:
    """Inputs and constants whose storage a capture would bake in without owning it."""
    gi = meta.graph_info(gm)
    owners: set[fx.Node] = set()
    index = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if index in gi.static_inputs:
                owners.add(node)
            index += 1
        elif node.op == "get_attr":
            owners.add(node)
    return owners
