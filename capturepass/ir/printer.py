"""The deterministic text dump and the JSON form of an annotated graph.

One line per node::

    %mm : f32[16,64] = aten.mm.default(%x, %w)  {lane=s1, owner=g0}
    %record : () = capturepass.record(0, 1)  {lane=s1, record=e0, role=join, lease=l0, by=insert_syncs, why=%mm->%add}

Identifiers are canonical: events, leases and segments are renumbered in print
order (``e0``, ``l0``, ``k0``), and anything that looks like a pointer is
scrubbed, so that two runs of the same compile print the same text and golden
tests can compare it. The graph owner prints as its own id (``g3``: the
process-wide number of the compiled graph, see ``backends.compile.new_owner``),
which the runtime's owner names start with (``g3.m0.c0``, see
``runtime.naming``), so that a dump and a runtime message name one owner the
same way; ``PrintSettings(canonical_owners=True)`` numbers owners in print order
too (``g0``), for golden tests. Attributes follow the op in a fixed key order.
Nodes are grouped under their owner and segment; break nodes sit between the
segments they separate.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import torch
import torch.fx as fx

from capturepass.ir import effects, meta
from capturepass.ir.meta import BreakSource, Effect, GraphInfo, NodeInfo, Overlap

_POINTER = re.compile(r"0x[0-9a-fA-F]+")

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}


@dataclasses.dataclass(frozen=True)
class PrintSettings:
    """What the dump shows besides lanes and sync structure.

    Attributes:
        shapes: print the type (dtype and shape) on each binder.
        cost: print each node's estimated FLOPs and bytes.
        provenance: print which passes changed each node (``changed=``).
        capability: print non-default capability answers.
        canonical_owners: number graph owners in print order (``g0``), as events and
            segments are, instead of printing each owner's own id (``g3``, the number the
            runtime's owner names start with). For golden tests, whose compiles get
            different owner ids depending on what the process compiled before.
    """

    shapes: bool = True
    cost: bool = False
    provenance: bool = False
    capability: bool = True
    canonical_owners: bool = False


class _Canon:
    """Assigns canonical short ids in print order.

    Args:
        canonical_owners: renumber graph owners (kind ``"g"``) too; by default an owner
            prints as its own id (``str(OwnerId)``), the one runtime owner names start with.
    """

    def __init__(self, canonical_owners: bool = False) -> None:
        self._maps: dict[str, dict[Any, int]] = {}
        self.canonical_owners = canonical_owners

    def __call__(self, kind: str, key: Any) -> str:
        if kind == "g" and not self.canonical_owners:
            return str(key)
        table = self._maps.setdefault(kind, {})
        if key not in table:
            table[key] = len(table)
        return f"{kind}{table[key]}"


def format_type(val: Any) -> str:
    """The short type of a node's fake value: ``f32[4,s0]``, a tuple, or ``()``."""
    if isinstance(val, torch.Tensor):
        dtype = _DTYPE_SHORT.get(val.dtype, str(val.dtype).replace("torch.", ""))
        dims = ",".join(str(d) for d in val.shape)
        return f"{dtype}[{dims}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(format_type(v) for v in val) + ")"
    if isinstance(val, torch.SymInt) or isinstance(val, int) and not isinstance(val, bool):
        return "int"
    if isinstance(val, (torch.SymFloat, float)):
        return "float"
    if isinstance(val, (torch.SymBool, bool)):
        return "bool"
    return "()"


