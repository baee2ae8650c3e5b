"""What the streams of a lanes-after-fusion graph cache, against one lane: the zoo's models
compiled on the host with ``regions="fused"`` (every Inductor compile's ``call`` rewritten onto
lanes and checked, as on a GPU), and each rewritten body's allocations and frees replayed with a
caching allocator per stream (``fused_lanes.stream_memory``): the body uncaptured calls run, and
the one captures run (buffers on their last user's stream where that is safe and smaller).

A CUDA caching allocator hands a stream only blocks that stream freed, so memory one lane frees
is cached by that lane's stream until it allocates again: a graph of lanes reserves about the sum
of each stream's own peak, where one lane reserves its one peak. This script reports both for
the buffers the generated code allocates (``empty_strided``; what a library call allocates for
itself, and cuBLAS workspaces, are not in it), per compile and model:

    python3 scripts/lane_memory.py --models llama,qwen2_moe,mixtral --shape 2,16

The figures are byte counts of the code's buffers at the shapes the model was called with, not
measurements of a device; ``bench/zoo.py --memory-sites`` measures a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

def measure(name: str, shape: tuple[int, int]) -> list[dict]:
    """Per compile of the zoo model ``name`` called on token ids of ``shape``: one lane's peak,
    the lanes' peak, the sum of the streams' own peaks, the side lanes."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.backends import fused_lanes
    from capturepass.testing import zoo
    from tests.helpers import capture_on_host

    from capturepass.backends import fused_inductor

    done: list[tuple[str, object]] = []
    real = fused_inductor.rewrite_module

    def recording(source, lane_of, device=0):
        new, out = real(source, lane_of, device)
        done.append((source, out))
        return new, out

    capture_on_host()
    model, _ = zoo.build(name)
    model.eval()
    ids = torch.randint(0, zoo.VOCAB, shape, generator=torch.Generator().manual_seed(0))
    fused_inductor.rewrite_module = recording
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="capturepass",
                                     options={"regions": "fused", "cudagraphs": "monolithic"})
            compiled(input_ids=ids, use_cache=False)
    finally:
        fused_inductor.rewrite_module = real
    rows = []
    for source, out in done:
        if not out.lanes:
            continue
        one, _ = fused_lanes.stream_memory("\n".join(fused_lanes.call_body(source)[2]))
        lanes, streams = fused_lanes.stream_memory(out.source)
        cap = out.captured or out
        cap_lanes, cap_streams = fused_lanes.stream_memory(cap.source)
        rows.append({"one": one, "lanes": lanes, "streams": sum(streams.values()), "cap_lanes": cap_lanes,
                     "cap_streams": sum(cap_streams.values()), "side": out.lanes, "homed": cap.homed,
                     "held": len(out.held), "moved": out.moved})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2_moe,mixtral,gpt2")
    parser.add_argument("--shape", default="2,16", help="batch,tokens of the call")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    print("| model | compile | side lanes | one lane KiB | uncaptured: live at once KiB | uncaptured: sum of streams' own "
          "KiB | captured: live at once KiB | captured: sum of streams' own KiB | captured streams / one lane "
          "| on last user's stream (captured) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for i, r in enumerate(measure(name, shape)):  # type: ignore[arg-type]
            ratio = r["cap_streams"] / r["one"] if r["one"] else math.nan
            print(f"| {name} | {i} | {r['side']} | {r['one'] / 1024:.1f} | {r['lanes'] / 1024:.1f} | "
                  f"{r['streams'] / 1024:.1f} | {r['cap_lanes'] / 1024:.1f} | {r['cap_streams'] / 1024:.1f} | "
                  f"{ratio:.3f} | {r['homed']} |", flush=True)

if __name__ == "__main__":
    main()
