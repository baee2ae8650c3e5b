"""Pass counts of the model zoo under capturepass, Inductor and Inductor's reduce-overhead mode.

Runs every model of :mod:`capturepass.testing.zoo` (or those named) on the available
device, one model per subprocess with a timeout per backend (a crash or a hang costs
that backend of that model only; the rest run in a new subprocess), calls each
compiled model ``--calls`` times on new inputs and compares every output with eager's
at the zoo's tolerance. Prints a markdown table: per model and backend, the calls
equal to eager and the largest absolute difference (or the first failure), and for
capturepass how each graph ran: CUDA graphs ``monolithic``, ``breakable`` (with its
breaks) or uncaptured. A last row counts the models whose every call passed.

    python3 scripts/zoo_table.py                       # all models, cuda if present
    python3 scripts/zoo_table.py --models llama,t5 --device cpu --json out.json

Backends: ``capturepass`` (``--options``, default ``{}``), ``inductor``, and
``reduce-overhead`` (``torch.compile(mode="reduce-overhead")``: Inductor with CUDA
graph trees; on the CPU it is plain Inductor, still reported).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("capturepass", "inductor", "reduce-overhead")


def _first_line(exc: BaseException) -> str:
    from torch._dynamo.exc import BackendCompilerFailed

    while isinstance(exc, BackendCompilerFailed) and getattr(exc, "inner_exception", None) is not None:
        exc = exc.inner_exception
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _capture_summary(records: list[Any]) -> list[dict[str, Any]]:
    """How each graph capturepass compiled ran: capture mode, breaks, captures held.

    A record's graph and program are the current ones: after a capture failed on an op,
    the backend rebuilds the graph with that op a break and updates the record.
    """
    from capturepass.ir import meta

    out = []
    for rec in records:
        gi = meta.graph_info(rec.graph)
        ex = rec.executor
        reason = getattr(ex, "uncaptured_reason", None)
        captured = bool(ex is not None and ex.captured and ex.num_captures > 0)
        if not gi.on_cuda:
            mode = "host"
        elif captured:
            mode = str(gi.cudagraphs)
        else:
            mode = "uncaptured"
        out.append({
            "graph": rec.name,
            "mode": mode,
            "resolved_mode": str(gi.cudagraphs),
            "breaks": [f"{b.source}:{b.node or '-'}: {b.reason}" for b in gi.breaks],
            "learned_breaks": dict(getattr(ex, "not_capturable", None) or {}),
            "uncaptured_reason": reason,
            "lanes": len(gi.lanes),
            "segments": len(gi.segments),
            "regions": len(rec.program.regions),
            "captures": None if ex is None else ex.num_captures,
        })
    return out


def _run_backend(name: str, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from capturepass.backends.compile import last_compiled
    from capturepass.backends.dynamo import register
    from capturepass.testing import zoo

    register()  # where capturepass runs from a source tree, without its entry point installed
    torch._dynamo.reset()
    device = args.device
    tol = zoo.TOLERANCE["cuda" if device.startswith("cuda") else "cpu"]
    result: dict[str, Any] = {"backend": backend, "calls": args.calls, "passed": 0, "error": None, "max_abs": None}
    t0 = time.perf_counter()
    before = last_compiled()
    try:
        model, make_inputs = zoo.build(name, device=device)
        if backend == "capturepass":
            compiled = torch.compile(model, backend="capturepass", options=json.loads(args.options))
        elif backend == "inductor":
            compiled = torch.compile(model, backend="inductor")
        else:
            compiled = torch.compile(model, mode="reduce-overhead")
        worst = 0.0
        for call in range(args.calls):
            try:
                errs = zoo.compare_with_eager(
                    model, compiled, make_inputs, (call + 1,), label=f"{name} [{backend}]", **tol
                )
                worst = max(worst, errs[0])
                result["passed"] += 1
            except Exception as e:  # noqa: BLE001 - every failure is a table entry
                result["error"] = result["error"] or _first_line(e)
                if "call" not in result:
                    result["call"] = call
        result["max_abs"] = worst
    except Exception as e:  # noqa: BLE001
        result["error"] = _first_line(e)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if backend == "capturepass":
        result["capture"] = _capture_summary([r for r in last_compiled() if not any(r is b for b in before)])
    return result


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for backend in args.backends.split(","):
        print(json.dumps({"event": "start", "backend": backend}), flush=True)
        print(json.dumps({"event": "result", **_run_backend(args.worker, backend, args)}), flush=True)


def _run_model(name: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Runs ``name`` under every backend, in subprocesses; a crash or timeout costs one backend."""
    results: dict[str, dict[str, Any]] = {}
    todo = [b for b in args.backends.split(",")]
    while todo:
        cmd = [
            sys.executable, os.path.abspath(__file__), "--worker", name, "--backends", ",".join(todo),
            "--device", args.device, "--calls", str(args.calls), "--options", args.options,
        ]
        # stderr to a file: a pipe nobody reads fills up and stalls a chatty worker.
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        current, deadline = None, time.monotonic() + args.timeout
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
            if not sel.select(timeout=min(left, 5.0)):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "start":
                current, deadline = msg["backend"], time.monotonic() + args.timeout
            elif msg.get("event") == "result" and msg.get("backend") in todo:
                msg.pop("event")
                results[msg["backend"]] = msg
                todo.remove(msg["backend"])
                current = None
        proc.wait()
        err.seek(0)
        stderr_tail = err.read()[-4000:]
        err.close()
        if current is None and todo and not timed_out and proc.returncode == 0:
            current = todo[0]  # exited without starting it: count it as a crash
        if current is not None or todo:
            failed = current or todo[0]
            last = [ln for ln in stderr_tail.splitlines() if ln.strip()][-1:] or [""]
            why = f"timeout after {args.timeout}s" if timed_out else f"crash (exit {proc.returncode}): {last[0]}"
            results[failed] = {"backend": failed, "calls": args.calls, "passed": 0, "error": why[:300]}
            todo.remove(failed)
    return results


