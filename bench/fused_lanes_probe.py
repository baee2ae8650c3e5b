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
import dataclasses
import json
import os
import statistics
import sys
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled(model: Any, lanes: bool) -> tuple[Any, list[Any]]:
    """``torch.compile(model, backend="inductor")``; with ``lanes``, every compile's code
    rewritten with the lanes of capturepass's plan of its post-grad graph (planned on a copy), and
    called with side streams bound. Returns the callable and the rewrites' summaries."""
    from capturepass.backends import compile as driver
    from capturepass.backends import fused_inductor
    from capturepass.runtime import code_lanes

    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor", options={"fx_graph_cache": False})
    if not lanes:
        return fn, []
    rewriting = fused_inductor.Compiling({})

    def plan(graph: fx.Graph) -> None:
        planned, _ = driver.plan_lanes(graph)
        rewriting.lane_by_name = {node.name: lane for node, lane in planned.items()}

    streams = [torch.cuda.Stream() for _ in range(4)]

    def call(*args: Any, **kwargs: Any) -> Any:
        with inductor_config.patch(post_grad_custom_post_pass=plan), rewriting, code_lanes.bind(streams):
            return fn(*args, **kwargs)

    return call, rewriting.summaries


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
            one, _ = compiled(model, False)
            g1, o1 = captured(one, a, kw)
            two, reports = compiled(model, True)
            g2, o2 = captured(two, a, kw)
            g1.replay(); g2.replay(); torch.cuda.synchronize()
            scale = ref.abs().max().item()
            err1 = (tensor_of(o1).float() - ref).abs().max().item() / scale
            err2 = (tensor_of(o2).float() - ref).abs().max().item() / scale
            same = (tensor_of(o1).float() - tensor_of(o2).float()).abs().max().item() / scale
            t1, t2 = timed_rounds([g1, g2])
        row = dict(workload=spec, one_lane_ms=t1, fused_lanes_ms=t2, ratio=t2 / t1, err_one=err1, err_lanes=err2,
                   lanes_vs_one=same, rewrites=[dataclasses.asdict(r) for r in reports])
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
