"""capturepass variants of one zoo model in one process, called in turn over the same weights.

The zoo bench (``bench/zoo.py``) runs each variant in a process of its own, each with its own copy of
the weights. Where two variants capture the same schedule (the default's measured choice of one lane
and ``policy="off"``), their times still differ by about 1% from process to process. This script
puts the variants in one process: it builds the model once, gives every variant a model over the
same weight tensors (``--copies``: each its own copy instead), compiles each (every compiled model
is kept alive), calls each three times, then times whole calls of each in turn (alternating the
order), reporting the median milliseconds per call. On CUDA, ``--kernels`` lists the kernels whose
time per call differs most between the first and the last variant (a profiler trace of 20 calls
each). Run it in several processes to see what placement alone moves from one to the next.

Models over the same parameters are one model to capturepass (their captures share one pool and its
streams, as the shapes of one model do): sound while the compiled models live, which is why each is
kept, and why the calls are whole calls (each copies its inputs first), not graphs replayed alone.
A variant is named once: Dynamo serves a second compile with the same options from the first's
cache.

Run on a GPU: ``python bench/same_weights.py --model mixtral --shape 8,1 --variants default,off``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import timed  # noqa: E402
from zoo import SIZES, build  # noqa: E402

VARIANTS = {"default": {}, "off": {"policy": "off"}}


def kernel_times(call, calls: int = 20) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel (or copy) name, summed over its launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / calls
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mixtral", choices=sorted(SIZES))
    p.add_argument("--shape", default="8,1", help="batch,sequence of the input ids")
    p.add_argument("--variants", default="default,off", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--copies", action="store_true", help="each variant over its own copy of the weights")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sizes", default="real", choices=("real", "zoo"), help="as bench/zoo.py's")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--kernels", action="store_true", help="per-kernel differences from a profiler trace (CUDA)")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant: {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if len(set(names)) < len(names):
        p.error(f"a variant named twice in {args.variants}: a second compile with the same options is served "
                "from the first's cache")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    dev = args.device
    shape = tuple(int(v) for v in args.shape.split(","))
    base, vocab = build(args.model, dev, args.sizes)
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)).to(dev)
    calls: list[tuple[str, object]] = []
    models = []  # a variant's captures are released when its model is collected
    with torch.no_grad():
        for name in names:
            model, _ = build(args.model, dev, args.sizes)
            if not args.copies:
                model.load_state_dict(base.state_dict(), assign=True)  # the same weight tensors
                if dev == "cuda":
                    torch.cuda.empty_cache()
            models.append(model)
            fn = torch.compile(model, backend="capturepass", options=VARIANTS[name])
            for _ in range(3):
                fn(input_ids=ids, use_cache=False)
            calls.append((name, lambda fn=fn: fn(input_ids=ids, use_cache=False)))
        times: dict[str, list[float]] = collections.defaultdict(list)
        for r in range(args.rounds):
            for label, call in (calls if r % 2 == 0 else calls[::-1]):
                times[label].append(timed(call, iters=args.iters, reps=3, device=dev))
        weights = "its own copy of the weights" if args.copies else "the same weights"
        print(f"{args.model} {list(shape)}, each variant over {weights}; ms per call, median of {args.rounds} rounds")
        for label, ts in times.items():
            print(f"  {label:12s} {statistics.median(ts):.4f} (min {min(ts):.4f}, max {max(ts):.4f})")
        if args.kernels and dev == "cuda" and len(calls) > 1:
            (a, ca), (b, cb) = calls[0], calls[-1]
            ka, kb = kernel_times(ca), kernel_times(cb)
            print(f"kernels only in {a}: {sorted(set(ka) - set(kb))}; only in {b}: {sorted(set(kb) - set(ka))}")
            diffs = sorted(((ka.get(n, 0.0) - kb.get(n, 0.0), n) for n in set(ka) | set(kb)), reverse=True)
            for d, n in diffs[:5] + diffs[-5:]:
                print(f"  {d:+8.2f} us per call  {n[:100]}")


if __name__ == "__main__":
    main()
