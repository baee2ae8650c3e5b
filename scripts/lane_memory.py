"""What the streams of a lanes-after-fusion graph cache, against one lane: the zoo's models
compiled on the host with ``regions="fused"`` (every Inductor compile's ``call`` rewritten onto
lanes and checked, as on a GPU), and each rewritten body's allocations and frees replayed with a
caching allocator per stream (``fused_lanes.stream_memory``).

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

    done: list[tuple[str, object]] = []
    real = fused_lanes.rewrite

    def recording(source, lane_of, device=0):
        out = real(source, lane_of, device)
        done.append((source, out))
        return out

    capture_on_host()
    model, _ = zoo.build(name)
    model.eval()
    ids = torch.randint(0, zoo.VOCAB, shape, generator=torch.Generator().manual_seed(0))
    fused_lanes.rewrite = recording
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="capturepass",
                                     options={"regions": "fused", "cudagraphs": "monolithic"})
            compiled(input_ids=ids, use_cache=False)
    finally:
        fused_lanes.rewrite = real
    rows = []
    for source, out in done:
        if not out.lanes:
            continue
        one, _ = fused_lanes.stream_memory("\n".join(fused_lanes.call_body(source)[2]))
        lanes, streams = fused_lanes.stream_memory(out.source)
        rows.append({"one": one, "lanes": lanes, "streams": sum(streams.values()), "side": out.lanes,
                     "homed": out.homed, "held": len(out.held), "moved": out.moved})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2_moe,mixtral,gpt2")
    parser.add_argument("--shape", default="2,16", help="batch,tokens of the call")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    print("| model | compile | side lanes | one lane KiB | lanes, live at once KiB | lanes, sum of streams' own KiB "
          "| streams / one lane | on last user's stream | frees moved | held to the join |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for i, r in enumerate(measure(name, shape)):  # type: ignore[arg-type]
            ratio = r["streams"] / r["one"] if r["one"] else math.nan
            print(f"| {name} | {i} | {r['side']} | {r['one'] / 1024:.1f} | {r['lanes'] / 1024:.1f} | "
                  f"{r['streams'] / 1024:.1f} | {ratio:.3f} | {r['homed']} | {r['moved']} | {r['held']} |", flush=True)


if __name__ == "__main__":
    main()
