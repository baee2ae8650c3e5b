"""The ``capturepass::`` side-effect ops, and the only helpers that create them.

Sync, release and retention nodes are real ``torch.library`` ops so that graphs
holding them print, lint and trace like any other graph. Their arguments are
integer handles (lane and event indices), never stream or event objects or
pointers; what they do at run time is decided by the emitted runtime, which maps
handles to real objects per graph owner. Their default kernels do nothing: a
graph that still holds them after emission is only a record of the plan.

Each op is marked side-effecting, so that FX dead-code elimination never drops
a record or a wait that orders two lanes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

from capturepass.ir import meta
from capturepass.ir.meta import MAIN_LANE, Effect, EventId, EventRole, LaneId

_lib = torch.library.Library("capturepass", "FRAGMENT")
_lib.define("record(int event, int lane) -> ()")
_lib.define("wait(int event, int lane) -> ()")
_lib.define("release(Tensor[] values, int lane) -> ()")
_lib.define("retain(Tensor[] values, int lane) -> ()")
_lib.define("join_external(int stream, int lane, bool into) -> ()")


def _noop(*args: object) -> None:
    return None


for _name in ("record", "wait", "release", "retain", "join_external"):
    _lib.impl(_name, _noop, "CompositeExplicitAutograd")
    _lib.impl(_name, _noop, "Meta")

record = torch.ops.capturepass.record.default
wait = torch.ops.capturepass.wait.default
release = torch.ops.capturepass.release.default
retain = torch.ops.capturepass.retain.default
join_external = torch.ops.capturepass.join_external.default

for _op in (record, wait, release, retain, join_external):
    has_side_effect(_op)

CAPTUREPASS_OPS = frozenset({record, wait, release, retain, join_external})


def insert_record(
    graph: fx.Graph, after: fx.Node, lane: LaneId, event: EventId, role: EventRole, by: str, why: str
) -> fx.Node:
    """Inserts ``capturepass.record`` of ``event`` on ``lane`` right after ``after``."""
    with graph.inserting_after(after):
        node = graph.call_function(record, (event.index, lane.index))
    meta.create(node, by, effect=Effect.RECORD, lane=lane, event=event, role=role, why=why)
    return node


def insert_wait(
    graph: fx.Graph, before: fx.Node, lane: LaneId, event: EventId, role: EventRole, by: str, why: str
) -> fx.Node:
    """Inserts ``capturepass.wait`` of ``event`` on ``lane`` right before ``before``."""
    with graph.inserting_before(before):
        node = graph.call_function(wait, (event.index, lane.index))
    meta.create(node, by, effect=Effect.WAIT, lane=lane, event=event, role=role, why=why)
    return node


def insert_release(
    graph: fx.Graph, before: fx.Node, values: Sequence[fx.Node], lane: LaneId, by: str, why: str
) -> fx.Node:
    """Inserts a deferred ``capturepass.release`` of ``values`` on ``lane`` before ``before``."""
    with graph.inserting_before(before):
        node = graph.call_function(release, (list(values), lane.index))
    meta.create(node, by, effect=Effect.RELEASE, lane=lane, why=why)
    return node


def insert_retain(
    graph: fx.Graph, before: fx.Node, values: Sequence[fx.Node], lane: LaneId, by: str, why: str
) -> fx.Node:
    """Inserts ``capturepass.retain`` of ``values`` before ``before``."""
    with graph.inserting_before(before):
        node = graph.call_function(retain, (list(values), lane.index))
    meta.create(node, by, effect=Effect.RETAIN, lane=lane, why=why)
    return node


def insert_join_external(
    graph: fx.Graph, before: fx.Node, stream: int, name: str, into: bool, by: str, why: str
) -> fx.Node:
    """Inserts ``capturepass.join_external`` before ``before``: the main lane waits for external
    stream ``stream`` (``into``), or the external stream waits for the main lane."""
    with graph.inserting_before(before):
        node = graph.call_function(join_external, (stream, MAIN_LANE.index, into))
    meta.create(node, by, effect=Effect.EXTERNAL, lane=MAIN_LANE, external=name,
                role=EventRole.IN if into else EventRole.OUT, why=why)
    return node


def is_capturepass_op(node: fx.Node) -> bool:
    """Whether ``node`` calls one of the ``capturepass::`` ops."""
    return node.op == "call_function" and node.target in CAPTUREPASS_OPS
