"""annotate_capabilities: every compute node gets a capability answer and a cost.

Asks the capability registry (``capturepass.ir.capabilities``) about each op
call, with the node's concrete shapes, and the cost model
(``capturepass.ir.cost``) for its FLOPs and bytes. It also records which inputs
the graph writes (``GraphInfo.mutated_inputs``, from the ops' schemas: see
``capturepass.ir.effects``), so that the runtime can make every write reach the
caller. Later passes read only the
answers: ``assign_streams`` keeps non-capturable and serializing ops on the main
lane, ``partition`` turns non-capturable ops into breaks. A node the runtime
saw fail under a real capture (``PassContext.not_capturable``) is answered not
capturable, with the failure as its reason, and the decision is recorded.

Before::

    %item : int = aten._local_scalar_dense.default(%sum_1)

After::

    %item : int = aten._local_scalar_dense.default(%sum_1)  {capturable=no}
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from capturepass.ir import analysis, cost, effects, meta
from capturepass.ir.meta import Overlap
from capturepass.passes.base import CAPABILITIES, HINTS, Pass, PassContext


def graph_device(gm: fx.GraphModule) -> torch.device | None:
    """The accelerator the graph runs on, if any tensor lives on one; else the first device."""
    first = None
    for node in gm.graph.nodes:
        dev = analysis.node_device(node)
        if dev is None:
            continue
        if dev.type != "cpu":
            return dev
        first = first or dev
    return first


class AnnotateCapabilities(Pass):
    """Queries the capability registry and the cost model for every compute node."""

    name = "annotate_capabilities"
    requires = (HINTS,)
    ensures = (CAPABILITIES,)

    def __init__(self, registry_key: str = "") -> None:
        self._registry_key = registry_key

    def config(self) -> tuple:
        return (self._registry_key,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        device = graph_device(gm)
        query = ctx.registry.query
        forced = ctx.not_capturable
        estimator = cost.Estimator()
        for node in analysis.compute_nodes(gm.graph):
            cap = query(node, device)
            why = forced.get(node.name)
            if why is not None:
                if cap.capturable:
                    cap = dataclasses.replace(cap, capturable=False, reason=why, source="capture")
                meta.add_decision(gm, f"%{node.name} ({node.target}): {why}: made a break")
            alias = analysis.aliases_input(node) is not None
            meta.update(node, self.name, capability=cap, cost=estimator.estimate(node, alias))
            if not cap.capturable:
                ctx.count(self.name, "not_capturable")
            if cap.overlap != Overlap.SAFE:
                ctx.count(self.name, "serialized")
        mutated = effects.mutated_inputs(gm)
        if mutated:
            meta.update_graph(gm, mutated_inputs=mutated)
            ctx.count(self.name, "mutated_inputs", len(mutated))
