"""Compile-time scaling of the capturepass ATen pipeline, and its share of an Inductor compile.

Run: ``.venv/bin/python bench/compile_scaling.py [--sizes 1000,10000,100000] [--repeat 3]``

Part 1 builds synthetic functional ATen graphs of about the requested node
counts directly as ``fx.Graph``s (no tracing), with fake-tensor values in
``node.meta["val"]``, and runs the ATen-stage passes up to and including
``verify`` (``emit`` is left out: it generates code) with ``policy="auto"``.
Two shapes:

- ``layers`` (the reference): a stack of layers; a layer forks the running
  activation into parallel branches, each a chain of ``aten.t`` (a view of a
  weight), ``aten.mm``, ``aten.add`` and ``aten.relu``; half-way, a branch
  reads a view of its neighbour's value (a cross-lane read of a view, which
  exercises the deferred-release logic), and the branches are joined by a
  sum. A fraction of the layers put their first branch on a hinted lane, so
  hinted and automatic lanes coexist. With ``--breaks-every N`` a host
  synchronisation (``aten._local_scalar_dense``) every N layers cuts the graph
  into segments.
- ``lanes``: two hinted lanes that live as long as the graph: a producer lane
  (``t``/``mm``/``relu``) whose every value a consumer lane reads, and the main
  lane reading the consumer now and then. The producer never waits for the
  consumer, so every value it allocates needs a deferred release, pending until
  the segment ends: the shape that makes per-node scans of pending work
  quadratic.

Each graph is built once per size (fake-tensor propagation is the slow part);
every run gets a fresh copy of it. The script prints, per shape and size, the
median over ``--repeat`` runs of the total time, the time per node and the
time of each pass, and the ratio t(largest)/t(next largest).

Part 2 compiles ``capturepass.testing.models.MoEBlock()`` (small, CPU) with
``backend="capturepass"`` and with ``backend="inductor"``, and compares the
capturepass passes (all but ``emit``, from the driver's timings) with the
whole Inductor compile (first call, minus an eager call), cold (a fresh
Inductor cache directory) and warm (a second compile on the same cache).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from capturepass.backends.compile import compile_graph
from capturepass.ir import meta
from capturepass.ir.meta import HINT_KEY, GraphInfo, OwnerId
from capturepass.ir.options import Options

aten = torch.ops.aten

# Shapes are small: the passes look at metadata only.
TOKENS = 32
WIDTH = 64
N_WEIGHTS = 16
BRANCHES = 4
STEPS = 6  # chain links per branch and layer


class _Builder:
    """Appends ATen calls to an ``fx.Graph``, computing each fake value as it goes."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.hint: str | None = None
        self.count = 0

    def placeholder(self, name: str, shape: Sequence[int]) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(*shape)
        self.count += 1
        return node

    def call(self, op, *args) -> fx.Node:
        node = self.graph.call_function(op, args)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with self.mode:
            node.meta["val"] = op(*vals)
        if self.hint is not None:
            node.meta["custom"] = {HINT_KEY: {"lane": self.hint}}
        self.count += 1
        return node

    def host_sync(self, x: fx.Node) -> fx.Node:
        """A data-dependent scalar read (not capturable): ``x.sum().item()``."""
        s = self.call(aten.sum.default, x)
        node = self.graph.call_function(aten._local_scalar_dense.default, (s,))
        node.meta["val"] = 0  # a host scalar; fake mode cannot produce its value
        self.count += 1
        return node


def _layers(b: _Builder, n_nodes: int, rng: random.Random, hint_fraction: float, breaks_every: int) -> tuple:
    x = b.placeholder("x", (TOKENS, WIDTH))
    weights = [b.placeholder(f"w{i}", (WIDTH, WIDTH)) for i in range(N_WEIGHTS)]
    biases = [b.placeholder(f"b{i}", (WIDTH,)) for i in range(N_WEIGHTS)]
    layer = 0
    widx = 0
    while b.count < n_nodes:
        hinted = rng.random() < hint_fraction
        heads: list[fx.Node] = []
        mids: list[fx.Node] = []
        for br in range(BRANCHES):
            b.hint = "side" if hinted and br == 0 else None
            h = x
            for step in range(STEPS):
                if step == STEPS // 2 and br > 0:
                    # Read the neighbour's mid value through a view: a cross-lane read of a view.
                    v = b.call(aten.view.default, mids[br - 1], [TOKENS, WIDTH])
                    h = b.call(aten.add.Tensor, h, v)
                w = weights[widx % N_WEIGHTS]
                bias = biases[widx % N_WEIGHTS]
                widx += 1
                wt = b.call(aten.t.default, w)
                m = b.call(aten.mm.default, h, wt)
                a = b.call(aten.add.Tensor, m, bias)
                h = b.call(aten.relu.default, a)
                if step == STEPS // 2 - 1:
                    mids.append(h)
            heads.append(h)
        b.hint = None
        acc = heads[0]
        for h in heads[1:]:
            acc = b.call(aten.add.Tensor, acc, h)
        x = b.call(aten.mul.Tensor, acc, 1.0 / BRANCHES)
        layer += 1
        if breaks_every and layer % breaks_every == 0:
            b.host_sync(x)
    return (x,), frozenset(range(1, 1 + 2 * N_WEIGHTS))


