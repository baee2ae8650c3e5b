"""Lanes after fusion, measured: one Inductor compile's code with its kernels put on lanes.

Each workload is compiled twice with ``backend="inductor"`` (FX graph cache off): once as it
is (one lane), once with ``capturepass.backends.fused_lanes`` rewriting the generated code so
that every fused kernel runs on the lane capturepass's plan gives its FX origins (a kernel
whose origins lie on two lanes stays on the main one), called with side streams bound. This
is the mechanism of ``regions="fused"`` (the default on CUDA) outside capturepass's backend:
Inductor's own graph, no measured choice, no owner. The plan is computed on a copy of the
post-grad graph, as the pass route plans it; Inductor's ``_post_fusion_custom_pass`` maps each
fused kernel's buffers to its lane. Both are captured into CUDA graphs by hand and replayed
interleaved; printed: each one's median replay (ms), the largest difference from eager, and
what the rewrite wrote. Needs CUDA.

    python bench/fused_lanes_probe.py --workloads moe:16 deepseek_v3 qwen2_moe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LanesAfterFusion:
    """The post-grad plan, the fused kernels' lanes and the rewrite of each compile's code."""

    def __init__(self) -> None:
        self.lane: dict[fx.Node, int] = {}
        self.by_name: dict[str, int] = {}
        self.buffers: dict[str, int] = {}
        self.reports: list[dict[str, Any]] = []

    def plan(self, graph: fx.Graph) -> None:
        from capturepass.backends import compile as driver
        from capturepass.ir import meta
        from capturepass.ir.meta import OwnerId

        root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
        inputs = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        copy = fx.Graph()
        value_map: dict[fx.Node, fx.Node] = {}
        copy.output(copy.graph_copy(graph, value_map))
        compiled = driver.compile_graph(fx.GraphModule(root, copy), inputs, driver.resolve(None),
                                        name="post_grad", owner=OwnerId(900_000 + len(self.reports)),
                                        dump_dir=None, regions=False, record=False)
        del compiled
        for node, planned in value_map.items():
            if meta.has_info(planned):
                self.lane[node] = meta.lane_of(planned).index
                self.by_name[node.name] = self.lane[node]

    def after_fusion(self, nodes: list[Any]) -> list[Any]:
        for node in nodes:
            origins = set()
            for inner in node.get_nodes():
                ir = getattr(inner, "node", None)
                origins |= set(getattr(ir, "origins", ()) or ())
            lanes = {self.lane[o] for o in origins if o in self.lane}
            lane = lanes.pop() if len(lanes) == 1 else 0
            for name in node.get_buffer_names():
                self.buffers[name] = lane
        return nodes

    def lane_of(self, writes: list[str], sources: list[str]) -> int | None:
        for w in writes:
            if w in self.buffers:
                return self.buffers[w]
        lanes = {self.by_name[s] for s in sources if s in self.by_name}
        return lanes.pop() if len(lanes) == 1 else None

    def rewrite(self, code: str) -> str:
        from capturepass.backends import fused_lanes

        new, done = fused_lanes.rewrite_module(code, self.lane_of)
        self.reports.append(dict(launches=len(done.launches), side=sum(1 for _, lane in done.launches if lane),
                                 switches=done.switches, records=done.records, waits=done.waits,
                                 held=len(done.held), lanes=done.lanes))
        return new


def compiled(model: Any, lanes: LanesAfterFusion | None) -> Any:
    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()
    if lanes is None:
        return torch.compile(model, backend="inductor", options={"fx_graph_cache": False})
    real = GraphLowering._compile_to_module_lines

    def patched(self: Any, wrapper_code: Any) -> Any:
        wrapper_code.value = lanes.rewrite(wrapper_code.value)
        return real(self, wrapper_code)

    fn = torch.compile(model, backend="inductor", options={"fx_graph_cache": False})
    from capturepass.runtime import code_lanes

    streams = [torch.cuda.Stream() for _ in range(4)]

    def call(*args: Any, **kwargs: Any) -> Any:
        # The rewritten code runs its lanes' body while side streams are bound.
        with inductor_config.patch(post_grad_custom_post_pass=lanes.plan, _post_fusion_custom_pass=lanes.after_fusion), \
                code_lanes.bind(streams):
            GraphLowering._compile_to_module_lines = patched
            try:
                return fn(*args, **kwargs)
            finally:
                GraphLowering._compile_to_module_lines = real

    return call


def captured(fn: Any, args: tuple, kwargs: dict) -> tuple[torch.cuda.CUDAGraph, Any]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args, **kwargs)
    return g, out


def timed_rounds(graphs: list[torch.cuda.CUDAGraph], rounds: int = 30, reps: int = 20) -> list[float]:
    samples: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for i, g in enumerate(graphs):
            g.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                g.replay()
            b.record()
            b.synchronize()
            samples[i].append(a.elapsed_time(b) / reps)
    return [statistics.median(s) for s in samples]


def tensor_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def workload(spec: str) -> tuple[Any, tuple, dict]:
    if spec.startswith("moe"):
        import overlap  # bench/overlap.py

        m, inputs, _, _, _ = overlap.workload("moe", int(spec.split(":")[1]))
        return m, inputs, {}
    import zoo  # bench/zoo.py

    model, vocab = zoo.build(spec, "cuda", "real")
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, vocab, (8, 1), device="cuda", generator=g)
    return model, (), dict(input_ids=ids, use_cache=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["moe:16", "deepseek_v3", "qwen2_moe"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import logging

    logging.getLogger("capturepass").setLevel(logging.ERROR)
    rows = []
    for spec in args.workloads:
        model, a, kw = workload(spec)
        with torch.no_grad():
            ref = tensor_of(model(*a, **kw)).float()
            one = compiled(model, None)
            g1, o1 = captured(one, a, kw)
            lanes = LanesAfterFusion()
            two = compiled(model, lanes)
            g2, o2 = captured(two, a, kw)
            g1.replay(); g2.replay(); torch.cuda.synchronize()
            scale = ref.abs().max().item()
            err1 = (tensor_of(o1).float() - ref).abs().max().item() / scale
            err2 = (tensor_of(o2).float() - ref).abs().max().item() / scale
            same = (tensor_of(o1).float() - tensor_of(o2).float()).abs().max().item() / scale
            t1, t2 = timed_rounds([g1, g2])
        row = dict(workload=spec, one_lane_ms=t1, fused_lanes_ms=t2, ratio=t2 / t1, err_one=err1, err_lanes=err2,
                   lanes_vs_one=same, rewrites=lanes.reports)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del g1, g2, o1, o2, one, two, model
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused_lanes.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
