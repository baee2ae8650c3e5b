"""A MoE block with a shared expert, compiled by capturepass with no stream code.

Run: ``python examples/moe_shared_expert.py [--device cuda] [--tokens 16] [--dump DIR] [--trace OUT.json]``

capturepass finds the shared expert and the routed experts independent, puts
them on separate lanes (CUDA streams on a GPU), inserts the events between
them, and checks the result against eager. It prints what it did.

``--trace OUT.json`` writes a Chrome trace (open it in https://ui.perfetto.dev):
on a GPU a measured run (``capturepass.trace``: the kernels of each lane at their
real times, and per lane the kernel count, busy time and overlap printed), which
is also saved into the dump for ``capturepass show DIR --trace``; without CUDA the
schedule timed by the cost model, and the output says so.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import capturepass
from capturepass.show import trace as schedule_trace
from capturepass.show import summarize_dir
from capturepass.testing.models import MoEBlock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--dump", default=None, help="dump directory (default: a temporary one)")
    parser.add_argument("--small", action="store_true", help="a small block even on a GPU")
    parser.add_argument("--trace", metavar="OUT", help="write a Chrome trace: measured on a GPU, estimated otherwise")
    parser.add_argument("--runs", type=int, default=5, help="measured runs for --trace")
    parser.add_argument("--uncaptured", action="store_true",
                        help="--trace measures the program uncaptured (lanes on their streams), not the graph replays")
    parser.add_argument("--profiler-trace", metavar="OUT", help="with --trace on a GPU, also write torch.profiler's trace")
    args = parser.parse_args()

    torch.manual_seed(0)
    big = args.device == "cuda" and not args.small
    model = MoEBlock(*((4096, 11008, 8, 1408, 2) if big else ()), device=args.device,
                     dtype=torch.bfloat16 if big else torch.float32)
    x = torch.randn(args.tokens, model.wg.shape[1], device=args.device, dtype=model.wg.dtype)
    dump = args.dump or tempfile.mkdtemp(prefix="capturepass-")
    compiled = torch.compile(model, backend="capturepass", options={"dump_dir": dump, "inner": args.inner})
    with torch.no_grad():
        expected = model(x)
        got = compiled(x)
        x2 = torch.randn_like(x)
        again = compiled(x2)
        expected2 = model(x2)
    tol = dict(atol=2e-2, rtol=2e-2) if big else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(again, expected2, **tol)
    print(summarize_dir(dump))
    print(f"result equals eager on {args.device} (two calls, new input values): OK")
    print(f"annotated IR per pass: {dump}")
    if args.trace:
        if args.device == "cuda":
            with torch.no_grad():
                measured = capturepass.trace(compiled, x, path=args.trace, runs=args.runs, uncaptured=args.uncaptured,
                                             profiler_trace=args.profiler_trace)
            print(measured.summary())
            print(f"measured trace: {args.trace} (also saved into the dump: {', '.join(measured.saved) or 'no'})")
        else:
            doc = schedule_trace.write_trace(dump, args.trace)
            print(f"trace {args.trace}: {schedule_trace.trace_note(doc)}")
            print("(a measured trace needs a CUDA device: run with --device cuda on a GPU)")


if __name__ == "__main__":
    main()
