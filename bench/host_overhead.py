"""Where an uncaptured call's time goes: capturepass's layers against Inductor's.

One process, one thread, one model of the zoo (by default its tiny float32 config on the CPU,
where the host's share of a call shows), compiled three times: ``torch.compile(model)``
(Inductor), ``torch.compile(model, backend="capturepass")`` uncaptured (``cudagraphs="none"``
on a GPU), and the same with ``policy="off"`` (one lane). Each layer of capturepass's call is
timed on its own, with the arguments the layer receives in a real call:

- ``region``: the compiled region alone (Inductor's code behind its runtime wrapper);
- ``program``: the outer program bound to the model's uncaptured owner, as its calls run it
  (on a GPU the lanes or one stream, whichever capturepass measured faster for the shape: the
  regions, the lanes' syncs and the values between them);
- ``executor``: what AOT autograd calls (the owner lookup, then the program);
- ``capturepass``: the whole call (Dynamo's guards, AOT's runtime wrapper, the executor);
- ``one lane``: the whole call of the ``policy="off"`` compile (what the lanes cost an
  uncaptured call: on a GPU, their streams' switches and events);
- ``inductor``: Inductor's whole call.

The layers are timed in rotation, each figure the fastest of ``--rounds`` rounds of the mean of
``--iters`` calls (microseconds): the least disturbed round, so that differences of a few
microseconds between layers can be read. ``capturepass / inductor`` is the uncaptured bar's
ratio (at most 1.10). On a GPU (``--device cuda``) each round ends when the GPU has run its
calls, so a figure is the slower of the host and the GPU, as a caller's steady stream of calls
sees it. All variants share one process: ``bench/zoo.py`` runs each in its own, and a host-paced
call's time moved from process to process on the GPU machine by more than the bar's 10%
(BENCHMARKS.md).

Run: ``python bench/host_overhead.py --model qwen2_moe`` (``--decode B``, ``--prefill B,S``;
``--device cuda --sizes real``: on a GPU at ``bench/zoo.py``'s realistic sizes, bf16).

``--small``: instead, whole calls of small plain modules, where a fixed cost per call weighs
most (``x + 1`` on four floats, ``nn.Linear(8, 8)``, a KV-cache write with attention, a
64-256-64 MLP), Inductor and capturepass in alternation; each line is the median over
``--rounds`` of the ratio of the two rounds taken side by side (a pair shares the machine's
state, which on a shared 2-core CPU moves by more than the difference read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/zoo.py, for --sizes real


def decoders() -> list[str]:
    """The zoo's decoders (token ids in, ``use_cache`` taken), in catalogue order."""
    from capturepass.testing import zoo

    return [name for name, family in zoo.FAMILIES.items() if family == "decoder"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2_moe", choices=decoders())
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default="zoo", choices=("zoo", "real"),
                   help="the zoo's tiny float32 config, or bench/zoo.py's realistic sizes in bf16")
    p.add_argument("--decode", type=int, default=8, help="decode batch: B sequences of one token")
    p.add_argument("--prefill", default=None, help="B,S: a prefill shape instead of the decode one")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--small", action="store_true", help="small plain modules, paired rounds")
    return p


def fastest(fns: dict, iters: int, rounds: int, wait=None) -> dict[str, float]:
    """The fastest round of each callable (mean microseconds per call), timed in rotation; a
    round ends after ``wait()`` (the GPU's synchronisation: its queued work counted) where given."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if wait is not None:
                wait()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            if wait is not None:
                wait()
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e6)
    return best


def model_and_ids(model_name: str, batch: int, seq: int, device: str, sizes: str):
    """The zoo model (in eval mode) and token ids of ``[batch, seq]`` on ``device``: the zoo's tiny
    float32 config, or ``bench/zoo.py``'s realistic one in bf16 (``sizes="real"``)."""
    import torch

    from capturepass.testing import zoo

    if sizes == "zoo":
        model, vocab = zoo.build(model_name, device=None if device == "cpu" else device)[0], zoo.VOCAB
    else:
        import zoo as zoo_bench  # bench/zoo.py

        model, vocab = zoo_bench.build(model_name, device)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return model.eval(), ids


