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


def _worker(args: tuple[int, int, int, int]) -> dict:
    worker, graphs, seeds, mutants = args
    import torch
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from capturepass.testing.mutate import judge
    from capturepass.testing.simulate import explore
    from capturepass.ir import meta
    from tests.passes.test_properties import _compile, _inputs, cases

    torch.set_num_threads(1)
    stats: dict = {
        "graphs": 0, "interleavings": 0, "mismatch_graphs": 0, "race_graphs": 0, "deadlock_graphs": 0,
        "compile_errors": 0, "reused_blocks": 0, "lanes": collections.Counter(), "segments": collections.Counter(),
        "failures": [], "mutants": [],
    }
    mutated = 0

    @seed(1000 + worker)
    @settings(
        max_examples=graphs, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def one(case):
        nonlocal mutated
        stats["graphs"] += 1
        try:
            gm, _ = _compile(case, upto="verify")
        except Exception as exc:  # a pipeline or verifier error on a valid program is a finding
            stats["compile_errors"] += 1
            stats["failures"].append(f"compile: {type(exc).__name__}: {str(exc)[:300]} :: {case!r}")
            return
        inputs = _inputs(case, salt=7)
        report = explore(gm, inputs, range(seeds), replay=True)
        gi = meta.graph_info(gm)
        stats["interleavings"] += report.runs
        stats["reused_blocks"] += report.reused
        stats["lanes"][len(gi.lanes)] += 1
        stats["segments"][len(gi.segments)] += 1
        stats["mismatch_graphs"] += bool(report.mismatches)
        stats["race_graphs"] += bool(report.races)
        stats["deadlock_graphs"] += bool(report.deadlocks)
        if not report.ok:
            stats["failures"].append(f"{report.describe()} :: {case!r}")
        if mutated < mutants and len(gi.lanes) > 1:
            mutated += 1
            for o in judge(gm, inputs, range(seeds)):
                stats["mutants"].append((o.mutant.kind, o.verifier, o.observed, o.races, str(o.mutant), repr(case)))

    one()
    return stats


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
    from capturepass.testing.mutate import KINDS, Mutant, Outcome, Score

    s = Score([Outcome(Mutant(k, name), v, obs, r) for k, v, obs, r, name, _ in rows])
    return s.table()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=10000)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mutants", type=int, default=300, help="random graphs (with aux lanes) to mutate")
    ap.add_argument("--write", action="store_true", help="update RELIABILITY.md")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz-sync.md"))
    a = ap.parse_args()
    t0 = time.time()
    per = [a.graphs // a.workers + (1 if i < a.graphs % a.workers else 0) for i in range(a.workers)]
    mper = [a.mutants // a.workers + (1 if i < a.mutants % a.workers else 0) for i in range(a.workers)]
    jobs = [(i, per[i], a.seeds, mper[i]) for i in range(a.workers)]
    if a.workers == 1:
        results = [_worker(jobs[0])]
    else:
        with mp.get_context("spawn").Pool(a.workers) as pool:
            results = pool.map(_worker, jobs)
    total: dict = collections.Counter()
    lanes: collections.Counter = collections.Counter()
    segments: collections.Counter = collections.Counter()
    failures: list[str] = []
    mrows: list[tuple] = []
    for r in results:
        for k in ("graphs", "interleavings", "mismatch_graphs", "race_graphs", "deadlock_graphs", "compile_errors", "reused_blocks"):
            total[k] += r[k]
        lanes.update(r["lanes"])
        segments.update(r["segments"])
        failures += r["failures"]
        mrows += r["mutants"]
    crows = _case_mutants(a.seeds)
    elapsed = time.time() - t0
    cmd = (
        f"python bench/fuzz_sync.py --graphs {a.graphs} --seeds {a.seeds} --workers {a.workers} "
        f"--mutants {a.mutants}" + (" --write" if a.write else "")
    )
    lines = [
        f"Command: `{cmd}` ({elapsed / 60:.1f} min on {a.workers} worker(s), {platform.machine()}, "
        f"torch CPU; hypothesis seeds 1000..{999 + a.workers}).",
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
