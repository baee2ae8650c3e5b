"""read_hints: lane hints become typed metadata; every node gets its record.

The first pass on the ATen graph. It gives every node a
:class:`~capturepass.ir.meta.NodeInfo` (its effect and, where the user or
Dynamo marked it, the hinted lane name) and removes the transport tag
``meta["custom"]["capturepass"]`` so that nothing capturepass-specific reaches
an inner compiler. With ``policy="off"`` hints are read (and reported) but
dropped.

Before::

    %relu = aten.relu.default(%addmm)   # custom={'capturepass': {'lane': 'aux'}}

After::

    %relu : f32[4,8] = aten.relu.default(%addmm)  {hint=aux}
"""

from __future__ import annotations

import torch.fx as fx

from capturepass.errors import HintError
from capturepass.ir.meta import HINT_KEY
from capturepass.ir import meta
from capturepass.ir.meta import MAIN_LANE_NAME
from capturepass.passes.base import HINTS, Pass, PassContext


def _hint_of(node: fx.Node) -> str | None:
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    tag = custom.pop(HINT_KEY, None)
    custom.pop("stream", None)
    if not custom:
        node.meta.pop("custom", None)
    if tag is None:
        return None
    name = tag.get("lane") if isinstance(tag, dict) else None
    if not isinstance(name, str) or not name:
        raise HintError(f"node %{node.name}: malformed capturepass hint {tag!r}; expected {{'lane': NAME}}")
    if name == MAIN_LANE_NAME:
        raise HintError(
            f"node %{node.name}: a hint names the main lane {name!r}; unhinted code already runs there, "
            "so name an auxiliary lane"
        )
    return name


class ReadHints(Pass):
    """Reads lane hints into typed metadata and strips the transport tag."""

    name = "read_hints"
    ensures = (HINTS,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        use_hints = ctx.options.policy != "off"
        dropped = 0
        # Records are frozen (passes replace them): nodes with the same effect and hint share one.
        records: dict[tuple[meta.Effect, str | None], meta.NodeInfo] = {}
        for node in gm.graph.nodes:
            hint = _hint_of(node)
            effect = meta.effect_of(node)
            if hint is not None and not use_hints:
                dropped += 1
                hint = None
            if hint is not None and effect is not meta.Effect.COMPUTE:
                hint = None  # inputs and constants live on the main lane
            record = records.get((effect, hint))
            if record is None:
                record = records[(effect, hint)] = meta.NodeInfo(effect=effect, hint=hint)
            meta.set_info(node, record)
            if hint is not None:
                ctx.count(self.name, "hinted_nodes")
        if dropped:
            meta.add_decision(gm, f"policy=off: ignored the lane hints of {dropped} node(s)")
