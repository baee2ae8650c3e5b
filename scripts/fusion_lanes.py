"""How one lane's fused kernels fall on the lanes of capturepass's plan (docs/one_compile.md).

Compiles each named zoo model with ``backend="inductor"`` (no lanes written into its graph) at a
decode shape. A post-grad pass plans capturepass's lanes on a copy of the graph, as the pass
route plans them, and leaves the graph as it is; Inductor's ``_post_fusion_custom_pass`` then
maps every scheduler node after fusion to the lanes of its IR nodes' FX origins. Prints, per
graph, how many nodes lie on main alone, on one side lane alone, and on two or more lanes::

    .venv/bin/python scripts/fusion_lanes.py llama qwen2_moe deepseek_v3 [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import logging
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx

from capturepass.backends import compile as driver
from capturepass.testing import zoo


class _Lanes:
    """The plan's lane of each node of the graphs Inductor compiles, and what fusion made of them."""

    def __init__(self) -> None:
        self.lane: dict[fx.Node, str] = {}
        self.names: list[str] = []
        self.graphs: list[dict[str, Any]] = []

    def plan(self, graph: fx.Graph) -> None:
        """Inductor's post-grad custom pass: plans a copy, leaves ``graph`` as it is."""
        lanes, self.names = driver.plan_lanes(graph)
        self.lane.update({node: f"s{lane}" for node, lane in lanes.items()})

    def after_fusion(self, nodes: list[Any]) -> list[Any]:
        """Inductor's post-fusion pass: counts the fused nodes by the lanes of their origins."""
        by_lanes: collections.Counter[tuple[str, ...]] = collections.Counter()
        extern = 0
        for node in nodes:
            origins = set()
            for inner in node.get_nodes():
                ir = getattr(inner, "node", None)
                origins |= set(getattr(ir, "origins", ()) or ())
            extern += type(node).__name__ == "ExternKernelSchedulerNode"
            by_lanes[tuple(sorted({str(self.lane[o]) for o in origins if o in self.lane}))] += 1
        self.graphs.append({"lanes": self.names, "nodes": len(nodes), "extern": extern, "by_lanes": by_lanes})
        return nodes


def fused_lanes(fn: Any, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Calls ``torch.compile(fn, backend="inductor")`` on ``args`` with the plan's lanes read
    after fusion; returns one record per graph: ``lanes`` (names), ``nodes`` (after fusion),
    ``extern`` (library calls among them) and ``by_lanes`` (a count per tuple of lanes)."""
    torch._dynamo.reset()
    lanes = _Lanes()
    with inductor_config.patch(post_grad_custom_post_pass=lanes.plan, _post_fusion_custom_pass=lanes.after_fusion,
                               fx_graph_cache=False):
        with torch.no_grad():
            torch.compile(fn, backend="inductor")(*args, **kwargs)
    return lanes.graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="zoo names (capturepass.testing.zoo.ZOO)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=8, help="decode batch (sequences of one token)")
    args = p.parse_args()
    logging.getLogger("capturepass").setLevel(logging.ERROR)
    for name in args.models:
        model, _ = zoo.build(name, device=args.device)
        ids = torch.randint(0, zoo.VOCAB, (args.batch, 1), generator=torch.Generator().manual_seed(0))
        for g in fused_lanes(model, input_ids=ids.to(args.device)):
            counts = g["by_lanes"]
            main_only = counts.get(("s0",), 0)
            side_only = sum(n for k, n in counts.items() if len(k) == 1 and k != ("s0",))
            several = sum(n for k, n in counts.items() if len(k) > 1)
            print(f"{name}: lanes {g['lanes']}; {g['nodes']} scheduler nodes after fusion ({g['extern']} extern); "
                  f"main alone {main_only}, one side lane alone {side_only}, two or more lanes {several}, "
                  f"no origin {counts.get((), 0)}")


if __name__ == "__main__":
    main()
