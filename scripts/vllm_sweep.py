"""vLLM architectures through capturepass's routes in a real vLLM engine on the CPU, against mode 0.

The engine tests (``tests/vllm/``) run a tiny Llama and a tiny Qwen2-MoE; this sweep tries the
further architectures of ``tests/vllm/run_engine.py``'s ``SWEEP_CONFIGS`` as a vLLM user would,
each through vLLM's own model code (its fused-MoE layer with and without shared experts, its
multi-head latent attention, fused QKV and gate-up projections, soft-capped logits): tiny
configs, random weights (seeded), float32, one prompt, eight greedy tokens. Every model runs
in one engine per route:

- ``none``: mode 0 (no compilation), the reference;
- ``inductor``: ``VLLM_COMPILE`` without capturepass (vLLM's own compile: the control);
- ``backend``: ``DYNAMO_TRACE_ONCE`` with ``backend="capturepass"``;
- ``pass``: ``VLLM_COMPILE`` with ``capturepass.post_grad_pass`` (on the host it leaves each
  piece as it was: a host graph runs its lanes in program order);
- ``pass-lanes``: the same with ``regions="segments"``, which writes the lanes into the pieces
  vLLM's Inductor compiles.

A route is ``OK`` when its tokens are mode 0's and each log-probability is within
``LOGPROB_TOL`` of mode 0's. A route beyond it is ``VLLM`` (not capturepass's) when vLLM's own
compile is beyond it too and the route is within ``LOGPROB_TOL`` of vLLM's own compile (the
compiled numerics of vLLM's model code); ``FAIL`` otherwise. Prints one line per model and route
and exits 1 if any route failed. Run it with the interpreter of ``.venv-vllm`` (``bash
scripts/test_vllm.sh`` makes it)::

    .venv-vllm/bin/python scripts/vllm_sweep.py                        # every sweep model
    .venv-vllm/bin/python scripts/vllm_sweep.py --models mixtral,deepseek_v2 --routes none,pass-lanes

Each engine takes 30 to 60 s on a 2-core CPU; the whole sweep about 35 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))

from run_engine import LOGPROB_TOL, SWEEP_CONFIGS, engine_env  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "vllm", "run_engine.py")
# route -> (run_engine's route, capturepass's options in the environment)
ROUTES = {
    "none": ("none", None),
    "inductor": ("inductor", None),
    "backend": ("backend", None),
    "pass": ("pass", None),
    "pass-lanes": ("pass", '{"regions": "segments"}'),
}


def largest_difference(got: dict, want: dict) -> float:
    """The largest difference between two generations' log-probabilities (``inf``: other tokens)."""
    if got["tokens"] != want["tokens"]:
        return float("inf")
    return max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))


def verdict(got: dict, reference: dict, vllm_own: dict | None) -> str:
    """``OK``, ``VLLM`` or ``FAIL`` for one route's generation (see the module's docstring)."""
    if largest_difference(got, reference) <= LOGPROB_TOL:
        return "OK"
    if vllm_own is not None and largest_difference(vllm_own, reference) > LOGPROB_TOL \
            and largest_difference(got, vllm_own) <= LOGPROB_TOL:
        return "VLLM"
    return "FAIL"


def run(model: str, route: str, work: str) -> tuple[dict | None, str]:
    """One engine; its generation (``None``: it failed) and the tail of its output."""
    engine_route, options = ROUTES[route]
    extra = {"CAPTUREPASS_OPTIONS": options} if options else {}
    env = engine_env(work, f"cache-{model}-{route}", f"dump-{model}-{route}", ROOT, **extra)
    proc = subprocess.run([sys.executable, SCRIPT, "--route", engine_route, "--work", work, "--model", model],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return None, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), ""


def pass_notes(work: str, model: str, route: str) -> str:
    """What the pass said of each piece vLLM gave it (the first line of each ``post_grad.txt``:
    the lanes it wrote, or why it left the piece as it was)."""
    dump = os.path.join(work, f"dump-{model}-{route}")
    heads = []
    for piece in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
        path = os.path.join(dump, piece, "post_grad.txt")
        if os.path.exists(path):
            with open(path) as f:
                heads.append(f.readline().strip().lstrip("# "))
    return "; ".join(heads) or "no piece dumped"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SWEEP_CONFIGS))
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--work", default=None, help="a folder for models, caches and dumps (default: a new temporary one)")
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    routes = [r for r in args.routes.split(",") if r]
    for name, known, what in ((models, SWEEP_CONFIGS, "model"), (routes, ROUTES, "route")):
        unknown = [n for n in name if n not in known]
        if unknown:
            p.error(f"unknown {what}: {', '.join(unknown)} (choose from {', '.join(known)})")
    if "none" not in routes:
        routes.insert(0, "none")  # the reference
    if "inductor" not in routes and any(r.startswith("pass") for r in routes):
        routes.insert(1, "inductor")  # what the pass routes' pieces are before the pass
    work = args.work or tempfile.mkdtemp(prefix="vllm-sweep-")
    failed = 0
    for model in models:
        results: dict[str, dict | None] = {}
        for route in routes:
            results[route], tail = run(model, route, work)
            if results[route] is None:
                print(f"FAIL {model} {route}: the engine failed\n{tail}", flush=True)
                failed += 1
        reference, own = results.get("none"), results.get("inductor")
        if reference is None:
            continue
        for route in routes:
            got = results[route]
            if route == "none" or got is None:
                continue
            status = verdict(got, reference, own)
            failed += status == "FAIL"
            note = f"; {pass_notes(work, model, route)}" if route.startswith("pass") else ""
            print(f"{status:4s} {model} {route}: tokens {'equal to' if got['tokens'] == reference['tokens'] else 'unlike'}"
                  f" mode 0's, largest log-probability difference {largest_difference(got, reference):.1e}"
                  + (f" (vLLM's own compile: {largest_difference(own, reference):.1e})" if own and route != "inductor" else "")
                  + note, flush=True)
    print(f"{len(models)} model(s), {failed} failure(s); work folder {work}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
