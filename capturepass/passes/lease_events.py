"""lease_events: every event gets a lease from its owner's pool, by role.

A lease stands for one event object at run time. Leases come from pools kept
apart by role (fork, join, ...) and belong to exactly one graph owner: inside
a capture the runtime holds the leased event for the graph's whole life, and a
lease never serves two owners, or a capture and eager code. Within one owner,
an event whose last wait has been issued may be recorded again by a later pair
(``cudaStreamWaitEvent`` reads the event's state when it is issued), so a lease
is reused by the next event of its role whose record comes after that wait:
the number of event objects an owner holds is the peak number of live events.

Before::

    %record = capturepass.record(0, 1)  {lane=s1, record=e0, role=join}

After::

    %record = capturepass.record(0, 1)  {lane=s1, record=e0, role=join, lease=l0, owner=g0}
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.errors import VerificationError
from capturepass.ir import meta
from capturepass.ir.meta import Effect, EventId, EventRole, LeaseId
from capturepass.passes.base import LEASED, SYNCED, Pass, PassContext


class LeaseEvents(Pass):
    """Assigns each event a role-separated lease owned by the graph owner."""

    name = "lease_events"
    requires = (SYNCED,)
    ensures = (LEASED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        owner = meta.graph_info(gm).owner
        nodes = list(gm.graph.nodes)
        record_at: dict[EventId, int] = {}
        last_wait: dict[EventId, int] = {}
        role_of: dict[EventId, EventRole] = {}
        syncs: list[fx.Node] = []  # the records and waits, in program order
        for i, node in enumerate(nodes):
            rec = meta.info(node)
            if rec.effect is Effect.RECORD:
                record_at[rec.event] = i
                role_of[rec.event] = rec.role or EventRole.FORK
                syncs.append(node)
            elif rec.effect is Effect.WAIT:
                last_wait[rec.event] = i
                syncs.append(node)
        free: dict[str, list[tuple[int, LeaseId]]] = {}
        lease_of: dict[EventId, LeaseId] = {}
        n_leases = 0
        for event in sorted(record_at, key=record_at.__getitem__):
            role = role_of[event]
            pool = free.setdefault(role, [])
            start = record_at[event]
            reusable = [entry for entry in pool if entry[0] < start]
            if reusable:
                entry = min(reusable, key=lambda e: e[1].index)
                pool.remove(entry)
                lease = entry[1]
                ctx.count(self.name, "reused")
            else:
                lease = LeaseId(owner, role, n_leases)
                n_leases += 1
            lease_of[event] = lease
            pool.append((last_wait.get(event, start), lease))
        for node in syncs:
            rec = meta.info(node)
            if rec.event not in lease_of:
                raise VerificationError(
                    "wait-before-record",
                    node.name,
                    f"%{node.name} waits for {rec.event} on {rec.lane}, but no node records it "
                    f"(created by {rec.created_by})",
                )
            meta.update(node, self.name, lease=lease_of[rec.event], owner=owner)
        ctx.count(self.name, "leases", n_leases)
        ctx.count(self.name, "events", len(record_at))
