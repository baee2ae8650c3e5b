"""bind_resources: owner-bound resources requested by ops are bound to owner and lane.

An op that declares resources in its capability (workspaces, scratch, channel
buffers; ``register_capability(op, resources=("workspace",))``) gets one
binding per resource name, keyed by the graph owner and the node's lane. Two
owners (a target model and its speculative draft) or two lanes of one owner
therefore never share a buffer: the runtime allocates one per binding, and the
retention pass keeps each alive as long as the captures that use it.

Before::

    %out = mylib.fused_allreduce.default(%x)  {lane=s1}

After::

    %out = mylib.fused_allreduce.default(%x)  {lane=s1, resources=[workspace@g0/s1]}
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.ir import analysis, meta
from capturepass.ir.meta import ResourceBinding
from capturepass.passes.base import BOUND, CAPABILITIES, LANES, Pass, PassContext


class BindResources(Pass):
    """Binds every declared resource to the node's owner and lane."""

    name = "bind_resources"
    requires = (CAPABILITIES, LANES)
    ensures = (BOUND,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        owner = meta.graph_info(gm).owner
        for node in analysis.compute_nodes(gm.graph):
            rec = meta.info(node)
            if rec.capability is None or not rec.capability.resources:
                continue
            lane = meta.lane_of(node)
            bindings = tuple(ResourceBinding(name, owner, lane) for name in rec.capability.resources)
            meta.update(node, self.name, resources=bindings)
            ctx.count(self.name, "bindings", len(bindings))
