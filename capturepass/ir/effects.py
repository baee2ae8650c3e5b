"""Storage effects: what each node reads and writes, and the order that imposes.

Data edges are not the only dependencies of a graph. A node that writes a
storage (an in-place op on an input or a buffer, or on a view of one;
functionalization's write-back ``copy_``; a KV-cache ``index_put_``; a custom
op's ``mutates_args`` where it was not functionalized) must run after every
earlier read of that storage and before every later one, on whatever lane they
run; and ops that draw from hidden state (the random-number generator's offset)
must draw in program order. Program order is the graph's meaning: a schedule is
correct when every storage (and the hidden state) sees its accesses in the order
a sequential run of the graph would.

This module is the one model of those effects, read from op schemas:

- a node *reads* the storage root of every tensor argument (a view is a read
  of its base's storage: :func:`capturepass.ir.analysis.storage_root`);
- a node *writes* the roots of the arguments its schema marks ``Tensor(a!)``
  (an op whose return aliases a written argument, such as ``add_`` or
  ``copy_``, returns that storage: a later reader of its result reads it);
- a random op (tag ``nondeterministic_seeded``) reads and writes
  :data:`RNG`, the generator's hidden state;
- a functional collective returns a new tensor (its own storage) and keeps
  reading its inputs until its ``wait_tensor``, which returns the collective's
  output storage (``ir.collectives``): the wait reads the collective's inputs
  too, so a later write of an input is ordered after the wait, not only after
  the collective.

:func:`order_deps` turns the effects into the extra dependencies a scheduler
and ``insert_syncs`` must honour; the verifier checks the same rules from
:func:`accesses` with its own happens-before. Graphs without writes and random
ops (most inference graphs) cost one schema lookup per node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.fx as fx

from capturepass.ir import analysis, meta
from capturepass.ir.meta import Effect


class _HiddenState:
    """A storage no tensor names: the device generator's offset."""

    name = "rng"

    def __repr__(self) -> str:
        return "<hidden state rng>"


RNG = _HiddenState()
"""The random-number generator's hidden state, as a storage random ops read and write."""

# id(op) -> (op, written argument positions with their names, random)
_OP_EFFECTS: dict[int, tuple[object, tuple[tuple[int, str], ...], bool]] = {}


def _op_effects(target: object) -> tuple[tuple[tuple[int, str], ...], bool]:
    entry = _OP_EFFECTS.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1], entry[2]
    schema = getattr(target, "_schema", None)
    written: tuple[tuple[int, str], ...] = ()
    random = False
    if schema is not None:
        written = tuple(
            (i, formal.name)
            for i, formal in enumerate(schema.arguments)
            if formal.alias_info is not None and formal.alias_info.is_write
        )
        tags = getattr(target, "tags", ())
        random = torch.Tag.nondeterministic_seeded in tags
    if isinstance(target, torch._ops.OpOverload):
        _OP_EFFECTS[id(target)] = (target, written, random)
    return written, random


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


def written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments of ``node`` whose storage it writes (per its schema)."""
    if node.op != "call_function":
        return []
    written, _ = _op_effects(node.target)
    out: list[fx.Node] = []
    for i, name in written:
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        out.extend(_nodes_in(value))
    return out


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from the random-number generator (hidden state)."""
    return node.op == "call_function" and _op_effects(node.target)[1]


def effect_root(node: fx.Node) -> fx.Node:
    """The storage ``node``'s value lives in (:func:`capturepass.ir.analysis.storage_root`)."""
    return analysis.storage_root(node)


Storage = object  # an effect root (fx.Node) or RNG


@dataclasses.dataclass(frozen=True)
class Access:
    """The storages one node touches."""

    reads: tuple[Storage, ...]
    writes: tuple[Storage, ...]


_NONE = Access((), ())


