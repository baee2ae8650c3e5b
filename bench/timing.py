"""What the benchmarks share: the timing loop (median over repetitions of the mean time per call),
the capture of a callable into a CUDA graph, and a worker process's empty caches."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable


def fresh_caches(**extra: str) -> dict[str, str]:
    """The environment of a worker process with empty Inductor and schedule caches of its own
    (plus ``extra``): a process that found another's compiled kernels, Triton tuning or measured
    choice on disk would skip work (and the tuning's L2-flush buffer) a first compile pays."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench-inductor-"),
                CAPTUREPASS_CACHE_DIR=tempfile.mkdtemp(prefix="bench-capturepass-"), **extra)


def timed(fn: Callable[[], object], iters: int, reps: int = 7, warmup: int = 5, device: str = "cuda",
          before_rep: Callable[[], object] | None = None, lead_in: int = 3) -> float:
    """Median over ``reps`` of the mean milliseconds per call of ``fn``.

    On CUDA each repetition begins on an idle GPU (the previous one was waited for). A start
    event recorded then fires at once, while the first call is still on the host: all that call
    does before its first kernel launches (guards, wrappers, the model's Python) would count as
    GPU time, that latency over ``iters`` added to every call. So ``lead_in`` untimed calls are
    queued first (three by default: where a call's host latency exceeds one call's GPU time, one
    queued call would not cover it), and the start event, recorded behind them, fires when their work ends. What stays
    counted is what a steady stream of calls pays: a call that waits for the GPU (a host
    synchronisation) drains the queue and shows its own latency.

    Args:
        fn: the call to time.
        iters: calls per repetition.
        reps: repetitions.
        warmup: untimed calls first.
        device: ``"cuda"``: CUDA events around each repetition (the GPU's time, the host
            running ahead); ``"cpu"``: the wall clock.
        before_rep: called before each repetition (a barrier that keeps ranks in step).
        lead_in: on CUDA, untimed calls queued before each repetition's start event.
    """
    import torch

    for _ in range(warmup):
        fn()
    out = []
    if device == "cpu":
        for _ in range(reps):
            if before_rep is not None:
                before_rep()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - start) * 1e3 / iters)
        return statistics.median(out)
    torch.cuda.synchronize()
    for _ in range(reps):
        if before_rep is not None:
            before_rep()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(lead_in):
            fn()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def capture(fn: Callable[[], object], warm: int = 3, before: Callable[[], object] | None = None):
    """A CUDA graph of ``fn``, warmed up uncaptured first on the capture stream (lazy
    initialisations, such as an NCCL communicator, happen then); ``before`` runs just before
    the capture (a barrier that keeps ranks in step)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if before is not None:
        before()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.synchronize()
    return g


def save(out: str | None, stem: str, rows: list[dict], failures: list[str], table: str) -> None:
    """Prints ``table`` and the failures; with ``out``, also writes them to ``out/stem.md`` and the
    rows and failures to ``out/stem.json``."""
    import json
    import os

    print(table)
    for f in failures:
        print("failed:", f)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump({"rows": rows, "failures": failures}, f, indent=1)
        with open(os.path.join(out, f"{stem}.md"), "w") as f:
            f.write(table + "\n" + "".join(f"failed: {x}\n" for x in failures))


def frame_site(frame: dict) -> str:
    """One frame of a CUDA memory history (``torch.cuda.memory._snapshot()``) as ``path:line
    name``, the path cut to what names it: after ``site-packages/``, from ``capturepass/``, else
    the file's name (a script, or Inductor's generated code)."""
    path = frame["filename"]
    if "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[-1]
    elif "capturepass/" in path:
        path = path[path.rindex("capturepass/"):]
    else:
        path = os.path.basename(path)
    return f"{path}:{frame['line']} {frame['name']}"


def peak_blocks(entries) -> tuple[int, list[dict]]:
    """The most bytes the allocations among ``entries`` (a memory history's trace entries) held
    at once, and the blocks live then. A free of a block not among them is passed over."""
    live: dict[int, dict] = {}
    now = best = 0
    best_live: list[dict] = []
    for entry in entries:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
            now += entry["size"]
        elif entry["action"] == "free_requested" and entry["addr"] in live:
            now -= live.pop(entry["addr"])["size"]
        else:
            continue
        if now > best:
            best, best_live = now, list(live.values())
    return best, best_live


def peak_sites(snapshot: dict, top: int = 12) -> str:
    """The blocks live at the peak of a memory history (``torch.cuda.memory._snapshot()`` after
    ``_record_memory_history(stacks="python")``), summed by where they were allocated: the
    innermost frame, and the nearest capturepass frame that led to it. Where a variant's peak
    differs from another's, the difference shows here; the first line also gives the share of the
    peak allocated under a capturepass frame."""
    best, best_live = peak_blocks(e for trace in snapshot.get("device_traces", []) for e in trace)

    def site(entry: dict) -> str:
        frames = entry.get("frames") or []
        inner = frame_site(frames[0]) if frames else "?"
        ours = next((frame_site(f) for f in frames if "capturepass/" in f["filename"]), None)
        return inner + (f" <- {ours}" if ours and ours != inner else "")

    sums: dict[str, int] = {}
    ours = 0
    for entry in best_live:
        key = site(entry)
        sums[key] = sums.get(key, 0) + entry["size"]
        if any("capturepass/" in f["filename"] for f in entry.get("frames") or []):
            ours += entry["size"]
    # The variants reach their peaks at different points of the bench's sequence: the blocks
    # capturepass's own calls made are the share to compare, the rest is the bench's and the model's.
    lines = [f"peak of the recorded history: {best / 2**20:.1f} MiB in {len(best_live)} block(s), "
             f"{ours / 2**20:.1f} MiB of them allocated under capturepass"]
    lines += [f"  {size / 2**20:8.1f} MiB  {where}" for where, size in sorted(sums.items(), key=lambda kv: -kv[1])[:top]]
    # Which stream allocated the blocks live at the peak: a graph of lanes whose side streams hold
    # more than their share there keeps a side lane's results alive past their use (a free held
    # across lanes) or a workspace per stream (cuBLAS keeps one per stream until cleared).
    streams: dict[int, list[int]] = {}
    for entry in best_live:
        streams.setdefault(entry.get("stream", 0), []).append(entry["size"])
    if len(streams) > 1:
        lines.append("by stream: " + ", ".join(
            f"{stream:#x} {sum(sizes) / 2**20:.1f} MiB in {len(sizes)} block(s)"
            for stream, sizes in sorted(streams.items(), key=lambda kv: -sum(kv[1]))))
    largest = sorted(best_live, key=lambda e: -e["size"])[:5]
    lines.append("largest blocks: " + ", ".join(f"{e['size'] / 2**20:.1f} MiB ({site(e)})" for e in largest))
    return "\n".join(lines)
