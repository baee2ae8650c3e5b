"""Where a captured call's host time goes on a GPU: capturepass against ``mode="reduce-overhead"``.

One process, one zoo decoder at the zoo bench's sizes (``bench/zoo.py``'s ``SIZES``, bf16), one
decode shape, compiled in turn with ``mode="reduce-overhead"`` and ``backend="capturepass"``
(``--variants``; ``capturepass-static`` is ``static_outputs=True``), each after six warm-up calls
(its captures and, for capturepass, its measured choice). Per variant, over calls that take turns
over four token sets:

- ``whole``: the host's time per call with no synchronisation inside the loop (the median of five
  loops of ``--calls``): where it is above the graph's GPU time, the host paces the call;
- ``executor``: the time inside capturepass's executor (its key, the copy of the inputs into the
  static buffers, the replay, the outputs' aliases), from one more loop with it timed;
- ``launch``: the time inside ``torch.cuda.CUDAGraph.replay`` (the graph's launch), in that loop,
  for both variants.

A call's host time less ``executor`` is what both variants share (Dynamo's guards, AOT autograd's
runtime wrapper, the model's own Python around the compiled graph). Variants are compiled one
after another in one process; each listed twice reads the process's drift.

Run (on a GPU): ``python3 bench/replay_host.py --model deepseek_v3 --variants
reduce-overhead,capturepass,reduce-overhead,capturepass``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("reduce-overhead", "capturepass", "capturepass-static")


def host_us(call, calls: int) -> float:
    """Microseconds per call on the host, the loop unsynchronised (synchronised around it)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    per = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    return per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek_v3")
    p.add_argument("--variants", default="reduce-overhead,capturepass,reduce-overhead,capturepass")
    p.add_argument("--decode", type=int, default=8, help="decode batch: B sequences of one token")
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    import torch

    from capturepass.runtime import executor
    from zoo import SIZES, build

    if args.model not in SIZES:
        p.error(f"unknown model {args.model!r}; choose from {', '.join(SIZES)}")
    if not torch.cuda.is_available():
        sys.exit("replay_host.py times CUDA graph replays: it needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    model, vocab = build(args.model, "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (args.decode, 1), generator=gen).cuda() for _ in range(4)]

    spent = {"launch": 0.0, "executor": 0.0}
    launch, execute = torch.cuda.graphs.CUDAGraph.replay, executor.Executor.__call__

    def timed_launch(self):
        start = time.perf_counter()
        launch(self)
        spent["launch"] += time.perf_counter() - start

    def timed_execute(self, call_args):
        start = time.perf_counter()
        out = execute(self, call_args)
        spent["executor"] += time.perf_counter() - start
        return out

    for variant in variants:
        torch._dynamo.reset()
        if variant == "reduce-overhead":
            compiled = torch.compile(model, mode="reduce-overhead")
        else:
            compiled = torch.compile(model, backend="capturepass",
                                     options={"static_outputs": variant == "capturepass-static"})
        turn = [0]

        def call():
            turn[0] += 1
            return compiled(input_ids=ids[turn[0] % len(ids)], use_cache=False)

        with torch.no_grad():
            for _ in range(6):
                call()
            whole = statistics.median(host_us(call, args.calls) for _ in range(5))
            spent.update(launch=0.0, executor=0.0)
            torch.cuda.graphs.CUDAGraph.replay, executor.Executor.__call__ = timed_launch, timed_execute
            try:
                timed = host_us(call, args.calls)
            finally:
                torch.cuda.graphs.CUDAGraph.replay, executor.Executor.__call__ = launch, execute
        per = {k: v * 1e6 / args.calls for k, v in spent.items()}
        print(f"{args.model} decode[{args.decode},1] {variant}: whole {whole:.1f} us/call "
              f"(with the timers {timed:.1f}); executor {per['executor']:.1f}; launch {per['launch']:.1f}",
              flush=True)
        compiled = None  # its captures go before the next variant compiles


if __name__ == "__main__":
    main()
