"""Where an uncaptured call's host time goes: capturepass's layers against Inductor's, on the CPU.

One process, one thread, one model of the zoo (its tiny float32 config, where the host's share
of a call shows), compiled twice: ``torch.compile(model)`` (Inductor) and
``torch.compile(model, backend="capturepass")``. Each layer of capturepass's call is timed on
its own, with the arguments the layer receives in a real call:

- ``region``: the compiled region alone (Inductor's code behind its runtime wrapper);
- ``program``: the outer program bound to the model's uncaptured owner (the regions, the
  lanes' syncs and the values between them);
- ``executor``: what AOT autograd calls (the owner lookup, then the program);
- ``capturepass``: the whole call (Dynamo's guards, AOT's runtime wrapper, the executor);
- ``inductor``: Inductor's whole call.

The layers are timed in rotation, each figure the fastest of ``--rounds`` rounds of the mean of
``--iters`` calls (microseconds): the least disturbed round, so that differences of a few
microseconds between layers can be read. ``capturepass / inductor`` is the uncaptured bar's
ratio (at most 1.10).

Run: ``python bench/host_overhead.py --model qwen2_moe`` (``--decode B``, ``--prefill B,S``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def decoders() -> list[str]:
    """The zoo's decoders (token ids in, ``use_cache`` taken), in catalogue order."""
    from capturepass.testing import zoo

    return [name for name, family in zoo.FAMILIES.items() if family == "decoder"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2_moe", choices=decoders())
    p.add_argument("--decode", type=int, default=8, help="decode batch: B sequences of one token")
    p.add_argument("--prefill", default=None, help="B,S: a prefill shape instead of the decode one")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=15)
    return p


def fastest(fns: dict, iters: int, rounds: int) -> dict[str, float]:
    """The fastest round of each callable (mean microseconds per call), timed in rotation."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e6)
    return best


def layers(model_name: str, batch: int, seq: int, iters: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of each layer (see the module docstring)."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.backends.compile import last_compiled
    from capturepass.testing import zoo

    torch.set_num_threads(1)
    model, _ = zoo.build(model_name)
    model.eval()
    ids = torch.randint(0, zoo.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    inductor = torch.compile(model)
    ours = torch.compile(model, backend="capturepass")
    with torch.no_grad():
        for fn in (inductor, ours):
            for _ in range(3):
                fn(input_ids=ids, use_cache=False)
        record = [r for r in last_compiled() if r.executor is not None][-1]
        executor = record.executor
        seen: list = []
        kind = type(executor)
        call = kind.__call__
        kind.__call__ = lambda self, args: seen.append(list(args)) or call(self, args)  # the arguments AOT passes
        try:
            ours(input_ids=ids, use_cache=False)
        finally:
            kind.__call__ = call
        args = seen[-1]
        bound = executor._eager_program(args)
        program = record.program
        env = bound.initial_env(args)
        for piece in range(len(program.pieces)):
            bound.run_piece(piece, env)  # every value a region reads
        regions = [(r.fn, [env[n] for n in r.inputs]) for r in _region_specs(program)]

        def region() -> None:
            for fn, region_args in regions:
                fn(*region_args)

        return fastest({
            "region": region,
            "program": lambda: bound(*args),
            "executor": lambda: executor(args),
            "capturepass": lambda: ours(input_ids=ids, use_cache=False),
            "inductor": lambda: inductor(input_ids=ids, use_cache=False),
        }, iters, rounds)


def _region_specs(program) -> list:
    from capturepass.ir.plan import StepKind

    return [s.payload for p in program.pieces for s in p.steps if s.kind == StepKind.REGION]


def main() -> None:
    args = parser().parse_args()
    batch, seq = (int(v) for v in args.prefill.split(",")) if args.prefill else (args.decode, 1)
    times = layers(args.model, batch, seq, args.iters, args.rounds)
    print(f"{args.model} [{batch}, {seq}], one thread, fastest of {args.rounds} rounds of {args.iters} calls:")
    for name, us in times.items():
        print(f"  {name:12s} {us:9.1f} us")
    print(f"  capturepass / inductor {times['capturepass'] / times['inductor']:.3f}; outer program "
          f"{times['program'] - times['region']:.1f} us, executor {times['executor'] - times['program']:.1f} us")


if __name__ == "__main__":
    main()
