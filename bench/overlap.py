"""Overlap benchmark on a GPU: capturepass against the ways a user overlaps branches by hand.

Workloads (bf16):

- ``moe``: a shared-expert MLP 4096->11008->4096 (SiLU gating) beside 8 routed
  experts 4096->1408->4096, top-2, at T=16 and T=256 tokens;
- ``attn``: decode attention B=32, 32 heads, S=4096, head dim 128, beside an
  indexer branch with a top-512.

Variants, each timed in the same process (median over repetitions of the mean
time per call, CUDA events around many calls):

- ``eager``: the model as written;
- ``graph``: a serial CUDA graph of the model;
- ``graph2``: a hand-written two-stream CUDA graph (fork, the second branch on a
  side stream, join);
- ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")``; ``reduce-overhead+pass``: the
  same with ``capturepass.post_grad_pass`` as Inductor's post-grad custom pass (the pass route);
- ``inductor-graph`` / ``inductor+pass-graph``: ``torch.compile(m)`` without and with the pass,
  captured into a CUDA graph by the caller (as vLLM's piecewise graphs are), replay alone;
- ``capturepass``: ``torch.compile(backend="capturepass")``, the whole call
  (input copy, replay, outputs returned over aliases of the pool, copied out only
  when still held at the next call); ``capturepass-static``: the same with
  ``static_outputs=True``; ``capturepass-replay``: its graphs' replay alone.

Also the byte floor (weights, inputs and outputs read or written once, at the
measured copy bandwidth), and a replay-overhead micro benchmark: capturepass's
call against a raw ``torch.cuda.graph`` replay of the same kernels.

``--procs N`` runs every measurement in N fresh processes and reports the median
of their medians. Run: ``python bench/overlap.py --procs 3 --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import capturepass  # noqa: E402
from capturepass.testing.models import AttnIndexer, MoEBlock  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import capture  # noqa: E402
from timing import timed as _timed  # noqa: E402

DT = torch.bfloat16


def timed(fn, iters: int, reps: int = 7, warmup: int = 10) -> float:
    """Median over ``reps`` of the mean milliseconds per call of ``fn`` (CUDA events)."""
    return _timed(fn, iters, reps=reps, warmup=warmup)


def copy_bandwidth() -> float:
    """Measured device-to-device bytes per second (read + write)."""
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 20, reps=5)
    return 2 * n / (ms * 1e-3)



def two_stream(main_branch, aux_branch, combine):
    """The hand-written version: aux branch on a side stream, fork and join by events."""
    aux = torch.cuda.Stream()

    def run(*inputs):
        main = torch.cuda.current_stream()
        aux.wait_stream(main)
        with torch.cuda.stream(aux):
            ya = aux_branch(*inputs)
            ev = torch.cuda.Event()
            ev.record(aux)
        ym = main_branch(*inputs)
        main.wait_event(ev)
        return combine(ym, ya)

    return run


def workload(name: str, t: int):
    torch.manual_seed(0)
    if name == "moe":
        m = MoEBlock(4096, 11008, 8, 1408, 2, device="cuda", dtype=DT)
        inputs = (torch.randn(t, 4096, device="cuda", dtype=DT),)
        main_b, aux_b, comb = m.shared_expert, m.routed_experts, lambda a, b: a + b
        shape = f"T={t}"
    else:
        m = AttnIndexer(32, 32, 4096, 128, 4096, 4, 64, 512, device="cuda", dtype=DT)
        inputs = m.example_inputs()
        main_b = lambda q, x: m.attention(q)  # noqa: E731
        aux_b = lambda q, x: m.indexer(x)  # noqa: E731
        comb = lambda a, b: a + b.view(b.shape[0], 1, 1, b.shape[1])  # noqa: E731
        shape = "B=32 H=32 S=4096 D=128 top-512"
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    with torch.no_grad():
        out = m(*inputs)
    nbytes += sum(x.numel() * x.element_size() for x in inputs) + out.numel() * out.element_size()
    return m, inputs, (main_b, aux_b, comb), shape, nbytes


def relerr(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@torch.no_grad()
def measure(name: str, t: int, iters: int) -> dict:
    m, inputs, (main_b, aux_b, comb), shape, nbytes = workload(name, t)
    ref = m(*inputs)
    res: dict = {"workload": name, "shape": shape, "bytes": nbytes, "ms": {}, "err": {}}

    res["ms"]["eager"] = timed(lambda: m(*inputs), iters)
    g = capture(lambda: m(*inputs))
    res["ms"]["graph"] = timed(g.replay, iters)
    two = two_stream(main_b, aux_b, comb)
    g2 = capture(lambda: two(*inputs))
    res["ms"]["graph2"] = timed(g2.replay, iters)

    ro = torch.compile(m, mode="reduce-overhead")
    for _ in range(3):
        ro(*inputs)
    res["err"]["reduce-overhead"] = relerr(ro(*inputs), ref)
    res["ms"]["reduce-overhead"] = timed(lambda: ro(*inputs), iters)

    # The pass route: reduce-overhead with the lanes written into the graph Inductor compiles.
    with torch._inductor.config.patch(post_grad_custom_post_pass=capturepass.post_grad_pass):
        rop = torch.compile(m, mode="reduce-overhead")
        for _ in range(3):
            rop(*inputs)
    res["err"]["reduce-overhead+pass"] = relerr(rop(*inputs), ref)
    res["ms"]["reduce-overhead+pass"] = timed(lambda: rop(*inputs), iters)

    # What vLLM's piecewise CUDA graphs do: the caller captures Inductor's code, here without
    # and with the pass; replays alone (no host work per call but the launch).
    for variant, patch in (("inductor-graph", {}),
                           ("inductor+pass-graph", {"post_grad_custom_post_pass": capturepass.post_grad_pass})):
        torch._dynamo.reset()
        with torch._inductor.config.patch(patch):
            ind = torch.compile(m)
            for _ in range(2):
                ind(*inputs)
        holder: list = []
        gi = capture(lambda: holder.append(ind(*inputs)))
        gi.replay()
        res["err"][variant] = relerr(holder[-1], ref)
        res["ms"][variant] = timed(gi.replay, iters)
    torch._dynamo.reset()

    t0 = time.perf_counter()
    cp = torch.compile(m, backend="capturepass")
    out = cp(*inputs)
    res["compile_s_capturepass"] = time.perf_counter() - t0
    res["err"]["capturepass"] = relerr(out, ref)
    res["ms"]["capturepass"] = timed(lambda: cp(*inputs), iters)
    from capturepass.backends.compile import last_compiled

    compiled = [c for c in last_compiled() if c.executor is not None][-1]
    ex = compiled.executor
    graphs = list(ex.owners[0].graphs.values())
    res["ms"]["capturepass-replay"] = timed(lambda: [gr.replay() for gr in graphs], iters)
    from capturepass.ir import meta

    gi = meta.graph_info(compiled.graph)
    res["lanes"] = list(gi.lanes)
    res["waits"] = compiled.counters.get("insert_syncs", {}).get("waits", 0)

    cps = torch.compile(m, backend="capturepass", options={"static_outputs": True})
    cps(*inputs)
    res["ms"]["capturepass-static"] = timed(lambda: cps(*inputs), iters)
    return res


@torch.no_grad()
def replay_overhead(iters: int) -> dict:
    """capturepass's call against a raw graph replay of the same 200 small kernels."""
    x = torch.randn(1 << 14, device="cuda")

    def chain(x):
        for _ in range(200):
            x = torch.sin(x)
        return x

    static_x = x.clone()
    g = capture(lambda: chain(static_x))

    def raw():
        static_x.copy_(x)
        g.replay()

    cp = torch.compile(chain, backend="capturepass",
                       options={"inner": "eager", "policy": "off", "static_outputs": True})
    cp(x)
    return {"raw": timed(raw, iters), "capturepass": timed(lambda: cp(x), iters)}


