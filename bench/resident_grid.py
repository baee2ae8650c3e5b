"""Resident-grid gating on a GPU: the example persistent-kernel model under capturepass.

For ``capturepass.testing.kernels.NormalizedMoE`` (a shared expert beside a routed
branch ending in a persistent Triton kernel with a grid barrier):

- at a small shape the launch plan is barrier-free: capturepass overlaps the shared
  expert with it (enqueued first); the benchmark times that against the same model
  with the op forced to serialize, in one process;
- at a large shape the plan has a grid barrier: capturepass serializes it; the run
  must finish (a deadlock would hang) and equal eager.

Run: ``python bench/resident_grid.py [--out DIR]`` (prints a table; exits non-zero on
a mismatch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import capturepass  # noqa: E402
from capturepass.backends.compile import last_compiled  # noqa: E402
from capturepass.ir import meta  # noqa: E402
from capturepass.testing import kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import timed  # noqa: E402  (the same CUDA-event timing as the overlap benchmark)


@torch.no_grad()
def run(tokens: int, d: int, shared: int, force_serialize: bool) -> dict:
    torch._dynamo.reset()
    if force_serialize:
        capturepass.register_capability(kernels.global_normalize, overlap="serialize")
    try:
        torch.manual_seed(0)
        model = kernels.NormalizedMoE(d, shared, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(model, backend="capturepass", options={"verify": True})
        out = compiled(x)
        ref = model(x)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        g = [c for c in last_compiled() if c.executor is not None][-1]
        op = next(n for n in g.graph.graph.nodes if "global_normalize" in str(n.target))
        cap = meta.info(op).capability
        ms = timed(lambda: compiled(x))
        return {"tokens": tokens, "serialize_forced": force_serialize, "overlap": cap.overlap,
                "reason": cap.reason, "ms": ms, "rel_err": err,
                "decisions": [d for d in meta.graph_info(g.graph).decisions if op.name in d]}
    finally:
        capturepass.register_capability(kernels.global_normalize, overlap=kernels.capability_of)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--shared", type=int, default=11008)
    p.add_argument("--small", type=int, default=8, help="tokens at the barrier-free shape")
    p.add_argument("--large", type=int, default=256, help="tokens at the grid-barrier shape")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [
        run(args.small, args.d, args.shared, force_serialize=False),
        run(args.small, args.d, args.shared, force_serialize=True),
        run(args.large, args.d, args.shared, force_serialize=False),
    ]
    lines = ["| tokens | op capability | forced serialize | ms per call | rel err vs eager |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['overlap']} ({r['reason']}) | {r['serialize_forced']} | "
                     f"{r['ms']:.4f} | {r['rel_err']:.1e} |")
    lines.append(f"\nsmall shape, overlap vs forced serialization: {rows[1]['ms'] / rows[0]['ms']:.3f}x")
    for r in rows:
        for d in r["decisions"]:
            lines.append(f"decision (T={r['tokens']}, forced={r['serialize_forced']}): {d}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "resident_grid.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "resident_grid.json"), "w") as f:
            json.dump(rows, f)
    if any(r["rel_err"] > 2e-2 for r in rows):
        raise SystemExit("a result differs from eager")


if __name__ == "__main__":
    main()
