"""Two-GPU benchmark: MoE blocks split over two ranks, capturepass against hand-written CUDA graphs.

Workloads (bf16, a shared expert 4096->11008->4096 beside 8 routed experts 4096->1408->4096,
top-2, 4 experts per rank; ``T`` tokens per rank):

- ``ep2``: the expert-parallel block of the two-GPU reference measurement: the shared expert
  replicated; each rank sends half its rows to each rank (one fixed-capacity
  ``all_to_all_single``), runs its 4 experts densely on what it received, sends the sums back
  (another ``all_to_all_single``) and weights them (a shape-correct stand-in for the combine);
- ``ep``: :class:`capturepass.testing.parallel.ExpertParallelMoE`, the exact expert-parallel
  block (every token with its router weights to every rank, weighted sums back);
- ``tp``: :class:`capturepass.testing.parallel.TensorParallelMoE`: the shared expert column-
  then row-parallel with an all-reduce, the routed experts 4 per rank with their own.

Every block is written with ``torch.distributed``'s in-place collectives (NCCL captures them).
Variants, each timed on both ranks in the same processes (CUDA events around many replays or
calls, a barrier before each repetition; median over repetitions of the mean per call):

- ``serial``: a CUDA graph of the block as written, one stream;
- ``hand``: a hand-written two-stream CUDA graph: for ``ep2``/``ep`` the shared expert on a
  side stream while dispatch, experts and combine run on the main stream; for ``tp`` both
  all-reduces on a side stream (one stream per communicator) while the routed experts compute
  on the main stream;
- ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")`` of the block;
- ``capturepass``: ``torch.compile(backend="capturepass")`` (default options: a monolithic
  capture on CUDA), the whole call; ``capturepass-replay``: its graphs' replay alone.

Errors are relative to the serial graph's output (the same computation). ``--procs N`` runs
every measurement in N fresh ``torchrun`` launches and reports the median of their medians.

Run on a machine with two GPUs: ``python bench/tensor_parallel.py --procs 3 --out DIR``
(it starts ``torchrun --standalone --nproc-per-node 2`` itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# NVLink multicast (NVLS) is not needed between two GPUs; it stays off unless the environment
# turns it on (children inherit it).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import capture as _capture  # noqa: E402
from timing import timed as _timed  # noqa: E402

from capturepass.testing.models import MoEBlock  # noqa: E402

DT = torch.bfloat16
SIZES = {"d": 4096, "shared": 11008, "experts": 8, "expert_width": 1408, "topk": 2}
VARIANTS = ("serial", "hand", "reduce-overhead", "capturepass", "capturepass-replay")


class AnchorEP(nn.Module):
    """The expert-parallel block of the two-GPU reference measurement (``ep2``).

    Args:
        full: the whole block (the same seed on every rank).
        rank / world: this rank and the number of ranks.
    """

    def __init__(self, full: MoEBlock, rank: int, world: int) -> None:
        super().__init__()
        local = full.experts // world
        e0 = rank * local
        frozen = lambda t: nn.Parameter(t.detach().clone(), requires_grad=False)  # noqa: E731
        self.wg, self.wu, self.wd, self.wr = frozen(full.wg), frozen(full.wu), frozen(full.wd), frozen(full.wr)
        self.w13, self.w2 = frozen(full.w13[e0:e0 + local]), frozen(full.w2[e0:e0 + local])
        self.experts, self.local, self.width, self.topk = full.experts, local, full.expert_width, full.topk

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert (replicated)."""
        return F.linear(F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu), self.wd)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Dispatch, this rank's experts densely, combine (two fixed-capacity all-to-alls)."""
        import torch.distributed as dist

        t = x.shape[0]
        vals, idx = torch.topk(F.linear(x, self.wr), self.topk, dim=-1)
        probs = torch.softmax(vals.float(), -1).to(x.dtype)
        comb = torch.zeros(t, self.experts, device=x.device, dtype=x.dtype).scatter(1, idx, probs)
        recv = torch.empty_like(x)
        dist.all_to_all_single(recv, x)
        h = torch.bmm(recv.unsqueeze(0).expand(self.local, t, x.shape[1]), self.w13)
        g, u = h.split(self.width, -1)
        o = torch.bmm(F.silu(g) * u, self.w2).sum(0)
        back = torch.empty_like(o)
        dist.all_to_all_single(back, o)
        return back * comb[:, :1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x) + self.routed(x)


