"""Functional collectives: which nodes communicate, with which group, and what completes them.

Dynamo and AOT autograd trace ``torch.distributed``'s collectives (``dist.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, and the
functional API of ``torch.distributed._functional_collectives``) to the ops of the
``_c10d_functional`` namespace. What the passes rely on, from the schemas:

- a collective (``all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor``,
  ``all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor``,
  ``reduce_scatter_tensor(...)``, ``all_to_all_single(...)``) names its process group by
  a string and returns a *new* tensor at once. The communication runs asynchronously (on
  the process group's own stream with NCCL, in a worker thread with gloo): the returned
  tensor holds nothing valid, and the input may still be read, until
  ``wait_tensor`` of that tensor completes it. (The in-place variants, ``all_reduce_``,
  are what functionalization removes.)
- ``wait_tensor(Tensor tensor) -> Tensor`` declares no alias in its schema, but returns
  its argument: the result lives in the collective's output storage
  (:func:`returns_argument`; ``ir.analysis.alias_source`` follows it).
- every reader of the result reads it through the wait: the wait is the dependency.

So the storage model (``ir.analysis``, ``ir.effects``) treats a collective's output as
storage the collective allocates, and the wait as a node that still reads the
collective's inputs (:func:`pending_inputs`): their memory must not be reused before
the wait, on whatever lane they were allocated.

The capability registry answers for this namespace with :func:`capability` (a
declaration for the whole namespace, which a ``register_capability`` of one op
replaces): capturable, free to overlap, ``collective=True`` (its own lane kind, the
comm lane), and one owner-bound resource per traced group, ``comm:<group>``: at run
time every owner gets its own communicator for that group
(``capturepass.runtime.comms``), and the region that calls the collective is redirected
to it (:func:`rebind`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from capturepass.ir.meta import Capability

NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
"""The op namespaces of functional collectives."""

COMM_LANE = "comm"
"""The name of the lane collectives run on by default (a lane kind of its own)."""

RESOURCE_PREFIX = "comm:"
"""Capability resources named ``comm:<group>`` are communicators, one per owner and lane."""

_WAIT = "_c10d_functional::wait_tensor"


def _wait_op() -> object:
    try:
        return torch.ops._c10d_functional.wait_tensor.default
    except (AttributeError, RuntimeError):  # a torch built without distributed
        return None


WAIT_TENSOR = _wait_op()
"""``torch.ops._c10d_functional.wait_tensor.default`` (``None`` where torch has no such op)."""

# id(op) -> (op, whether it is a collective, position of its group_name argument)
_KINDS: dict[int, tuple[object, bool, int]] = {}


def _kind(target: object) -> tuple[bool, int]:
    entry = _KINDS.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1], entry[2]
    collective, position = False, -1
    if isinstance(target, torch._ops.OpOverload) and target.namespace in NAMESPACES and target is not WAIT_TENSOR:
        for i, formal in enumerate(target._schema.arguments):
            if formal.name == "group_name":
                collective, position = True, i
        _KINDS[id(target)] = (target, collective, position)
    return collective, position


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` calls a functional collective (an op of :data:`NAMESPACES` with a group)."""
    return node.op == "call_function" and _kind(node.target)[0]


def is_wait(node: fx.Node) -> bool:
    """Whether ``node`` is a ``wait_tensor`` (what completes a collective)."""
    return WAIT_TENSOR is not None and node.target is WAIT_TENSOR and node.op == "call_function"


def returns_argument(target: object) -> tuple[int, ...]:
    """Positions of the arguments whose storage ``target``'s result is, beyond its schema's alias
    annotations: ``wait_tensor`` returns its argument (the schema says ``Tensor -> Tensor``)."""
    return (0,) if WAIT_TENSOR is not None and target is WAIT_TENSOR else ()