def accesses(node: fx.Node) -> Access:
    """What ``node`` reads and writes, as storage roots (and :data:`RNG`)."""
    eff = meta.effect_of(node)
    if eff is Effect.OUTPUT:
        return Access(tuple(dict.fromkeys(effect_root(a) for a in node.all_input_nodes)), ())
    if eff is not Effect.COMPUTE or node.op != "call_function":
        return _NONE
    written, random = _op_effects(node.target)
    reads = [effect_root(a) for a in node.all_input_nodes]
    pending = analysis.pending_reads(node)
    if pending:
        reads.extend(effect_root(a) for a in pending)
    writes = [effect_root(a) for a in written_args(node)] if written else []
    if random:
        reads.append(RNG)
        writes.append(RNG)
    if not reads and not writes:
        return _NONE
    return Access(tuple(dict.fromkeys(reads)), tuple(dict.fromkeys(writes)))


def has_effects(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` writes a storage or draws random numbers."""
    for node in graph.nodes:
        if node.op == "call_function" and meta.effect_of(node) is Effect.COMPUTE:
            written, random = _op_effects(node.target)
            if written or random:
                return True
    return False


def written_roots(nodes: Iterable[fx.Node]) -> set[Storage]:
    """Every storage some node of ``nodes`` writes (:data:`RNG` included)."""
    out: set[Storage] = set()
    for node in nodes:
        if node.op != "call_function":
            continue
        written, random = _op_effects(node.target)
        if (written or random) and meta.effect_of(node) is Effect.COMPUTE:
            out.update(accesses(node).writes)
    return out


def mutated_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the placeholders whose storage the graph writes (the caller sees the write)."""
    written = written_roots(gm.graph.nodes)
    if not written:
        return frozenset()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(placeholders) if n in written)


def describe(storage: Storage) -> str:
    """A storage's name in messages: ``%arg0_1`` or ``the RNG state``."""
    return "the RNG state" if storage is RNG else f"%{storage.name}"


@dataclasses.dataclass(frozen=True)
class Dep:
    """One dependency a storage effect adds: ``node`` must run after ``earlier``.

    Attributes:
        earlier: the node that must run first.
        kind: ``"raw"`` (a read after a write) or ``"war"`` (a write after a read). An
            op reads what it writes (its written arguments are inputs), so a write after a
            write is a ``"raw"`` too.
        storage: the storage root (or :data:`RNG`) both access.
    """

    earlier: fx.Node
    kind: str
    storage: Storage

    def why(self, node: fx.Node) -> str:
        """The reason as the dump prints it: ``%mm->%copy_ (war %arg0_1)``, ``(raw rng)``."""
        storage = "rng" if self.storage is RNG else f"%{self.storage.name}"
        return f"%{self.earlier.name}->%{node.name} ({self.kind} {storage})"


def order_deps(nodes: Iterable[fx.Node]) -> dict[fx.Node, list[Dep]]:
    """The dependencies storage effects add to data edges, for the nodes given in program order.

    For every storage some node writes: a read depends on the last earlier write (read after
    write), and a write on every read since that write (write after read). Every written
    argument is also read, so a write follows the last earlier write too. A node's data
    inputs may be among them (harmless). Storages nobody writes add nothing.
    """
    nodes = list(nodes)
    written = written_roots(nodes)
    if not written:
        return {}
    last_write: dict[Storage, fx.Node] = {}
    reads_since: dict[Storage, list[fx.Node]] = {}
    deps: dict[fx.Node, list[Dep]] = {}
    for node in nodes:
        acc = accesses(node)
        if not acc.reads and not acc.writes:
            continue
        mine: list[Dep] = []
        for root in acc.reads:
            if root not in written:
                continue
            w = last_write.get(root)
            if w is not None and w is not node:
                mine.append(Dep(w, "raw", root))
        for root in acc.writes:
            for r in reads_since.get(root, ()):
                if r is not node:
                    mine.append(Dep(r, "war", root))
        if mine:
            deps[node] = mine
        for root in acc.reads:
            if root in written:
                reads_since.setdefault(root, []).append(node)
        for root in acc.writes:
            last_write[root] = node
            reads_since[root] = []
    return deps
