"""Does Inductor's generated code launch each kernel on the stream current at its launch?

The one-compile route on a torch without Inductor's own stream lowering (2.11; see
docs/one_compile.md) would compile a whole graph once, with capturepass's lane switches as
opaque ops that make a lane's stream current. That is sound only if the generated code reads
the current stream at every launch, not once per function. This probe answers it for the
installed torch, with Inductor alone (no capturepass):

    y = tanh(to_lane(cos(to_lane(sin(x) * 2, 1)) + 1, 0)) * 3,  plus  z = exp(x) * 5

where ``cpprobe::to_lane(t, k)`` (an opaque custom op) makes lane k's stream current after it
waits for the stream it leaves. ``exp`` depends on nothing after the switch: where Inductor
places it shows whether it keeps independent work on the side of a switch it was written on.

Printed: the output code's reads of the current stream (``get_raw_stream(``) and its launch
lines; each kernel of one profiled call with the CUDA stream it ran on (torch.profiler); and
whether the results equal eager. Needs CUDA.

Run: ``python bench/stream_switch_probe.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

STREAMS: dict[int, torch.cuda.Stream] = {}


@torch.library.custom_op("cpprobe::to_lane", mutates_args=())
def to_lane(x: torch.Tensor, lane: int) -> torch.Tensor:
    target = STREAMS[lane]
    target.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_stream(target)
    return x.clone()


@to_lane.register_fake
def _(x: torch.Tensor, lane: int) -> torch.Tensor:
    return torch.empty_like(x)


def probe(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.sin(x) * 2
    b = torch.ops.cpprobe.to_lane(a, 1)
    c = torch.cos(b) + 1
    z = torch.exp(x) * 5  # written on lane 1, reads nothing of it
    d = torch.ops.cpprobe.to_lane(c, 0)
    return torch.tanh(d) * 3, z


def kernel_streams(trace_path: str) -> list[tuple[str, int]]:
    """(kernel name, stream id) of every GPU kernel in a chrome trace, in start order."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e.get("ts", 0))
    return [(e.get("name", "?"), int(e.get("args", {}).get("stream", -1))) for e in kernels]


def code_summary(code: str) -> dict:
    """How often the code reads the current stream, and its launch and switch lines."""
    lines = [ln.strip() for ln in code.splitlines()]
    return {
        "get_raw_stream_reads": sum("get_raw_stream(" in ln and "import" not in ln for ln in lines),
        "lines": [ln for ln in lines if "get_raw_stream(" in ln or ".run(" in ln or "cpprobe" in ln],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for stream_switch_probe.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_switch_probe: needs CUDA")
    from torch._inductor.utils import run_and_get_code

    main_stream = torch.cuda.current_stream()
    STREAMS[0], STREAMS[1] = main_stream, torch.cuda.Stream()
    x = torch.randn(1 << 20, device="cuda")
    want = probe(x)
    torch.cuda.set_stream(main_stream)
    compiled = torch.compile(probe)
    got, codes = run_and_get_code(compiled, x)
    torch.cuda.set_stream(main_stream)
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(x)
            torch.cuda.set_stream(main_stream)
            torch.cuda.synchronize()
        prof.export_chrome_trace(trace)
        streams = kernel_streams(trace)
    result = {
        "torch": torch.__version__,
        "equal_to_eager": all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want)),
        "code": [code_summary(c) for c in codes],
        "kernels": streams,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stream_switch_probe.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
