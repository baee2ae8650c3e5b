"""insert_retention: each captured segment retains every owner of storage it bakes in.

A CUDA graph records raw device addresses. Storage the graph did not allocate
itself (parameters and buffers passed as static inputs, module constants,
owner-bound workspaces) must stay alive, at the same address, as long as the
graph can be replayed; otherwise the pool hands the block to someone else and
replay corrupts their data. This pass adds, at the end of every captured
segment, one ``capturepass.retain`` listing those storage owners; at capture
time the runtime ties each to the graph's life (``CUDAGraph.retain_object``
where torch has it, the owner's own list elsewhere). Uncaptured graphs
(``cudagraphs="none"``) get no retention: nothing outlives a call.

Before::

    segment k0:
      %mm = aten.mm.default(%x, %weight)  {lane=s0}
    return (%mm,)

After::

    segment k0:
      %mm = aten.mm.default(%x, %weight)  {lane=s0}
      %retain = capturepass.retain([%weight], 0)  {lane=s0, by=insert_retention, why=static inputs and constants of k0}
    return (%mm,)
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.ir import analysis, meta, ops
from capturepass.ir.meta import MAIN_LANE, Effect
from capturepass.passes.base import BOUND, RETAINED, SYNCED, Pass, PassContext


class InsertRetention(Pass):
    """Adds a retention node at the end of every captured segment."""

    name = "insert_retention"
    requires = (SYNCED, BOUND)
    ensures = (RETAINED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        gi = meta.graph_info(gm)
        if not gi.captured:
            return
        external = analysis.external_owners(gm)
        values: list[fx.Node] = []
        resources: list = []
        seg = 0
        has_work = False
        for node in list(gm.graph.nodes):
            eff = meta.effect_of(node)
            boundary = eff is Effect.OUTPUT or (eff is Effect.COMPUTE and meta.info(node).brk is not None)
            if boundary:
                if has_work and (values or resources):
                    retain = ops.insert_retain(
                        gm.graph, node, values, MAIN_LANE, self.name, f"storage owners of segment {seg}"
                    )
                    meta.update(retain, self.name, resources=tuple(resources))
                    ctx.count(self.name, "retained", len(values) + len(resources))
                values, resources, has_work = [], [], False
                seg += 1
                continue
            if eff is not Effect.COMPUTE:
                continue
            has_work = True
            for arg in node.all_input_nodes:
                if arg in external and arg not in values:
                    values.append(arg)
            for binding in meta.info(node).resources:
                if binding not in resources:
                    resources.append(binding)
