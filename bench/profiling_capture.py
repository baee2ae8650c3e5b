"""What a profiling capture predicts against what the real capture then takes (GPU).

Run: ``python bench/profiling_capture.py [--tokens 16 256]``

For the MoE block of ``bench/overlap.py`` (shared expert 4096->11008->4096 beside 8 routed
experts 4096->1408->4096, top-2, bf16), one process per run:

1. ``capturepass.profiling_capture()`` around the first call of each token count: the reserved
   bytes the throwaway captures added (``pool_bytes``), their peak allocation above the baseline
   (``peak_bytes``), and what stayed allocated after they were released (``leaked_bytes``);
2. the real captures afterwards: reserved and allocated bytes above the same baseline.

An engine sizes its KV cache from (1); the table shows how close (1) is to (2).
"""

from __future__ import annotations

import argparse
import gc

import torch

import capturepass
from capturepass.testing.models import MoEBlock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MoEBlock(4096, 11008, 8, 1408, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="capturepass")
    xs = [torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16) for t in args.tokens]
    with torch.no_grad():
        for x in xs:  # compile (and autotune) outside the measurement; drop those captures
            compiled(x)
        for graph in capturepass.backends.compile.last_compiled():
            if graph.executor is not None:
                graph.executor.release_captures()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        with capturepass.profiling_capture() as prof:
            for x in xs:
                compiled(x)
        gc.collect()
        torch.cuda.synchronize()
        after_alloc = torch.cuda.memory_allocated() - alloc0
        torch.cuda.empty_cache()
        reserved_reset = torch.cuda.memory_reserved() - reserved0
        torch.cuda.reset_peak_memory_stats()
        outs = [compiled(x) for x in xs]
        del outs
        gc.collect()
        torch.cuda.synchronize()
        real_alloc = torch.cuda.memory_allocated() - alloc0
        real_reserved = torch.cuda.memory_reserved() - reserved0
        real_peak = torch.cuda.max_memory_allocated() - alloc0
    mib = 1 << 20
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, tokens {args.tokens}")
    print("| what | profiling capture | real captures |")
    print("|---|--:|--:|")
    print(f"| graphs | {prof.graphs} | {len(args.tokens)} |")
    print(f"| reserved above baseline (MiB) | {prof.pool_bytes / mib:.1f} | {real_reserved / mib:.1f} |")
    print(f"| peak allocated above baseline (MiB) | {prof.peak_bytes / mib:.1f} | {real_peak / mib:.1f} |")
    print(f"| allocated above baseline after (MiB) | {prof.leaked_bytes / mib:.1f} (after release: "
          f"{after_alloc / mib:.1f}; reserved after empty_cache: {reserved_reset / mib:.1f}) | {real_alloc / mib:.1f} |")


if __name__ == "__main__":
    main()