def layers(model_name: str, batch: int, seq: int, iters: int, rounds: int, device: str = "cpu",
           sizes: str = "zoo") -> dict[str, float]:
    """Microseconds per call of each layer (see the module docstring)."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.backends.compile import last_compiled

    torch.set_num_threads(1)
    model, ids = model_and_ids(model_name, batch, seq, device, sizes)
    uncaptured = {"cudagraphs": "none"} if device == "cuda" else {}
    inductor = torch.compile(model)
    one_lane = torch.compile(model, backend="capturepass", options={**uncaptured, "policy": "off"})
    ours = torch.compile(model, backend="capturepass", options=uncaptured)
    with torch.no_grad():
        # ``ours`` compiles last (at its first call): its compile is the one ``last_compiled`` reads below.
        for fn in (inductor, one_lane, ours):
            for _ in range(12):  # past capturepass's measured choice of uncaptured calls (8 calls per shape)
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
            "one lane": lambda: one_lane(input_ids=ids, use_cache=False),
            "inductor": lambda: inductor(input_ids=ids, use_cache=False),
        }, iters, rounds, wait=torch.cuda.synchronize if device == "cuda" else None)


def small_modules() -> dict[str, tuple]:
    """Name -> (module, arguments, calls per round) of the ``--small`` cases."""
    import torch
    from torch import nn

    class Add(nn.Module):
        def forward(self, x):
            return x + 1

    class KVAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("k", torch.zeros(2, 16, 8))
            self.register_buffer("v", torch.zeros(2, 16, 8))
            self.q, self.kp, self.vp = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, pos):
            self.k.index_copy_(1, pos, self.kp(x))
            self.v[:, pos] = self.vp(x)
            return (self.q(x) @ self.k.transpose(1, 2)).softmax(-1) @ self.v

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x):
            return self.b(nn.functional.gelu(self.a(x)))

    torch.manual_seed(0)
    return {
        "x + 1": (Add(), (torch.randn(4),), 1000),
        "nn.Linear(8, 8)": (nn.Linear(8, 8), (torch.randn(2, 8),), 1000),
        "KV-cache write + attention": (KVAttention(), (torch.randn(2, 3, 8), torch.arange(3)), 300),
        "MLP 64-256-64 on [32, 64]": (MLP(), (torch.randn(32, 64),), 300),
    }


def paired(rounds: int) -> dict[str, tuple[float, float, float]]:
    """Name -> (Inductor's median us per call, capturepass's, the median paired ratio)."""
    import copy
    import statistics

    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed

    torch.set_num_threads(1)
    out = {}
    for name, (module, args, calls) in small_modules().items():
        fns = {b: torch.compile(copy.deepcopy(module), backend=b) for b in ("inductor", "capturepass")}
        times: dict[str, list[float]] = {b: [] for b in fns}
        with torch.no_grad():
            for fn in fns.values():
                for _ in range(300):
                    fn(*args)
            for _ in range(rounds):
                for b, fn in fns.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(*args)
                    times[b].append((time.perf_counter() - start) / calls * 1e6)
        ratios = [c / i for c, i in zip(times["capturepass"], times["inductor"])]
        out[name] = (statistics.median(times["inductor"]), statistics.median(times["capturepass"]),
                     statistics.median(ratios))
    return out


def _region_specs(program) -> list:
    from capturepass.ir.plan import StepKind

    return [s.payload for p in program.pieces for s in p.steps if s.kind == StepKind.REGION]


def main() -> None:
    args = parser().parse_args()
    if args.small:
        print(f"small modules, one thread, medians of {args.rounds} paired rounds:")
        for name, (ind, ours, ratio) in paired(args.rounds).items():
            print(f"  {name:28s} inductor {ind:7.2f} us, capturepass {ours:7.2f} us, capturepass / inductor {ratio:.3f}")
        return
    batch, seq = (int(v) for v in args.prefill.split(",")) if args.prefill else (args.decode, 1)
    times = layers(args.model, batch, seq, args.iters, args.rounds, args.device, args.sizes)
    print(f"{args.model} ({args.sizes} sizes) [{batch}, {seq}] on {args.device}, one thread, fastest of "
          f"{args.rounds} rounds of {args.iters} calls:")
    for name, us in times.items():
        print(f"  {name:12s} {us:9.1f} us")
    print(f"  capturepass / inductor {times['capturepass'] / times['inductor']:.3f}, one lane / inductor "
          f"{times['one lane'] / times['inductor']:.3f}; outer program "
          f"{times['program'] - times['region']:.1f} us, executor {times['executor'] - times['program']:.1f} us")


if __name__ == "__main__":
    main()