def _name(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    name = getattr(value, "group_name", None)  # a ProcessGroup object passed as the group
    return name if isinstance(name, str) else None


def group_of(node: fx.Node) -> str | None:
    """The name of the process group a collective node was traced with."""
    collective, position = _kind(node.target) if node.op == "call_function" else (False, -1)
    if not collective:
        return None
    if position < len(node.args):
        return _name(node.args[position])
    return _name(node.kwargs.get("group_name"))


def collective_of(wait: fx.Node) -> fx.Node | None:
    """The collective a ``wait_tensor`` completes (through a tuple selection of a coalesced one)."""
    if not is_wait(wait) or not wait.args or not isinstance(wait.args[0], fx.Node):
        return None
    src = wait.args[0]
    if src.op == "call_function" and src.target is operator.getitem and isinstance(src.args[0], fx.Node):
        src = src.args[0]
    return src if is_collective(src) else None


def waits_of(collective: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes that complete ``collective`` (directly or per tuple element)."""
    out = []
    for u in collective.users:
        if is_wait(u):
            out.append(u)
        elif u.op == "call_function" and u.target is operator.getitem:
            out.extend(w for w in u.users if is_wait(w))
    return out


def pending_inputs(wait: fx.Node) -> list[fx.Node]:
    """The inputs a collective keeps reading until ``wait`` completes it (empty for other nodes)."""
    collective = collective_of(wait)
    if collective is None:
        return []
    return [a for a in collective.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def has_collectives(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` calls a functional collective."""
    return any(is_collective(n) for n in graph.nodes)


def group_ranks(name: str | None) -> tuple[int, ...] | None:
    """The global ranks of the process group ``name``, when this process knows it."""
    if name is None:
        return None
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        from torch.distributed import distributed_c10d as c10d

        group = c10d._resolve_process_group(name)
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # an unknown name (a graph traced elsewhere): no ranks to show
        return None


def resource_name(group: str) -> str:
    """The capability resource that stands for the communicator of traced group ``group``."""
    return f"{RESOURCE_PREFIX}{group}"


def traced_group(resource: str) -> str | None:
    """The traced group a ``comm:<group>`` resource stands for (``None`` for other resources)."""
    return resource[len(RESOURCE_PREFIX):] if resource.startswith(RESOURCE_PREFIX) else None


def describe_group(group: str | None) -> str:
    """``group '0' (ranks 0,1)``: the group and, where known, its ranks."""
    if group is None:
        return "an unnamed group"
    ranks = group_ranks(group)
    where = f" (ranks {','.join(map(str, ranks))})" if ranks is not None else ""
    return f"group {group!r}{where}"


def capability(node: fx.Node, name: str) -> Capability:
    """The registry's declaration for the ops of :data:`NAMESPACES`.

    A collective is capturable (NCCL collectives capture into CUDA graphs), free to
    overlap, runs on the comm lane (``collective=True``) and uses its owner's
    communicator for the group it was traced with (resource ``comm:<group>``). A
    ``wait_tensor`` completes a collective; it runs where its collective does.
    """
    if is_wait(node):
        return Capability(reason="completes a collective: readers of its result follow it", source="registry")
    group = group_of(node)
    if group is None:
        return Capability(reason=f"collective {name} without a named group", source="registry",
                          collective=True)
    return Capability(
        reason=f"collective on {describe_group(group)}: the owner's communicator",
        resources=(resource_name(group),),
        source="registry",
        collective=True,
    )


def rebind(gm: fx.GraphModule, groups: Mapping[str, str]) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives use the groups ``groups`` maps their traced names to.

    Raises:
        KeyError: a collective of ``gm`` names a group ``groups`` does not map.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, env.__getitem__)
        collective, position = _kind(node.target) if node.op == "call_function" else (False, -1)
        if collective:
            if position < len(new.args):
                args = list(new.args)
                args[position] = groups[_name(args[position])]
                new.args = tuple(args)
            else:
                new.kwargs = {**new.kwargs, "group_name": groups[_name(new.kwargs["group_name"])]}
        new.meta = dict(node.meta)
        env[node] = new
    out = fx.GraphModule(gm, graph)
    out.recompile()
    return out