def child(args) -> None:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    out["copy_bw"] = copy_bandwidth()
    for spec in args.workloads:
        name, _, t = spec.partition(":")
        out["rows"].append(measure(name, int(t or 0), args.iters))
    out["micro"] = replay_overhead(args.iters)
    print("RESULT " + json.dumps(out))


def table(results: list[dict]) -> str:
    first = results[0]
    bw = statistics.median(r["copy_bw"] for r in results)
    lines = [
        f"device: {first['device']}, torch {first['torch']}, processes: {len(results)}, "
        f"copy bandwidth {bw / 1e12:.2f} TB/s",
        "",
        "| workload | shape | variant | median ms | per-process ms | vs graph2 | vs reduce-overhead | rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(first["rows"]):
        per = {v: [r["rows"][i]["ms"][v] for r in results] for v in row["ms"]}
        med = {v: statistics.median(x) for v, x in per.items()}
        for v in ("eager", "graph", "graph2", "reduce-overhead", "reduce-overhead+pass", "inductor-graph",
                  "inductor+pass-graph", "capturepass", "capturepass-static",
                  "capturepass-replay"):
            err = row["err"].get(v)
            lines.append(
                f"| {row['workload']} | {row['shape']} | {v} | {med[v]:.4f} | "
                f"{', '.join(f'{x:.4f}' for x in per[v])} | {med['graph2'] / med[v]:.3f}x | "
                f"{med['reduce-overhead'] / med[v]:.3f}x | {'' if err is None else f'{err:.1e}'} |"
            )
        floor = row["bytes"] / bw * 1e3
        lines.append(f"| {row['workload']} | {row['shape']} | byte floor | {floor:.4f} | | | | |")
        lines.append(f"| {row['workload']} | {row['shape']} | capturepass lanes | {' '.join(row['lanes'])} "
                     f"({row['waits']} waits) | | | | |")
    raw = statistics.median(r["micro"]["raw"] for r in results)
    cpm = statistics.median(r["micro"]["capturepass"] for r in results)
    lines += ["", f"replay overhead, 200 sin kernels: raw graph {raw:.4f} ms, capturepass {cpm:.4f} ms, "
              f"ratio {cpm / raw:.4f}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--workloads", nargs="+", default=["moe:16", "moe:256", "attn:0"],
                   help="NAME:TOKENS each (moe:16; attn's tokens are ignored: attn:0)")
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=0, help="start no new process after this many seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for spec in args.workloads:
        name, colon, tokens = spec.partition(":")
        if name not in ("moe", "attn") or not colon or not tokens.isdigit():
            p.error(f"--workloads {spec!r}: expected moe:TOKENS or attn:0")
    if args.child:
        child(args)
        return
    results = []
    start = time.perf_counter()
    for i in range(args.procs):
        if args.budget_s and i > 0 and time.perf_counter() - start > args.budget_s:
            print(f"stopping after {i} processes: over the {args.budget_s} s budget", flush=True)
            break
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--iters", str(args.iters),
               "--workloads", *args.workloads]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"benchmark process {i} failed")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"process {i + 1}/{args.procs} done", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "overlap.json"), "w") as f:
                json.dump(results, f)
    text = table(results)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overlap.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
