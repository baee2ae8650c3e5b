"""absorb_streams: Dynamo's stream regions become lane hints; stream ops are removed.

Runs on Dynamo's torch-level graph, before AOT autograd. Dynamo records a
``with torch.cuda.stream(s):`` region as ``meta["custom"]["stream"] = index``
on each node inside it, and explicit stream calls as ``torch.ops.streams.*``
nodes. capturepass derives every record, wait and fork itself from data
dependencies, so this pass

- turns each stream index into a ``capturepass`` lane hint (``stream<index>``;
  the ambient current stream maps to the main lane),
- deletes the ``stream`` key, because Inductor mis-compiles it on CPU and its
  FX cache key ignores ``meta["custom"]``,
- removes ``torch.ops.streams.*`` nodes and the stream/event objects they
  fetched, once unused.

Before::

    %b = mul(%x, 2)  # custom={'stream': 0}

After::

    %b = mul(%x, 2)  # custom={'capturepass': {'lane': 'stream0'}}
"""

from __future__ import annotations

import torch
import torch.fx as fx

from capturepass.ir.meta import HINT_KEY
from capturepass.ir.meta import Stage
from capturepass.passes.base import Pass, PassContext


def _stream_ops() -> frozenset:
    ns = getattr(torch.ops, "streams", None)
    if ns is None:
        return frozenset()
    ops = set()
    for name in ("fork", "join", "record_event", "wait_event", "wait_stream", "synchronize_event",
                 "synchronize_device", "synchronize_stream", "sync_dealloc", "record_stream"):
        packet = getattr(ns, name, None) if hasattr(ns, name) else None
        if packet is not None:
            ops.add(packet)
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


def _is_object_fetch(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "get_external_object_by_index"


def _is_current_stream(index: int) -> bool:
    try:
        from torch._dynamo.graph_bytecode_inputs import get_external_object_by_index
        obj = get_external_object_by_index(index)
    except Exception:
        return False
    if not isinstance(obj, torch.Stream):
        return False
    try:
        return obj == torch.accelerator.current_stream(obj.device)
    except Exception:
        return False


class AbsorbStreams(Pass):
    """Turns Dynamo stream annotations into lane hints and strips them."""

    name = "absorb_streams"
    stage = Stage.DYNAMO
    ensures = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        stream_ops = _stream_ops()
        graph = gm.graph
        for node in list(graph.nodes):
            custom = node.meta.get("custom")
            if isinstance(custom, dict) and "stream" in custom:
                index = custom.pop("stream")
                if HINT_KEY not in custom and isinstance(index, int) and not _is_current_stream(index):
                    custom[HINT_KEY] = {"lane": f"stream{index}"}
                    ctx.count(self.name, "absorbed_nodes")
                if not custom:
                    del node.meta["custom"]
            if node.op == "call_function" and node.target in stream_ops:
                graph.erase_node(node)
                ctx.count(self.name, "removed_stream_ops")
        for node in reversed(list(graph.nodes)):
            if _is_object_fetch(node) and not node.users:
                graph.erase_node(node)
        graph.lint()
        gm.recompile()
