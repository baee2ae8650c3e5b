"""A bounded CPU soak: compile, run, close, again and again; nothing may accumulate.

Counts that must stay flat from one cycle to the next: live graph owners, live event leases
(``POOL.live()``), lease handles and retained objects of live owners, owners of unowned
resources, and the capability registry's cache. On CPU, captured graphs are simulated for
bookkeeping (retention happens as in a capture). The GPU soak (1000 cycles on the H200) is
not run here.
"""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from backends.e2e_util import compile_eager, new_compiles

import capturepass
from capturepass.ir.capabilities import REGISTRY
from capturepass.runtime import lifetime, resources
from capturepass.runtime.events import POOL
from capturepass.runtime.owner import live_owners

CYCLES = 12


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.routed = nn.Linear(8, 8)

    def forward(self, x):
        with capturepass.lane("shared"):
            s = torch.relu(self.shared(x))
        return s + torch.tanh(self.routed(x))


def _counts() -> dict[str, int]:
    gc.collect()
    # An owner collected while releases were not allowed (an earlier test's, in this process)
    # waits in ``lifetime.DEFERRED`` for the next call of any compiled graph; release it now, so
    # that a count taken before a call and one taken after it see the same process.
    lifetime.drain()
    gc.collect()
    owners = live_owners()
    return {
        "owners": len(owners),
        "leases": POOL.live(),
        "lease handles": sum(o.num_leases for o in owners),
        "retained": sum(o.num_retained for o in owners),
        "unowned resource owners": len(resources._unowned),
        "capability cache": len(REGISTRY._cache),
    }


def _cycle(model: nn.Module, x: torch.Tensor, expected: torch.Tensor) -> int:
    """One compile/run/close cycle; returns what the owners retained while alive."""
    torch._dynamo.reset()
    compiled = compile_eager(model, policy="hints", cudagraphs="monolithic")
    with new_compiles() as graphs, torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    (record,) = graphs
    executor = record.executor
    owners = executor.owners
    retained = sum(o.num_retained for o in owners)
    executor.close()
    # Closing releases at once, without waiting for the collector.
    assert executor.owners == []
    assert all(o.closed and o.num_retained == 0 and o.num_leases == 0 for o in owners)
    del owners
    del compiled, executor, graphs, record
    torch._dynamo.reset()
    return retained


def test_compile_run_close_cycles_leave_nothing_behind():
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    assert _cycle(model, x, expected) > 0  # warm-up; the capture retained the parameters
    base = _counts()
    for i in range(CYCLES):
        assert _cycle(model, x, expected) > 0
        assert _counts() == base, f"cycle {i}: {_counts()} != {base}"