def timed(fn, iters: int, reps: int = 7, warmup: int = 5) -> float:
    """Median over ``reps`` of the mean milliseconds per call of ``fn``, both ranks in step."""
    import torch.distributed as dist

    return _timed(fn, iters, reps=reps, warmup=warmup, before_rep=dist.barrier)


def capture(fn, warm: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn``, both ranks captured in step (NCCL makes its communicator in the warm-up)."""
    import torch.distributed as dist

    return _capture(fn, warm, before=dist.barrier)



def hand_written(name: str, model: nn.Module):
    """The two-stream version of ``model`` (see the module docstring), a function of ``x``."""
    import torch.distributed as dist

    side = torch.cuda.Stream()

    if name in ("ep2", "ep"):
        def routed(x):
            if name == "ep2":
                return model.routed(x)
            splits = [x.shape[0]] * model.world
            buf = model.dispatch_buffer(x)
            recv = torch.empty_like(buf)
            dist.all_to_all_single(recv, buf, splits, splits)
            y = model.expert_sums(recv)
            back = torch.empty_like(y)
            dist.all_to_all_single(back, y, splits, splits)
            return model.combine(back)

        def run(x):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                s = model.shared(x)
                done = torch.cuda.Event()
                done.record(side)
            r = routed(x)
            main.wait_event(done)
            return s + r

        return run

    def run_tp(x):
        main = torch.cuda.current_stream()
        s = model.shared_partial(x)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dist.all_reduce(s)
        r = model.routed_partial(x)
        ready = torch.cuda.Event()
        ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            dist.all_reduce(r)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        return s + r

    return run_tp


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@torch.no_grad()
def measure(name: str, t: int, iters: int, rank: int, world: int) -> dict:
    from capturepass.testing import parallel

    torch.manual_seed(0)
    full = MoEBlock(**SIZES, device="cuda", dtype=DT)
    if name == "ep2":
        model = AnchorEP(full, rank, world)
    elif name == "ep":
        model = parallel.ExpertParallelMoE(full, rank, world, api="c10d")
    else:
        model = parallel.TensorParallelMoE(full, rank, world, api="c10d")
    del full
    x = torch.randn(t, SIZES["d"], device="cuda", dtype=DT, generator=torch.Generator("cuda").manual_seed(1 + rank))
    res: dict = {"workload": name, "shape": f"T={t}", "ms": {}, "err": {}, "notes": []}

    g = capture(lambda: model(x))
    res["ms"]["serial"] = timed(g.replay, iters)
    g.replay()
    torch.cuda.synchronize()
    ref = model(x).clone()  # uncaptured, the same computation
    hand = hand_written(name, model)
    captured: list[torch.Tensor] = []

    def hand_call() -> None:
        captured[:] = [hand(x)]  # the last call's output: the captured one, rewritten by replays

    g2 = capture(hand_call)
    g2.replay()
    torch.cuda.synchronize()
    res["err"]["hand"] = relerr(captured[0], ref)
    res["ms"]["hand"] = timed(g2.replay, iters)
    del g, g2

    import torch._dynamo

    for variant, kwargs in (("reduce-overhead", {"mode": "reduce-overhead"}), ("capturepass", {"backend": "capturepass"})):
        torch._dynamo.reset()
        try:
            f = torch.compile(model, **kwargs)

            def call():
                if variant == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                return f(x)

            start = time.perf_counter()
            for _ in range(3):
                y = call()
            torch.cuda.synchronize()
            res[f"compile_s_{variant}"] = time.perf_counter() - start
            res["err"][variant] = relerr(y, ref)
            res["ms"][variant] = timed(call, iters)
            if variant == "capturepass":
                res.update(_capturepass_details(res["ms"], iters))
        except Exception as exc:  # report and go on: the other variants still count
            res["notes"].append(f"{variant}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    _release_graphs(model)
    return res


def _release_graphs(model: nn.Module) -> None:
    """Drops every CUDA graph that captured collectives of ``model`` (capturepass's owners, the
    cudagraph trees of reduce-overhead): NCCL destroys a communicator only once they are gone."""
    import gc

    import torch._dynamo

    import capturepass

    capturepass.release(model)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()


def _capturepass_details(ms: dict, iters: int) -> dict:
    """The lanes and waits of the last capturepass graph; times its replay alone into ``ms``."""
    from capturepass.backends.compile import last_compiled
    from capturepass.ir import meta

    compiled = [c for c in last_compiled() if c.executor is not None][-1]
    graphs = [gr for owner in compiled.executor.owners for gr in owner.graphs.values()]
    if graphs:
        ms["capturepass-replay"] = timed(lambda: [gr.replay() for gr in graphs], iters)
    return {"lanes": list(meta.graph_info(compiled.graph).lanes),
            "waits": compiled.counters.get("insert_syncs", {}).get("waits", 0)}


def child(args) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "rows": []}
    for spec in args.workloads:
        name, _, t = spec.partition(":")
        out["rows"].append(measure(name, int(t), args.iters, rank, world))
        if rank == 0:
            print(f"{spec} done", file=sys.stderr, flush=True)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def table(results: list[dict]) -> str:
    """The markdown table of medians over processes, with ratios side by side."""
    first = results[0]
    lines = [
        f"device: {first['device']} x{first['world']}, torch {first['torch']}, processes: {len(results)}",
        "",
        "| workload | shape | " + " | ".join(f"{v} ms" for v in VARIANTS)
        + " | hand / capturepass | serial / capturepass | reduce-overhead / capturepass | rel err (hand, ro, cp) |",
        "|---|---|" + "---|" * (len(VARIANTS) + 4),
    ]
    for i, row in enumerate(first["rows"]):
        med = {}
        for v in VARIANTS:
            vals = [r["rows"][i]["ms"][v] for r in results if v in r["rows"][i]["ms"]]
            med[v] = statistics.median(vals) if vals else None
        cp = med["capturepass"]

        def ratio(v: str) -> str:
            return f"{med[v] / cp:.3f}x" if med[v] is not None and cp else "n/a"

        errs = ", ".join(f"{row['err'][v]:.1e}" if v in row["err"] else "n/a"
                         for v in ("hand", "reduce-overhead", "capturepass"))
        lines.append(f"| {row['workload']} | {row['shape']} | "
                     + " | ".join(f"{med[v]:.4f}" if med[v] is not None else "n/a" for v in VARIANTS)
                     + f" | {ratio('hand')} | {ratio('serial')} | {ratio('reduce-overhead')} | {errs} |")
    lines += ["", "ratios: the variant's median time over capturepass's (above 1: capturepass is faster); "
              "errors: relative to the serial graph's output, first launch"]
    lanes = [f"{r['workload']} {r['shape']}: lanes {' '.join(r['lanes'])} ({r['waits']} waits)"
             for r in first["rows"] if "lanes" in r]
    notes = [f"{r['workload']} {r['shape']}: {n}" for res in results for r in res["rows"] for n in r["notes"]]
    if lanes:
        lines += ["", "capturepass: " + "; ".join(lanes)]
    if notes:
        lines += ["", "failures:"] + [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=3, help="fresh torchrun launches; medians of their medians")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per launch")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--workloads", nargs="+", default=["ep2:16", "ep2:64", "ep2:256", "ep:16", "ep:256", "tp:16", "tp:256"],
                   help="NAME:T, NAME one of ep2, ep, tp; T tokens per rank")
    p.add_argument("--out", default=None, help="directory for tensor_parallel.json and tensor_parallel.md")
    p.add_argument("--budget-s", type=float, default=0, help="start no new launch after this many seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    for spec in args.workloads:
        name, _, t = spec.partition(":")
        if name not in ("ep2", "ep", "tp") or not t.isdigit():
            raise SystemExit(f"tensor_parallel: workload {spec!r}: NAME:T with NAME one of ep2, ep, tp")
    if args.child:
        child(args)
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"tensor_parallel: needs {args.nproc} CUDA devices, this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    results = []
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for i in range(args.procs):
        if args.budget_s and i > 0 and time.perf_counter() - start > args.budget_s:
            print(f"stopping after {i} launches: over the {args.budget_s} s budget", flush=True)
            break
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               os.path.abspath(__file__), "--child", "--iters", str(args.iters), "--workloads", *args.workloads]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"launch{i}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"benchmark launch {i} failed")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"launch {i + 1}/{args.procs} done", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "tensor_parallel.json"), "w") as f:
                json.dump(results, f)
    text = table(results)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "tensor_parallel.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