def _cell(res: dict[str, Any] | None) -> str:
    if res is None:
        return "-"
    text = f"{res['passed']}/{res['calls']}"
    if res.get("error"):
        return f"{text} {res['error'][:120]}".replace("|", "\\|")
    if res.get("max_abs") is not None:
        text += f" ({res['max_abs']:.1e})"
    return text


def _capture_cell(res: dict[str, Any] | None) -> str:
    if not res or not res.get("capture"):
        return "-"
    parts = []
    for g in res["capture"]:
        text = f"{g['graph']}: {g['mode']}, {g['regions']} regions, {g['lanes']} lanes"
        if g["breaks"]:
            text += "; breaks: " + "; ".join(g["breaks"])[:200]
        if g["uncaptured_reason"]:
            text += f"; why: {g['uncaptured_reason'][:200]}"
        parts.append(text)
    return "<br>".join(parts).replace("|", "\\|").replace("\n", " ")


def main() -> None:
    """Parses the arguments, runs the zoo and prints the table (or, with ``--worker``, runs one model)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--calls", type=int, default=3, help="calls per compiled model, each on new inputs")
    p.add_argument("--options", default="{}", help="capturepass options, as JSON")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per model and backend (the first backend of a subprocess includes its imports)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--jobs", type=int, default=1,
                   help="models run at once, each in its own subprocess (the table's order stays the zoo's)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        _worker(args)
        return
    from capturepass.testing import zoo

    names = [n for n in args.models.split(",") if n] or list(zoo.ZOO)
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        p.error(f"unknown zoo model(s) {', '.join(unknown)}; the zoo has: {', '.join(zoo.ZOO)}")
    backends = args.backends.split(",")
    def one(name: str) -> dict[str, dict[str, Any]]:
        t0 = time.perf_counter()
        res = _run_model(name, args)
        status = ", ".join(f"{b} {_cell(res.get(b))[:60]}" for b in backends)
        print(f"# {name} ({time.perf_counter() - t0:.0f}s): {status}", file=sys.stderr, flush=True)
        return res

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        all_results = dict(zip(names, pool.map(one, names)))
    import torch

    print(f"zoo on {args.device} (torch {torch.__version__}), float32, {args.calls} calls each, "
          f"capturepass options {args.options}\n")
    print("| model | " + " | ".join(backends) + " | capturepass capture |")
    print("|---" * (len(backends) + 2) + "|")
    for name, res in all_results.items():
        cells = [_cell(res.get(b)) for b in backends]
        print(f"| {name} | " + " | ".join(cells) + f" | {_capture_cell(res.get('capturepass'))} |")
    totals = [
        sum(1 for r in all_results.values() if r.get(b) and r[b]["passed"] == r[b]["calls"]) for b in backends
    ]
    print("| **models passing** | " + " | ".join(f"**{t}/{len(names)}**" for t in totals) + " | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "options": args.options,
                       "results": all_results}, f, indent=1)


if __name__ == "__main__":
    main()
