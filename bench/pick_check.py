"""Does the measured choice time what a call then runs? The picker's figures against each graph replayed alone.

For each model (``bench/zoo.py``'s decoders at realistic sizes, bf16) and shape, one process
compiles the model three times with capturepass, each called three times at the shape:

- the default (``pick="measure"``): its picker's median per candidate, and the one it chose;
- ``pick="model"``: the cost model's lanes, unmeasured;
- ``policy="off"``: one lane's own program (what the ``one_lane`` candidate compiles).

Then every graph is replayed alone, interleaved over ``--trials`` trials of ``--iters`` replays
(CUDA events), and each variant's whole call is timed the same way. The picker's figure for the
cost model's lanes (``model``) and for ``one_lane`` should match the replays alone of the
``pick="model"`` and ``policy="off"`` graphs; where they disagree by more than the gap between
candidates, the choice is noise. Each variant's whole call is set against its own graphs
replayed alone: the ratio is what the call adds to the replay (the zero-copy bar: at most 1.02). Nothing else runs on the GPU meanwhile: one process at a time.

Run: ``python bench/pick_check.py --models llama,qwen2_moe`` (``--decode B``, ``--prefill B,S``,
``--out DIR`` for ``pick-check.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import fresh_caches  # noqa: E402

VARIANTS = {"default": {}, "model": {"pick": "model"}, "off": {"policy": "off"}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,qwen2_moe")
    p.add_argument("--decode", type=int, default=8, help="decode batch: B sequences of one token")
    p.add_argument("--prefill", default="2,128", help="B,S of the prefill shape ('' for none)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for pick-check.md")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "B", "S"), help=argparse.SUPPRESS)
    return p


def worker(model_name: str, batch: int, seq: int, iters: int, trials: int) -> list[str]:
    """One model and shape in this process: the rows of the report."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.backends.compile import last_compiled
    from timing import timed
    from zoo import build

    torch.backends.cuda.matmul.allow_tf32 = True
    model, vocab = build(model_name, "cuda", "real")
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    graphs, calls, picked = {}, {}, None
    with torch.no_grad():
        for label, opts in VARIANTS.items():
            seen = {id(r) for r in last_compiled()}
            fn = torch.compile(model, backend="capturepass", options=opts)
            for _ in range(3):
                fn(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            recs = [r for r in last_compiled() if id(r) not in seen and r.executor is not None]
            graphs[label] = [gr for r in recs for o in r.executor.owners for gr in o.graphs.values()]
            calls[label] = lambda f=fn: f(input_ids=ids, use_cache=False)
            if label == "default":
                picked = next((c for r in recs for c in r.executor.schedule_choices), None)
        alone = {k: [] for k in graphs}
        whole = {k: [] for k in graphs}
        for _ in range(trials):
            for k in graphs:
                alone[k].append(timed(lambda gs=graphs[k]: [x.replay() for x in gs], iters=iters) * 1e3)
                whole[k].append(timed(calls[k], iters=iters) * 1e3)
    medians = {k: statistics.median(v) for k, v in alone.items()}
    wholes = {k: statistics.median(v) for k, v in whole.items()}
    return rows(model_name, f"[{batch}, {seq}]", picked, medians, wholes)


def rows(model_name: str, shape: str, picked, alone: dict[str, float], whole: dict[str, float]) -> list[str]:
    """The report's rows for one model and shape.

    Args:
        picked: the default's choice (``runtime.choices.PickRecord``), or ``None`` when it measured
            nothing (an uncaptured graph).
        alone: median microseconds per replay alone of each variant's graphs (``VARIANTS``).
        whole: median microseconds per whole call of each variant.
    """
    measured = {c["name"]: c["measured_us"] for c in picked.candidates} if picked is not None else {}
    choice = picked.choice if picked is not None else "(none measured)"
    out = []

    def row(name: str, got: float | None, ref: float | None) -> str:
        ratio = f"{got / ref:.3f}" if got and ref else ""
        return (f"| {model_name} | {shape} | {name}{' (chosen)' if name == choice else ''} | "
                f"{'' if got is None else f'{got:.1f}'} | {'' if ref is None else f'{ref:.1f}'} | {ratio} |")

    # The picker's one_lane compiles what policy="off" compiles; its lane maps have no variant.
    for name, variant in (("model", "model"), ("one_lane", "off")):
        out.append(row(name, measured.get(name), alone.get(variant)))
    out.extend(row(name, got, None) for name, got in measured.items() if name not in ("model", "one_lane"))
    # A whole call against its own graphs replayed alone: what the call adds (the bar: at most 2%).
    names = {"default": f"default (replays {choice})", "model": 'pick="model"', "off": 'policy="off"'}
    for variant in VARIANTS:
        out.append(row(f"whole call: {names[variant]}", whole.get(variant), alone.get(variant)))
    return out


def main() -> None:
    args = parser().parse_args()
    from zoo import SIZES

    unknown = [m for m in args.models.split(",") if m not in SIZES]
    if unknown:
        parser().error(f"unknown model: {', '.join(unknown)} (known: {', '.join(SIZES)})")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/pick_check.py times CUDA graphs: it needs a CUDA device")
    if args.worker:
        name, b, s = args.worker
        print("\n".join(worker(name, int(b), int(s), args.iters, args.trials)), flush=True)
        return
    shapes = [(args.decode, 1)]
    if args.prefill:
        shapes.append(tuple(int(v) for v in args.prefill.split(",")))
    lines = ["| model | shape | candidate, or whole call | picker's or whole call's us | alone us | ratio |",
             "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for b, s in shapes:
            # Nothing measured before counts.
            env = fresh_caches()
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, str(b), str(s),
                   "--iters", str(args.iters), "--trials", str(args.trials)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            rows = [r for r in run.stdout.splitlines() if r.startswith("| ")]
            if run.returncode != 0 or not rows:
                tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
                rows = [f"| {name} | [{b}, {s}] | failed (exit {run.returncode}): {' / '.join(tail)} | | | |"]
            lines.extend(rows)
            print("\n".join(rows), flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pick-check.md"), "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