def op_name(node: fx.Node) -> str:
    """The printed name of a node's operation."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return f"constant {node.target}"
    if node.op == "call_method":
        return f"method.{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        if name.startswith("capturepass."):
            return name.rsplit(".", 1)[0]
        return name
    return getattr(target, "__name__", str(target))


def _format_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {_format_arg(v)}" for k, v in arg.items()) + "}"
    return _POINTER.sub("0x?", repr(arg))


def _fmt_num(x: float) -> str:
    return f"{x:.3g}"


def node_attrs(node: fx.Node, gi: GraphInfo, canon: _Canon, settings: PrintSettings) -> list[str]:
    """The ``key=value`` attributes of one node, in the fixed key order."""
    rec: NodeInfo = meta.info(node)
    attrs: list[str] = []
    if not meta.has_info(node):
        return attrs
    if rec.lane is not None:
        attrs.append(f"lane={rec.lane}")
    if rec.hint is not None:
        attrs.append(f"hint={rec.hint}")
    if rec.effect is Effect.COMPUTE:
        writes = effects.accesses(node).writes
        if writes:
            attrs.append("writes=" + ",".join("rng" if w is effects.RNG else f"%{w.name}" for w in writes))
    if rec.event is not None:
        kind = "record" if rec.effect is Effect.RECORD else "wait"
        attrs.append(f"{kind}={canon('e', rec.event)}")
    if rec.external is not None:
        attrs.append(f"external={rec.external}")
    if rec.role is not None:
        attrs.append(f"role={rec.role}")
    if rec.lease is not None:
        attrs.append(f"lease={canon('l', rec.lease)}")
    if rec.owner is not None:
        attrs.append(f"owner={canon('g', rec.owner)}")
    if rec.segment is not None:
        attrs.append(f"segment={canon('k', rec.segment)}")
    if rec.resources:
        res = ",".join(f"{r.name}@{canon('g', r.owner)}/{r.lane}" for r in rec.resources)
        attrs.append(f"resources=[{res}]")
    if rec.brk is not None:
        attrs.append(f"break={rec.brk!r}")
    cap = rec.capability
    if settings.capability and cap is not None:
        if not cap.capturable:
            attrs.append("capturable=no")
        if cap.overlap != Overlap.SAFE:
            attrs.append(f"overlap={cap.overlap}")
        if cap.monolithic:
            attrs.append("monolithic")
        if cap.resident_grid:
            ctas = "?" if cap.ctas is None else str(cap.ctas)
            attrs.append(f"grid={ctas}cta/{'barrier-free' if cap.barrier_free else 'barrier'}")
    if settings.cost and rec.cost is not None:
        c = rec.cost
        cost = f"cost={_fmt_num(c.flops)}fl/{_fmt_num(c.bytes)}B"
        if c.symbolic:
            cost += f"({c.symbolic})"
        if not c.exact:
            cost += "~"
        attrs.append(cost)
    if rec.created_by is not None:
        attrs.append(f"by={rec.created_by}")
    if settings.provenance and rec.changed_by:
        attrs.append(f"changed={','.join(rec.changed_by)}")
    if rec.why is not None:
        attrs.append(f"why={rec.why}")
    return attrs


def format_node(node: fx.Node, gi: GraphInfo, canon: _Canon, settings: PrintSettings) -> str:
    """One dump line for ``node``."""
    attrs = node_attrs(node, gi, canon, settings)
    suffix = f"  {{{', '.join(attrs)}}}" if attrs else ""
    if node.op == "output":
        return f"return {_format_arg(node.args[0])}{suffix}"
    binder = f"%{node.name}"
    if settings.shapes:
        binder += f" : {format_type(node.meta.get('val'))}"
    if node.op in ("placeholder", "get_attr"):
        return f"{binder} = {op_name(node)}{suffix}"
    args = ", ".join(
        [_format_arg(a) for a in node.args] + [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
    )
    return f"{binder} = {op_name(node)}({args}){suffix}"


def dump(gm: fx.GraphModule, title: str | None = None, settings: PrintSettings | None = None) -> str:
    """The canonical text of an annotated graph."""
    settings = settings or PrintSettings()
    gi = meta.graph_info(gm)
    canon = _Canon(settings.canonical_owners)
    canon("g", gi.owner)
    lines: list[str] = []
    if title:
        lines.append(f"# {title}")
    lanes = " ".join(f"s{i}={name}" for i, name in enumerate(gi.lanes))
    header = f"# graph {gi.name}: lanes {lanes}; cudagraphs={gi.cudagraphs}"
    if gi.external:
        header += "; external " + " ".join(f"x{i}={name}({rel})" for i, (name, rel) in enumerate(gi.external))
    if gi.mutated_inputs:
        header += "; writes inputs " + " ".join(f"%{name}" for name in _input_names(gm, gi.mutated_inputs))
    lines.append(header)
    lines.append(f"owner {canon('g', gi.owner)}:")
    current_segment = None
    for node in gm.graph.nodes:
        rec = meta.info(node)
        seg = rec.segment
        indent = "  "
        if rec.brk is not None and meta.effect_of(node) is Effect.COMPUTE:
            current_segment = None
            lines.append(f"  break {canon('b', node.name)}: {rec.brk}")
        elif seg is not None:
            if seg != current_segment:
                current_segment = seg
                lines.append(f"  segment {canon('k', seg)}:")
            indent = "    "
        elif node.op == "output" and current_segment is not None:
            current_segment = None
        lines.append(indent + _POINTER.sub("0x?", format_node(node, gi, canon, settings)))
    for brk in gi.breaks:
        if brk.source != BreakSource.PARTITION:
            lines.append(f"# {brk.source} break: {brk.reason}")
    for line in gi.decisions:
        lines.append(f"# decision: {line}")
    # Break reasons and decisions may quote reprs too: scrub the whole text, not only nodes.
    return _POINTER.sub("0x?", "\n".join(lines) + "\n")


def _input_names(gm: fx.GraphModule, positions: frozenset[int]) -> list[str]:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [placeholders[i] for i in sorted(positions) if i < len(placeholders)]


def to_json(gm: fx.GraphModule, settings: PrintSettings | None = None) -> dict[str, Any]:
    """The annotated graph as a JSON-ready dict (the ids of :func:`dump`, no pointers); of
    ``settings`` only ``canonical_owners`` applies."""
    gi = meta.graph_info(gm)
    canon = _Canon(settings is not None and settings.canonical_owners)
    canon("g", gi.owner)
    nodes = []
    for node in gm.graph.nodes:
        rec = meta.info(node)
        entry: dict[str, Any] = {
            "name": node.name,
            "op": _POINTER.sub("0x?", op_name(node)),
            "effect": meta.effect_of(node).value,
            "type": format_type(node.meta.get("val")),
            "args": [a.name for a in node.all_input_nodes],
            "lane": None if rec.lane is None else rec.lane.index,
        }
        if rec.event is not None:
            entry["event"] = canon("e", rec.event)
        if rec.role is not None:
            entry["role"] = rec.role
        if rec.external is not None:
            entry["external"] = rec.external
        if rec.lease is not None:
            entry["lease"] = canon("l", rec.lease)
        if rec.hint is not None:
            entry["hint"] = rec.hint
        if rec.owner is not None:
            entry["owner"] = canon("g", rec.owner)
        if rec.segment is not None:
            entry["segment"] = canon("k", rec.segment)
        if rec.resources:
            entry["resources"] = [str(r.name) for r in rec.resources]
        if rec.brk is not None:
            entry["break"] = rec.brk
        if rec.capability is not None:
            entry["capability"] = dataclasses.asdict(rec.capability)
        if rec.cost is not None:
            entry["cost"] = {"flops": rec.cost.flops, "bytes": rec.cost.bytes, "symbolic": rec.cost.symbolic}
        if rec.created_by is not None:
            entry["created_by"] = rec.created_by
        if rec.why is not None:
            entry["why"] = rec.why
        nodes.append(entry)
    # NOTE: reasons, decisions and why-texts may quote reprs (a launch plan's reason, say);
    # scrub every string, as the text dump scrubs every line.
    doc: dict[str, Any] = {
        "graph": gi.name,
        "owner": canon("g", gi.owner),
        "lanes": list(gi.lanes),
        "cudagraphs": gi.cudagraphs,
        "segments": [canon("k", s) for s in gi.segments],
        "breaks": [{"node": b.node, "reason": b.reason, "source": b.source} for b in gi.breaks],
        "decisions": list(gi.decisions),
        "nodes": nodes,
    }
    if gi.external:
        doc["external"] = [{"name": name, "relation": rel} for name, rel in gi.external]
    if gi.mutated_inputs:
        doc["mutated_inputs"] = _input_names(gm, gi.mutated_inputs)
    return _scrub(doc)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _POINTER.sub("0x?", value)
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def dumps_json(gm: fx.GraphModule, settings: PrintSettings | None = None) -> str:
    """:func:`to_json` as deterministic text."""
    return json.dumps(to_json(gm, settings), indent=1, sort_keys=True) + "\n"
