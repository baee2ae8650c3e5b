"""partition: nodes get their segment; breaks get their reasons.

The segment structure was fixed when ``assign_streams`` marked the breaks
(non-capturable ops under a capturing mode) and ``insert_syncs`` joined every
lane before each; this pass materializes it: each run of nodes between breaks
becomes a :class:`~capturepass.ir.meta.SegmentId` (one CUDA graph when
captured; ``monolithic`` has exactly one), every node gets the graph owner, and
each break is listed with its reason. It refuses to cut where a lane has not
joined.

Before::

    %mm = aten.mm.default(%x, %w)  {lane=s0}
    %item = aten._local_scalar_dense.default(%s)  {lane=s0, break='host sync: ...'}

After::

    segment k0:
      %mm = aten.mm.default(%x, %w)  {lane=s0, owner=g0, segment=k0}
    break b0: host sync: ...
    %item = aten._local_scalar_dense.default(%s)  {lane=s0, owner=g0, break='host sync: ...'}
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.ir import meta, verify
from capturepass.ir.meta import Break, BreakSource, Effect, SegmentId
from capturepass.passes.base import PARTITIONED, RETAINED, SYNCED, Pass, PassContext


class Partition(Pass):
    """Assigns segment ids and records breaks, cutting only where all lanes joined."""

    name = "partition"
    requires = (SYNCED, RETAINED)
    ensures = (PARTITIONED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        # Cut only where every lane has joined: the verifier's join rule, on the syncs present.
        # (The other rules are the verify pass's, on the finished graph.)
        verify.check_joins(gm)
        gi = meta.graph_info(gm)
        owner = gi.owner
        segments: list[SegmentId] = []
        breaks = [b for b in gi.breaks if b.source != BreakSource.PARTITION]
        current: SegmentId | None = None
        for node in gm.graph.nodes:
            rec = meta.record_of(node)
            eff = rec.effect
            if eff in (Effect.INPUT, Effect.CONSTANT, Effect.OUTPUT):
                meta.update(node, self.name, owner=owner)
                continue
            if eff is Effect.COMPUTE and rec.brk is not None:
                breaks.append(Break(node=node.name, reason=rec.brk))
                meta.update(node, self.name, owner=owner, segment=None)
                current = None
                continue
            if current is None:
                current = SegmentId(len(segments))
                segments.append(current)
            meta.update(node, self.name, owner=owner, segment=current)
        meta.update_graph(gm, segments=tuple(segments), breaks=tuple(breaks))
        ctx.count(self.name, "segments", len(segments))
        ctx.count(self.name, "breaks", len(breaks))
