"""Memory held at engine scale: one model called at many batch sizes, as a serving engine captures it.

The showcase MoE block at hidden 2048 (bf16), compiled with ``dynamic=True``, called at batch
sizes ``N, N-1, ..., 1`` (largest first, as vLLM captures; two calls each, new values), for
each variant in its own process (all at once: memory is per process):

- ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead", dynamic=True)``
  (cudagraph trees: one graph per size, one pool);
- ``capturepass-off``: capturepass with ``policy="off"`` (one lane);
- ``capturepass``: capturepass's default options (the measured lane choice on a GPU).

capturepass captures each size up to ``max_captures`` (raised to ``N`` here, so that every
size is captured, as an engine's ``capture_sizes`` would). Reported: memory allocated and
reserved afterwards above the weights, the peak allocated over the run, how many sizes
each variant captured, and where the reserved memory lies (graph pools, each stream's cache);
every call is compared with eager. Every process starts from empty Inductor and schedule caches
(a first compile, Triton's tuning included).

With ``--sites``, each worker records the allocator's history (Python frames) and reports, for
every segment outside a graph pool that is still reserved at the end, where it was ``cudaMalloc``'d:
the memory a pool does not account for, by the call that made the allocator grow; and the blocks
live at the peak of the history (compile, captures and calls), by where they were allocated and
by stream.

Run: ``python bench/memory.py --sizes 8,32,67 --out DIR`` (one process per variant and N).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import fresh_caches, peak_sites, save  # noqa: E402

VARIANTS = ("reduce-overhead", "capturepass-off", "capturepass")
MIB = 2**20


def worker(variant: str, n: int, sites: bool = False) -> dict:
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.testing.models import MoEBlock

    torch.manual_seed(0)
    model = MoEBlock(2048, 5632, 8, 1408, 2, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    weights_alloc, weights_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    if sites:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    if variant == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead", dynamic=True)
    else:
        opts = {"max_captures": n}
        if variant == "capturepass-off":
            opts["policy"] = "off"
        fn = torch.compile(model, backend="capturepass", dynamic=True, options=opts)
    worst = 0.0
    with torch.no_grad():
        for t in range(n, 0, -1):
            for _ in range(2):
                x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
                got = fn(x).float()
                want = model(x).float()
                worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
    torch.cuda.synchronize()
    captured = None
    if variant.startswith("capturepass"):
        from capturepass.backends.compile import last_compiled

        captured = sum(g.executor.num_captures for g in last_compiled() if g.executor is not None)
    return dict(variant=variant, sizes=n, captured=captured, rel_err=worst, segments=segments(),
                segment_sites=segment_sites() if sites else [],
                peak_sites=peak_sites(torch.cuda.memory._snapshot()).splitlines() if sites else [],
                allocated_mib=(torch.cuda.memory_allocated() - weights_alloc) / MIB,
                reserved_mib=(torch.cuda.memory_reserved() - weights_res) / MIB,
                peak_mib=(torch.cuda.max_memory_allocated() - weights_alloc) / MIB)


def segments() -> dict[str, list[float]]:
    """Reserved and allocated MiB by where the allocator keeps them: a graph pool (its id), or
    the ordinary cache of one stream (blocks freed on a stream are reused on that stream only)."""
    import torch

    out: dict[str, list[float]] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        where = f"pool {pool}" if pool != (0, 0) else f"stream {seg.get('stream', 0):#x}"
        got = out.setdefault(where, [0.0, 0.0])
        got[0] += seg["total_size"] / MIB
        got[1] += seg["allocated_size"] / MIB
    return out


def segment_sites(top: int = 10) -> list[str]:
    """The segments outside graph pools still reserved, largest first: size, stream, how much of
    it is allocated, and the frames of the allocation that made the allocator ``cudaMalloc`` it
    (the innermost frame, then the nearest under capturepass, Inductor's generated code or this
    script)."""
    import torch

    from timing import frame_site

    # capturepass, Inductor's generated code (this worker's cache, else Inductor's default's
    # folder) and this script.
    own = ("capturepass/", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/torchinductor_", os.path.abspath(__file__))
    snap = torch.cuda.memory._snapshot()
    made = {e["addr"]: e for trace in snap.get("device_traces", []) for e in trace if e["action"] == "segment_alloc"}
    lines = []
    held = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
    for seg in sorted(held, key=lambda s: -s["total_size"])[:top]:
        frames = (made.get(seg["address"]) or {}).get("frames") or []
        inner = frame_site(frames[0]) if frames else "? (made before the history)"
        ours = next((frame_site(f) for f in frames if any(p in f["filename"] for p in own)), None)
        lines.append(f"{seg['total_size'] / MIB:.1f} MiB on stream {seg.get('stream', 0):#x}, "
                     f"{seg['allocated_size'] / MIB:.1f} allocated: {inner}" + (f" <- {ours}" if ours and ours != inner else ""))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,32", help="comma-separated N: call at batch sizes N..1")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("--sites", action="store_true",
                   help="record the allocator's history: where each segment outside a pool was made")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.sites)), flush=True)
        return
    rows, failures = [], []
    # Memory is per process: the variants run at once (their compiles overlap).
    jobs = [(n, v) for n in (int(x) for x in args.sizes.split(",")) for v in args.variants.split(",")]
    # Each process has caches of its own: the tuning's flush buffer is part of what a first
    # compile holds and peaks at.
    procs = [((n, v), subprocess.Popen([sys.executable, __file__, "--worker", v, "--n", str(n)]
                                       + (["--sites"] if args.sites else []),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fresh_caches()))
             for n, v in jobs]
    for (n, v), proc in procs:
        out, err = proc.communicate()
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += got
        if proc.returncode != 0 or not got:
            tail = [line for line in err.strip().splitlines() if "Warning" not in line][-15:]
            failures.append(f"{v} N={n}: exit {proc.returncode}:\n" + "\n".join(tail))
        print(f"done {v} N={n}", file=sys.stderr, flush=True)
    save(args.out, "memory", rows, failures, report(rows))


def report(rows: list[dict]) -> str:
    """The table (reserved memory against reduce-overhead's at the same N), calls that differ from
    eager, and where each run's reserved memory lies."""
    lines = ["| N sizes | variant | captured | allocated MiB | reserved MiB | peak MiB | reserved / reduce-overhead's |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ro = next((x for x in rows if x["sizes"] == r["sizes"] and x["variant"] == "reduce-overhead"), None)
        ratio = f"{r['reserved_mib'] / ro['reserved_mib']:.2f}" if ro and ro["reserved_mib"] > 0 else ""
        lines.append(f"| {r['sizes']} | {r['variant']} | {r['captured'] if r['captured'] is not None else ''} | "
                     f"{r['allocated_mib']:.0f} | {r['reserved_mib']:.0f} | {r['peak_mib']:.0f} | {ratio} |")
    lines += [f"large difference from eager: {r['variant']} N={r['sizes']} rel {r['rel_err']:.3g}"
              for r in rows if r["rel_err"] > 5e-2]
    for r in rows:
        where = ", ".join(f"{k}: {v[0]:.0f} reserved / {v[1]:.0f} allocated"
                          for k, v in sorted(r.get("segments", {}).items()))
        lines.append(f"segments, {r['variant']} N={r['sizes']}: {where}")
        lines += [f"  made by: {line}" for line in r.get("segment_sites", [])]
        lines += [f"  at the peak: {line}" for line in r.get("peak_sites", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
