"""What side lanes hold in cuBLAS workspaces, and what a smaller workspace costs (a GPU bench).

Each CUDA stream that runs a matrix product in a capture holds a cuBLAS workspace of its own
(PyTorch sizes it by ``CUBLAS_WORKSPACE_CONFIG``: 32 MiB per stream on an H100 or H200 by
default). The showcase MoE block (hidden 4096, bf16, T=16) is compiled with capturepass by
default (the measured choice: each schedule candidate's time and the workspaces its capture
allocated, from the choice's record) and with ``policy="off"``; three calls with new inputs,
then the whole call timed (CUDA events, ``bench/timing.py``) and the peak memory allocated above
the model over the compile and the calls. Run it once per workspace size, in a process of its
own (the variable is the size of every workspace torch allocates from the start)::

    python3 bench/workspaces.py
    CUBLAS_WORKSPACE_CONFIG=:4096:2 python3 bench/workspaces.py   # 8 MiB per stream

Each variant prints one line: whole-call milliseconds, peak MiB, the largest difference from
eager, and per candidate its measured microseconds and workspaces.

``--cache`` instead shows what torch's workspace cache does when the variable changes while the
process runs (why capturepass never sets it): a workspace allocated under ``:4096:2`` on a new
stream, then a matrix product on the same stream under ``:4096:8``. A torch whose cache records
no size (2.11) allocates nothing the second time, handing cuBLAS the 8 MiB workspace as 32 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def candidate_lines(record: Any) -> list[str]:
    """One ``name: N us, M MiB`` per candidate of a measured choice's record (``PickRecord``)."""
    out = []
    for c in record.candidates:
        took = "not measured" if c.get("measured_us") is None else f"{c['measured_us']} us"
        held = c.get("workspace_mib")
        out.append(f"{c['name']} ({c['lanes']} lane(s)): {took}, "
                   f"{'workspaces unknown' if held is None else f'workspaces {held:g} MiB'}")
    return out


def cache_probe(torch: Any) -> None:
    """Prints the workspace torch allocates on a new stream under ``:4096:2``, then what it
    allocates for the next product on that stream under ``:4096:8`` (the variable, unset before, is
    unset again)."""
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    grown = []
    try:
        for config in (":4096:2", ":4096:8"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = config
            if not grown:
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            with torch.cuda.stream(stream):
                a @ a
            torch.cuda.synchronize()
            grown.append((torch.cuda.memory_allocated() - held) / 2**20)
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch._C._cuda_clearCublasWorkspaces()
    if grown[0] != 8:
        verdict = "this torch did not size the workspace by the variable's new value"
    elif grown[1] == 0:
        verdict = "the cached 8 MiB workspace is handed to cuBLAS at the larger size"
    else:
        verdict = "the cache allocated a larger workspace for the larger size"
    print(f"torch {torch.__version__}: under :4096:2 a new stream's workspace took {grown[0]:g} MiB; "
          f"under :4096:8 the next product on it allocated {grown[1]:g} MiB more: {verdict}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--cache", action="store_true",
                   help="show how torch's workspace cache follows CUBLAS_WORKSPACE_CONFIG set at run time")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("workspaces.py measures CUDA captures: it needs a GPU")
    if args.cache:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            # A torch that reads the variable once would read this one, and the probe could not tell it apart.
            sys.exit("--cache sets CUBLAS_WORKSPACE_CONFIG itself: run it with the variable unset")
        cache_probe(torch)
        return
    import capturepass
    from capturepass.backends.compile import last_compiled
    from capturepass.testing.models import MoEBlock
    from timing import timed

    print(f"torch {torch.__version__}, capturepass {capturepass.__version__}, "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}", flush=True)
    torch.manual_seed(0)
    model = MoEBlock(4096, 11008, 8, 1408, 2, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(args.tokens, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for policy in ("auto", "off"):
        torch._dynamo.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        compiled = torch.compile(model, backend="capturepass",
                                 options={"policy": policy, "pick_cache_dir": tempfile.mkdtemp()})
        with torch.no_grad():
            err = max((compiled(x).float() - model(x).float()).abs().max().item() for x in xs)
            ms = timed(lambda: compiled(xs[0]), iters=args.iters, device="cuda")
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ex = [g for g in last_compiled() if g.name == "inference"][-1].executor
        picks = "; ".join("; ".join(candidate_lines(r)) for r in ex.schedule_choices if not r.cached)
        print(f"policy {policy}: {ms:.4f} ms, peak {peak:.1f} MiB, max |difference| {err:.3g}; "
              f"{picks or 'no measured choice'}", flush=True)
        compiled = ex = None


if __name__ == "__main__":
    main()
