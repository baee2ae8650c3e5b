"""verify: the standalone verifier as the pipeline's last check before emission.

Runs :func:`capturepass.ir.verify.verify` with every property established so
far. With ``verify=True`` the ``VerifyEach`` instrument also runs it after every pass, so that a
broken invariant is reported at the pass that broke it.
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.ir import verify as ir_verify
from capturepass.passes.base import PARTITIONED, VERIFIED, Pass, PassContext


class Verify(Pass):
    """Checks every synchronisation invariant of the annotated graph."""

    name = "verify"
    requires = (PARTITIONED,)
    ensures = (VERIFIED,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        ir_verify.verify(gm)
        ctx.count(self.name, "runs")
