"""The large fuzzing and mutation budget of the synchronisation (CPU only).

Draws random DAGs of real aten ops with random lane hints and options (the strategy of
``tests/passes/test_properties.py``), compiles each through the ATen pipeline (verifying every
pass), and runs it in ``--seeds`` adversarial interleavings of
:mod:`capturepass.testing.simulate`; every result must equal serial execution and the
happens-before check must find no race. With ``--mutants N`` it also scores mutation testing
(:mod:`capturepass.testing.mutate`) over the ``tests/passes/cases.py`` graphs and the first ``N``
random graphs.

    python bench/fuzz_sync.py --graphs 10000 --seeds 20 --workers 2 --mutants 300 --write

writes the figures to ``bench/results/fuzz-sync.md`` and, with ``--write``, into the block
between the ``fuzz_sync`` markers of ``RELIABILITY.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

BEGIN = "<!-- fuzz_sync:begin -->"
END = "<!-- fuzz_sync:end -->"


def _worker(args: tuple) -> str:
    """Fuzzes ``graphs`` graphs, appending one JSON line per graph to its own log; returns the log's path."""
    worker, graphs, seeds, mutants, seed_base, log_dir = args
    import torch
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from capturepass.ir import meta
    from capturepass.testing.mutate import judge
    from capturepass.testing.simulate import explore
    from tests.passes.test_properties import _compile, _inputs, cases

    torch.set_num_threads(1)
    path = os.path.join(log_dir, f"fuzz-w{seed_base + worker}.jsonl")
    log = open(path, "w")
    mutated = 0

    @seed(seed_base + worker)
    @settings(
        max_examples=graphs, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def one(case):
        nonlocal mutated
        row: dict = {"case": repr(case)}
        try:
            gm, _ = _compile(case, upto="verify")
        except Exception as exc:  # a pipeline or verifier error on a valid program is a finding
            row["compile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log.write(json.dumps(row) + "\n")
            log.flush()
            return
        inputs = _inputs(case, salt=7)
        report = explore(gm, inputs, range(seeds), replay=True)
        gi = meta.graph_info(gm)
        row.update(
            runs=report.runs, reused=report.reused, lanes=len(gi.lanes), segments=len(gi.segments),
            mismatch=bool(report.mismatches), race=bool(report.races), deadlock=bool(report.deadlocks),
        )
        if not report.ok:
            row["failure"] = report.describe()
        if mutated < mutants and len(gi.lanes) > 1:
            mutated += 1
            row["mutants"] = [
                (o.mutant.kind, o.verifier, o.observed, o.races, str(o.mutant)) for o in judge(gm, inputs, range(seeds))
            ]
        log.write(json.dumps(row) + "\n")
        log.flush()

    one()
    log.close()
    return path


def _case_mutants(seeds: int) -> list[tuple]:
    from capturepass.testing.mutate import judge
    from tests.passes.cases import CASES, build, fused_declared

    corpus = [(build(name, "verify")[0], CASES[name].inputs(seed=1), name) for name in sorted(CASES)]
    out = []
    with fused_declared():
        for gm, inputs, name in corpus:
            for o in judge(gm, inputs, range(seeds)):
                out.append((o.mutant.kind, o.verifier, o.observed, o.races, f"{name}: {o.mutant}", name))
    return out


def _mutation_table(rows: list[tuple]) -> str:
    from capturepass.testing.mutate import Mutant, Outcome, Score

    s = Score([Outcome(Mutant(k, name), v, obs, r) for k, v, obs, r, name, _ in rows])
    return s.table()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=10000)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mutants", type=int, default=300, help="random graphs (with aux lanes) to mutate")
    ap.add_argument("--seed-base", type=int, default=1000, help="worker i draws with hypothesis seed base + i")
    ap.add_argument("--write", action="store_true", help="update RELIABILITY.md")
    ap.add_argument(
        "--summarize", action="store_true",
        help="only summarize the per-worker logs a run (possibly stopped early) left beside --out",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz-sync.md"))
    a = ap.parse_args()
    t0 = time.time()
    log_dir = os.path.dirname(a.out)
    os.makedirs(log_dir, exist_ok=True)
    per = [a.graphs // a.workers + (1 if i < a.graphs % a.workers else 0) for i in range(a.workers)]
    mper = [a.mutants // a.workers + (1 if i < a.mutants % a.workers else 0) for i in range(a.workers)]
    jobs = [(i, per[i], a.seeds, mper[i], a.seed_base, log_dir) for i in range(a.workers)]
    if a.summarize:
        paths = [os.path.join(log_dir, f"fuzz-w{a.seed_base + i}.jsonl") for i in range(a.workers)]
    elif a.workers == 1:
        paths = [_worker(jobs[0])]
    else:
        with mp.get_context("spawn").Pool(a.workers) as pool:
            paths = pool.map(_worker, jobs)
    total: dict = collections.Counter()
    lanes: collections.Counter = collections.Counter()
    segments: collections.Counter = collections.Counter()
    failures: list[str] = []
    mrows: list[tuple] = []
    for path in paths:
        for line in open(path):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a stopped run
                continue
            total["graphs"] += 1
            if "compile_error" in row:
                total["compile_errors"] += 1
                failures.append(f"compile: {row['compile_error']} :: {row['case']}")
                continue
            total["interleavings"] += row["runs"]
            total["reused_blocks"] += row["reused"]
            total["mismatch_graphs"] += row["mismatch"]
            total["race_graphs"] += row["race"]
            total["deadlock_graphs"] += row["deadlock"]
            lanes[row["lanes"]] += 1
            segments[row["segments"]] += 1
            if "failure" in row:
                failures.append(f"{row['failure']} :: {row['case']}")
            for kind, verifier, observed, races, name in row.get("mutants", ()):
                mrows.append((kind, verifier, observed, races, name, row["case"]))
    crows = _case_mutants(a.seeds)
    elapsed = time.time() - t0
    cmd = (
        f"python bench/fuzz_sync.py --graphs {a.graphs} --seeds {a.seeds} --workers {a.workers} "
        f"--mutants {a.mutants} --seed-base {a.seed_base}"
    )
    done = "" if total["graphs"] >= a.graphs else f"; stopped early: {total['graphs']} of {a.graphs} graphs done"
    lines = [
        f"Command: `{cmd}` ({'summarized' if a.summarize else f'{elapsed / 60:.1f} min'} on {a.workers} "
        f"worker(s), {platform.machine()}, torch CPU; hypothesis seeds "
        f"{a.seed_base}..{a.seed_base + a.workers - 1}{done}).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| random graphs compiled and simulated | {total['graphs']} |",
        f"| interleavings simulated | {total['interleavings']} |",
        f"| graphs by lane count (incl. main) | {', '.join(f'{k}: {v}' for k, v in sorted(lanes.items()))} |",
        f"| graphs by segment count | {', '.join(f'{k}: {v}' for k, v in sorted(segments.items()))} |",
        f"| freed blocks handed to a later allocation (and poisoned) | {total['reused_blocks']} |",
        f"| graphs whose result differed from serial execution | {total['mismatch_graphs']} |",
        f"| graphs with a race reported by the happens-before check | {total['race_graphs']} |",
        f"| graphs that deadlocked | {total['deadlock_graphs']} |",
        f"| graphs the pipeline refused (errors) | {total['compile_errors']} |",
        "",
        f"Mutation testing, `tests/passes/cases.py` corpus ({len({r[5] for r in crows})} graphs, "
        f"{a.seeds} interleavings per mutant):",
        "",
        _mutation_table(crows),
        "",
        f"Mutation testing, random corpus ({len({r[5] for r in mrows})} graphs with auxiliary lanes, "
        f"{a.seeds} interleavings per mutant):",
        "",
        _mutation_table(mrows) if mrows else "(none)",
    ]
    escaped = [r[4] for r in crows + mrows if r[1] is None]
    if escaped:
        lines += ["", "Mutants the verifier accepted:", ""] + [f"- {e}" for e in escaped[:20]]
    if failures:
        lines += ["", f"Failures ({len(failures)}, first 10):", ""] + [f"- `{f[:500]}`" for f in failures[:10]]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    with open(a.out.replace(".md", ".json"), "w") as f:
        json.dump({"totals": dict(total), "lanes": dict(lanes), "failures": failures, "escaped": escaped}, f, indent=1)
    print(text)
    if a.write:
        path = os.path.join(ROOT, "RELIABILITY.md")
        doc = open(path).read()
        i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        with open(path, "w") as f:
            f.write(doc[:i] + "\n" + text + doc[j:])
    sys.exit(1 if failures or escaped else 0)


if __name__ == "__main__":
    main()