def _lanes(b: _Builder, n_nodes: int, rng: random.Random, hint_fraction: float, breaks_every: int) -> tuple:
    x = b.placeholder("x", (TOKENS, WIDTH))
    w = b.placeholder("w", (WIDTH, WIDTH))
    p = c = m = x
    step = 0
    while b.count < n_nodes:
        b.hint = "producer"
        p = b.call(aten.relu.default, b.call(aten.mm.default, p, b.call(aten.t.default, w)))
        b.hint = "consumer"
        c = b.call(aten.add.Tensor, c, p)
        b.hint = None
        step += 1
        if step % 8 == 0:
            m = b.call(aten.add.Tensor, m, c)
        if breaks_every and step % (8 * breaks_every) == 0:
            b.host_sync(m)
    b.hint = None
    return (p, c, m), frozenset({1})


SHAPES = {"layers": _layers, "lanes": _lanes}


def build_template(
    shape: str, n_nodes: int, hint_fraction: float = 0.1, breaks_every: int = 0, seed: int = 0
) -> tuple[fx.Graph, GraphInfo]:
    """A synthetic ATen graph of about ``n_nodes`` nodes (see the module docstring), and its record."""
    b = _Builder()
    outputs, static = SHAPES[shape](b, n_nodes, random.Random(seed), hint_fraction, breaks_every)
    b.graph.output(outputs)
    gi = GraphInfo(
        name="inference",
        owner=OwnerId(0),
        cudagraphs="breakable" if breaks_every else "none",
        static_inputs=static,
    )
    return b.graph, gi


def fresh_copy(template: fx.Graph, gi: GraphInfo) -> fx.GraphModule:
    """A new graph module with the template's nodes; fake values are shared, hint tags copied."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in template.nodes:
        new = graph.node_copy(node, env.__getitem__)
        new.meta = {"val": node.meta["val"]} if "val" in node.meta else {}
        custom = node.meta.get("custom")
        if custom is not None:
            new.meta["custom"] = {k: dict(v) if isinstance(v, dict) else v for k, v in custom.items()}
        env[node] = new
    gm = fx.GraphModule(torch.nn.Module(), graph)
    meta.set_graph_info(gm, gi)
    return gm


def build_graph(n_nodes: int, shape: str = "layers", **kwargs) -> fx.GraphModule:
    """A fresh synthetic graph module (see :func:`build_template`)."""
    return fresh_copy(*build_template(shape, n_nodes, **kwargs))


def run_pipeline(gm: fx.GraphModule) -> tuple[float, float, dict[str, float]]:
    """Runs the ATen passes through ``verify`` with the compile driver; returns (seconds, CPU
    seconds, seconds per pass)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    options = Options.from_mapping({"policy": "auto", "inner": "eager"})
    gc.collect()
    cpu = time.process_time()
    start = time.perf_counter()
    compiled = compile_graph(gm, vals, options, upto="verify", verify=False, record=False)
    total = time.perf_counter() - start
    return total, time.process_time() - cpu, dict(compiled.timings)


def scaling(shape: str, sizes: Sequence[int], repeat: int, hint_fraction: float, breaks_every: int) -> list[dict]:
    rows = []
    for size in sizes:
        template = build_template(shape, size, hint_fraction=hint_fraction, breaks_every=breaks_every)
        totals: list[float] = []
        cpus: list[float] = []
        per_pass: dict[str, list[float]] = {}
        n_before = n_after = 0
        for _ in range(repeat):
            gm = fresh_copy(*template)
            n_before = len(gm.graph.nodes)
            total, cpu, timings = run_pipeline(gm)
            n_after = len(gm.graph.nodes)
            totals.append(total)
            cpus.append(cpu)
            for name, t in timings.items():
                per_pass.setdefault(name, []).append(t)
            del gm
        del template
        rows.append(
            {
                "nodes": n_before,
                "nodes_after": n_after,
                "total": statistics.median(totals),
                "cpu": statistics.median(cpus),
                "passes": {k: statistics.median(v) for k, v in per_pass.items()},
            }
        )
        print(f"  {shape}: {n_before} nodes ({n_after} after the passes): "
              f"{statistics.median(totals):.3f} s, median of {repeat}", file=sys.stderr, flush=True)
    return rows


_SHORT = {
    "read_hints": "hints",
    "annotate_capabilities": "caps",
    "assign_streams": "streams",
    "insert_syncs": "syncs",
    "lease_events": "lease",
    "bind_resources": "bind",
    "insert_retention": "retain",
    "partition": "part",
    "verify": "verify",
}


