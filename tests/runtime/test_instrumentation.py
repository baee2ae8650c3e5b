"""The runtime's instrumentation hook (what ``capturepass.trace`` wraps calls with) and
``Executor.uncaptured``."""

from __future__ import annotations

import contextlib
import threading

import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.runtime import context


def _f(x, w):
    a = x @ w
    with capturepass.lane("aux"):
        b = (x * 2) @ w
    return a + b


def test_graph_and_region_calls_run_inside_the_instrumentation_of_their_thread():
    compiled = torch.compile(_f, backend="capturepass", options={"inner": "eager"})
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled(x, w)
    executor = last_compiled()[-1].executor
    seen: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def note(kind, obj):
        seen.append((kind, obj))
        yield

    inst = context.Instrumentation(graph=lambda ex: note("graph", ex), region=lambda spec: note("region", spec.index))
    with context.instrumented(inst):
        torch.testing.assert_close(compiled(x, w), _f(x, w))
        other = threading.Thread(target=compiled, args=(x, w))  # another thread: not observed
        other.start()
        other.join()
    compiled(x, w)  # after the block: not observed
    regions = [i for k, i in seen if k == "region"]
    assert seen[0] == ("graph", executor)
    assert regions == [r.index for r in executor.program.regions]
    assert len(seen) == 1 + len(regions)
    assert context.instrumentation() is None


def test_uncaptured_block_runs_the_eager_program_and_keeps_captures():
    compiled = torch.compile(_f, backend="capturepass", options={"inner": "eager", "cudagraphs": "breakable"})
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled(x, w)
    executor = last_compiled()[-1].executor
    executor.captured = True  # as on a GPU: calls would capture and replay
    calls = []
    executor.capture = lambda *a, **k: calls.append("capture")  # a host cannot capture: note the attempt
    with executor.uncaptured():
        torch.testing.assert_close(compiled(x, w), _f(x, w))
    assert calls == []
