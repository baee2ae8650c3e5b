"""What the simulator runs: how the host and the lanes treat each node of a graph or an emitted program."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import SimulationError
from capturepass.ir import analysis, meta
from capturepass.ir.meta import Effect
from capturepass.ir.plan import StepKind

_HOST_ONLY_OPS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


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