def print_scaling(rows: list[dict]) -> None:
    names = list(rows[0]["passes"])
    head = ["nodes", "+syncs", "total s", "us/node", "cpu s"] + [_SHORT.get(n, n) for n in names]
    widths = [max(7, len(h)) for h in head]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in rows:
        cells = [str(r["nodes"]), str(r["nodes_after"] - r["nodes"]), f"{r['total']:.3f}",
                 f"{1e6 * r['total'] / r['nodes']:.1f}", f"{r['cpu']:.3f}"]
        cells += [f"{r['passes'][n]:.3f}" for n in names]
        print("| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |")
    print("(total: wall clock; cpu s: process CPU time of the same runs; per-pass columns in seconds;\n"
          " +syncs: nodes the passes inserted)")
    if len(rows) >= 2:
        a, b = rows[-2], rows[-1]
        ratio = b["total"] / a["total"]
        print(f"t({b['nodes']})/t({a['nodes']}) = {ratio:.2f} for {b['nodes'] / a['nodes']:.1f}x the nodes")


# -- MoE: the pipeline against a whole Inductor compile ------------------------------------


def _fresh_cache_dir():
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # older torch
        from torch._inductor.utils import fresh_inductor_cache as fresh_cache
    return fresh_cache()


def moe_ratio(repeat: int, tokens: int) -> dict:
    from capturepass.backends.compile import last_compiled
    from capturepass.testing.models import MoEBlock

    torch.manual_seed(0)
    model = MoEBlock()
    x = torch.randn(tokens, model.wg.shape[1])
    with torch.no_grad():
        model(x)  # warm the eager path
        start = time.perf_counter()
        model(x)
        eager = time.perf_counter() - start

    def first_call(compiled) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            compiled(x)
            return time.perf_counter() - start - eager

    pipeline: list[float] = []
    whole: list[float] = []
    nodes = 0
    for _ in range(repeat):
        torch._dynamo.reset()
        seen = {id(g) for g in last_compiled()}
        compiled = torch.compile(model, backend="capturepass", options={"policy": "auto", "inner": "eager"})
        whole.append(first_call(compiled))
        graphs = [g for g in last_compiled() if id(g) not in seen]
        pipeline.append(sum(t for g in graphs for name, t in g.timings.items() if name != "emit"))
        nodes = sum(len(g.graph.graph.nodes) for g in graphs)

    cold: list[float] = []
    warm: list[float] = []
    for _ in range(repeat):
        with _fresh_cache_dir():
            for bucket in (cold, warm):
                torch._dynamo.reset()
                bucket.append(first_call(torch.compile(model, backend="inductor")))
    torch._dynamo.reset()
    return {"nodes": nodes, "pipeline": pipeline, "whole": whole, "inductor_cold": cold, "inductor_warm": warm}


def print_moe(r: dict, tokens: int) -> None:
    def ms(xs: list[float]) -> str:
        return f"{1e3 * statistics.median(xs):9.2f} ms  ({1e3 * min(xs):.2f} .. {1e3 * max(xs):.2f})"

    passes = statistics.median(r["pipeline"])
    print(f"MoEBlock() on CPU, {tokens} tokens, ATen graph of {r['nodes']} nodes after the passes "
          f"(median of {len(r['pipeline'])}, min .. max):")
    print(f"  capturepass passes (all but emit):        {ms(r['pipeline'])}")
    print(f"  capturepass compile, inner=eager (whole): {ms(r['whole'])}")
    for key, what in (("inductor_cold", "cold caches"), ("inductor_warm", "warm caches")):
        print(f"  inductor compile, {what}:           {ms(r[key])}  "
              f"-> passes / inductor = {100 * passes / statistics.median(r[key]):.2f}%")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000",
                        help="comma-separated node counts (default: 1000,10000,100000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the median is reported")
    parser.add_argument("--shapes", default="layers,lanes",
                        help="comma-separated graph shapes: layers, lanes (default: both)")
    parser.add_argument("--hint-fraction", type=float, default=0.1,
                        help="fraction of layers whose first branch carries a lane hint")
    parser.add_argument("--breaks-every", type=int, default=0,
                        help="a host sync (a segment break, cudagraphs=breakable) every N layers; 0: none")
    parser.add_argument("--tokens", type=int, default=16, help="MoE tokens")
    parser.add_argument("--skip-moe", action="store_true", help="only the synthetic scaling part")
    parser.add_argument("--skip-scaling", action="store_true", help="only the MoE part")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPU(s)")
    if not args.skip_scaling:
        for shape in [s for s in args.shapes.split(",") if s]:
            if shape not in SHAPES:
                parser.error(f"unknown shape {shape!r}; shapes are {', '.join(SHAPES)}")
            print(f"\n{shape}: ATen passes through verify, policy=auto, median of {args.repeat} run(s):")
            print_scaling(scaling(shape, sizes, args.repeat, args.hint_fraction, args.breaks_every))
    if not args.skip_moe:
        print()
        print_moe(moe_ratio(args.repeat, args.tokens), args.tokens)


if __name__ == "__main__":
    main()
