"""Higher-order ops in ATen graphs: their subgraphs, and the op a wrapper calls.

A higher-order op (``torch.cond``, ``while_loop``, ``invoke_subgraph`` from
``torch.compiler.nested_compile_region``) names its subgraphs by ``get_attr``
nodes whose targets are ``GraphModule`` attributes of the graph's root. A custom
op that mutates an argument appears as ``auto_functionalized`` (or
``auto_functionalized_v2``) wrapping the op, and an op with effects as
``with_effects``; what the op may do is the wrapped op's business, called with
the arguments the wrapper passes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import is_dynamo_signal

log = logging.getLogger("capturepass")

# Wrappers whose first argument is the op they call (after the effect token for with_effects).
_FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")
_EFFECTFUL = "with_effects"


def hop_name(node: fx.Node) -> str | None:
    """The name of the higher-order op ``node`` calls (``"cond"``, ...), or ``None``."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.HigherOrderOperator):
        return None
    name = getattr(target, "_name", None)
    return name if isinstance(name, str) else str(target.name())


def module_attr(node: fx.Node) -> torch.nn.Module | None:
    """The module a ``get_attr`` node names (a higher-order op's subgraph), or ``None``.

    Tensor constants are not modules and answer ``None``.
    """
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    obj: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.nn.Module) else None


def subgraphs(node: fx.Node) -> list[fx.GraphModule]:
    """The graph modules ``node`` reads through ``get_attr`` arguments, in argument order."""
    out: list[fx.GraphModule] = []
    for arg in node.all_input_nodes:
        mod = module_attr(arg)
        if isinstance(mod, fx.GraphModule) and all(mod is not m for m in out):
            out.append(mod)
    return out


def wrapped_call(node: fx.Node) -> tuple[torch._ops.OpOverload, tuple, dict[str, Any]] | None:
    """``(op, args, kwargs)`` of the op a functionalization or effect wrapper calls, else ``None``.

    ``args`` and ``kwargs`` hold what ``op`` receives, as graph nodes or constants: for
    ``auto_functionalized_v2`` a mutated argument is rebuilt from ``_all_bases`` (as
    fake values, since it is a view of a base rather than a node of its own).
    """
    name = hop_name(node)
    if name == _EFFECTFUL:
        if len(node.args) >= 2 and isinstance(node.args[1], torch._ops.OpOverload):
            return node.args[1], tuple(node.args[2:]), dict(node.kwargs)
        return None
    if name not in _FUNCTIONALIZED or not node.args or not isinstance(node.args[0], torch._ops.OpOverload):
        return None
    op: torch._ops.OpOverload = node.args[0]
    kwargs = dict(node.kwargs)
    if name == "auto_functionalized_v2":
        kwargs = _v2_arguments(op, kwargs)
    schema_names = {a.name for a in op._schema.arguments}
    return op, (), {k: v for k, v in kwargs.items() if k in schema_names}


def _v2_arguments(op: torch._ops.OpOverload, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments from ``auto_functionalized_v2``'s kwargs.

    NOTE: v2 passes every mutated argument as an index into ``_all_bases`` plus how
    to view it (``_x_base_index``, ``_x_size``/``_x_stride``/``_x_storage_offset``,
    ``_x_slice_*``, ``_x_alias``); torch's own reader of that encoding rebuilds the
    view from the bases' fake values, as the op will see it.
    """
    from torch._higher_order_ops import auto_functionalize as af

    bases = [b.meta.get("val") if isinstance(b, fx.Node) else b for b in kwargs.get("_all_bases", ())]
    out = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    reader = getattr(af, "read_view_information_from_args", None)
    mutable = getattr(af, "get_mutable_args_from_schema", None)
    try:
        if reader is None or mutable is None:
            raise RuntimeError("this torch has no reader of the auto_functionalized_v2 encoding")
        names, types = mutable(op._schema)
        values = fx.node.map_arg(dict(kwargs), lambda n: n.meta.get("val"))
        views = reader(names, types, dict(values), bases)
        for arg_name, view in views.items():
            if view is None:
                out[arg_name] = None
            elif isinstance(view, list):
                out[arg_name] = [None if v is None else v.regenerate_view(bases) for v in view]
            else:
                out[arg_name] = view.regenerate_view(bases)
    except Exception as exc:  # an encoding this code does not know: describe the bases instead
        if is_dynamo_signal(exc):
            raise
        log.info(
            "capturepass: cannot rebuild the mutated arguments of %s from auto_functionalized_v2 (%s: %s); "
            "its capability query sees the base tensors instead",
            op._schema.name, type(exc).__name__, exc,
        )
        for key, value in kwargs.items():
            if key.endswith("_base_index") and key.startswith("_") and isinstance(value, int) and value < len(bases):
                out[key[1:-len("_base_index")]] = bases[value]
    return out


def as_values(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``args`` and ``kwargs`` with every graph node replaced by its fake value."""
    return fx.node.map_arg((tuple(args), dict(kwargs)), lambda n: n.meta.get("val"))
