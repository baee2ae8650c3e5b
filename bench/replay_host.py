"""Where a captured call's host time goes: capturepass against ``mode="reduce-overhead"``.

One process, one zoo decoder at the zoo bench's sizes (``bench/zoo.py``'s ``SIZES``, bf16), one
decode shape, compiled in turn with ``mode="reduce-overhead"`` and ``backend="capturepass"``
(``--variants``; ``capturepass-static`` is ``static_outputs=True``; ``capturepass-environment``
replays threading every value of the graph through its environment, the path of programs with
breaks, instead of the direct replay), each after six warm-up calls (its captures and, for
capturepass, its measured choice). Per variant, over calls that take turns over four token sets:

- ``whole``: the host's time per call with no synchronisation inside the loop (the median of five
  loops of ``--calls``): where it is above the graph's GPU time, the host paces the call;
- ``executor``: the time inside capturepass's executor (its key, the copy of the inputs into the
  static buffers, the replay, the outputs' aliases), from one more loop with it timed;
- ``launch``: the time inside the graphs' launch (``torch.cuda.CUDAGraph.replay``), in that loop,
  for both variants.

A call's host time less ``executor`` is what both variants share (Dynamo's guards, AOT autograd's
runtime wrapper, the model's own Python around the compiled graph). Variants are compiled one
after another in one process; each listed twice reads the process's drift.

``--device cpu`` times capturepass's side of it without a GPU: the model in float32 on the host,
compiled with ``inner="eager"`` (its kernels are not what is timed) and captured as on a GPU
through ``capturepass.testing.host_graphs``, whose graphs launch nothing when they replay. Every
other step of a replay is capturepass's own: the key, the copies, the outputs' aliases.
reduce-overhead has no host counterpart.

Run (on a GPU): ``python3 bench/replay_host.py --model deepseek_v3 --variants
reduce-overhead,capturepass,reduce-overhead,capturepass``; on the host: ``python3
bench/replay_host.py --device cpu --variants capturepass,capturepass-environment,capturepass``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("reduce-overhead", "capturepass", "capturepass-static", "capturepass-environment")


def host_us(call, calls: int, sync) -> float:
    """Microseconds per call on the host, the loop unsynchronised (``sync`` around it)."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    per = (time.perf_counter() - start) * 1e6 / calls
    sync()
    return per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek_v3")
    p.add_argument("--variants", default="reduce-overhead,capturepass,reduce-overhead,capturepass")
    p.add_argument("--decode", type=int, default=8, help="decode batch: B sequences of one token")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: capturepass's replay path on the host, its graphs launching nothing")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    import torch

    from capturepass.runtime import executor, replay
    from zoo import SIZES, build

    if args.model not in SIZES:
        p.error(f"unknown model {args.model!r}; choose from {', '.join(SIZES)}")
    on_host = args.device == "cpu"
    if on_host and "reduce-overhead" in variants:
        p.error("reduce-overhead captures CUDA graphs: not with --device cpu")
    if not on_host and not torch.cuda.is_available():
        sys.exit("replay_host.py times CUDA graph replays: it needs a GPU (or --device cpu)")
    if on_host:
        from capturepass.testing import host_graphs

        host_graphs.replay_on_host(run_segments=False)
        graph_class, sync = host_graphs.HostGraph, lambda: None
        model, vocab = build(args.model, "cpu")
        model = model.float()
    else:
        graph_class, sync = torch.cuda.graphs.CUDAGraph, torch.cuda.synchronize
        torch.backends.cuda.matmul.allow_tf32 = True
        model, vocab = build(args.model, "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (args.decode, 1), generator=gen).to(args.device) for _ in range(4)]

    spent = {"launch": 0.0, "executor": 0.0}
    launch, execute, direct = graph_class.replay, executor.Executor.__call__, replay._Direct.of

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
        # The environment's path: no capture gets a direct replay.
        replay._Direct.of = (lambda cap: None) if variant == "capturepass-environment" else direct
        if variant == "reduce-overhead":
            compiled = torch.compile(model, mode="reduce-overhead")
        else:
            options = {"static_outputs": variant == "capturepass-static"}
            if on_host:
                options.update(inner="eager", cudagraphs="monolithic")
            compiled = torch.compile(model, backend="capturepass", options=options)
        turn = [0]

        def call():
            turn[0] += 1
            return compiled(input_ids=ids[turn[0] % len(ids)], use_cache=False)

        with torch.no_grad():
            for _ in range(6):
                call()
            whole = statistics.median(host_us(call, args.calls, sync) for _ in range(5))
            spent.update(launch=0.0, executor=0.0)
            graph_class.replay, executor.Executor.__call__ = timed_launch, timed_execute
            try:
                timed = host_us(call, args.calls, sync)
            finally:
                graph_class.replay, executor.Executor.__call__ = launch, execute
        per = {k: v * 1e6 / args.calls for k, v in spent.items()}
        print(f"{args.model} decode[{args.decode},1] {args.device} {variant}: whole {whole:.1f} us/call "
              f"(with the timers {timed:.1f}); executor {per['executor']:.1f}; launch {per['launch']:.1f}",
              flush=True)
        compiled = None  # its captures go before the next variant compiles


if __name__ == "__main__":
    main()
