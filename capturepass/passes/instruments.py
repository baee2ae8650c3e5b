"""Pass instruments: what runs around every pass, outside the passes.

Passes never print, time themselves or write files. The pass manager
(:func:`capturepass.passes.pipeline.run_pipeline`) runs each pass and calls the
instruments around it, after TVM's ``PassInstrument``:

- ``enter_pipeline`` / ``exit_pipeline``: once, around the whole run;
- ``should_run``: every instrument must agree, or the pass is skipped (logged);
- ``run_before_pass`` / ``run_after_pass``: around each pass that runs.

The instruments here:

- :class:`Timing`: seconds per pass (``timings``), logged at DEBUG;
- :class:`LogDecisions`: one INFO line per decision a pass added to the graph
  record (WARNING for a decision marked so), the lane assignment once lanes
  exist, and each new break, so that ``TORCH_LOGS=capturepass`` shows them;
- :class:`VerifyEach`: the verifier after every ATen-stage pass (``verify=True``),
  so that a broken invariant is reported at the pass that broke it;
- :class:`Dump`: the canonical dump after each pass (``NNN_<pass>.txt``) and
  ``graph.json``, into the dump directory; and the same dumps into PyTorch's
  structured trace when it is on (``TORCH_TRACE=DIR``, read by ``tlparse``),
  beside Dynamo's, AOT autograd's and Inductor's own artifacts: one ``artifact``
  per pass dump, named ``capturepass_<graph>_<NNN>_<pass>`` (a string), and
  ``capturepass_<graph>_graph`` (``graph.json``, JSON). The trace needs no dump
  directory.

Disabling a pass by name (for bisecting a compile) is the pipeline's job
(option ``disable``): it checks that no later pass needs what the disabled one
ensures.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from capturepass.ir import meta, printer
from capturepass.ir import verify as ir_verify
from capturepass.ir.meta import Property, Stage
from capturepass.passes.base import Pass, PassContext

log = logging.getLogger("capturepass")


class PassInstrument:
    """Hooks around a pipeline run and each of its passes (all optional)."""

    def enter_pipeline(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called once before the first pass."""

    def should_run(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> bool:
        """Whether pass ``p`` runs (every instrument must agree)."""
        return True

    def run_before_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called before pass ``p`` runs."""

    def run_after_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called after pass ``p`` ran (its ensured properties are recorded already)."""

    def exit_pipeline(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called once after the last pass."""


class Timing(PassInstrument):
    """Seconds per pass name, accumulated over runs (``timings``), each logged at DEBUG."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._start = 0.0

    def run_before_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        self._start = time.perf_counter()

    def run_after_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        elapsed = time.perf_counter() - self._start
        self.timings[p.name] = self.timings.get(p.name, 0.0) + elapsed
        log.debug("capturepass: pass %s took %.3f ms on %s", p.name, elapsed * 1e3, meta.graph_info(gm).name)


def lane_summary(gm: fx.GraphModule) -> str:
    """``s0=main (3 nodes), s1=aux0 (2 nodes)``: the compute nodes of each lane."""
    gi = meta.graph_info(gm)
    counts = [0] * len(gi.lanes)
    for node in gm.graph.nodes:
        lane = meta.info(node).lane
        if meta.effect_of(node) is meta.Effect.COMPUTE and lane is not None and lane.index < len(counts):
            counts[lane.index] += 1
    return ", ".join(f"s{i}={name} ({n} node{'s' if n != 1 else ''})" for i, (name, n) in enumerate(zip(gi.lanes, counts)))


class LogDecisions(PassInstrument):
    """Logs what each pass decided: its new decisions, the lanes it assigned, its new breaks."""

    def __init__(self) -> None:
        self._before: meta.GraphInfo | None = None

    def run_before_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        self._before = meta.graph_info(gm) if log.isEnabledFor(logging.INFO) else None

    def run_after_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        before = self._before
        if before is None:
            return
        after = meta.graph_info(gm)
        for line in after.decisions[len(before.decisions):]:
            log.log(getattr(line, "level", logging.INFO), "capturepass: %s: %s: %s", after.title, p.name, line)
        if Property.LANES in p.ensures:
            log.info("capturepass: %s: %s: lanes %s", after.title, p.name, lane_summary(gm))
        for brk in after.breaks:
            if brk not in before.breaks:
                where = f" at %{brk.node}" if brk.node else ""
                log.info("capturepass: %s: %s: %s break%s: %s", after.title, p.name, brk.source, where, brk.reason)


class VerifyEach(PassInstrument):
    """Runs the verifier after every ATen-stage pass but ``verify`` (which is one) and ``emit``."""

    def run_after_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        if p.stage == Stage.ATEN and p.name not in ("verify", "emit"):
            ir_verify.verify(gm)


def structured_trace_on() -> bool:
    """Whether PyTorch's structured trace (``TORCH_TRACE``) is being written in this process.

    ``torch._logging.trace_structured`` writes through the handlers of its ``trace_log``
    (``torch/_logging/_internal.py``); asking first spares printing dumps nobody reads.
    Feature-detected: ``False`` where torch has no structured trace.
    """
    logging_mod = getattr(torch, "_logging", None)
    internal = getattr(logging_mod, "_internal", None)
    trace_log = getattr(internal, "trace_log", None)
    if not callable(getattr(logging_mod, "trace_structured", None)):
        return False
    for handler in getattr(trace_log, "handlers", None) or ():
        # torch's own trace handler (LazyTraceHandler) has a trace directory when TORCH_TRACE
        # (or TORCH_COMPILE_DEBUG) is set; without one it opens nothing and removes itself at
        # the first entry. Other handlers (a test runner's log capture) are not the trace.
        if not hasattr(handler, "root_dir"):
            continue
        if handler.root_dir is not None or getattr(handler, "stream", None) is not None:
            return True
    return False


def emit_structured(name: str, payload: str, encoding: str = "string") -> None:
    """One ``artifact`` entry of the structured trace (what ``tlparse`` lists per compile).

    The entry is tagged with the compile Dynamo is running (its frame and compile id), as
    Inductor's artifacts are, so that ``tlparse`` files it under the same compile.
    """
    trace_structured = getattr(getattr(torch, "_logging", None), "trace_structured", None)
    if trace_structured is None:
        return
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: payload,
    )


class Dump(PassInstrument):
    """The canonical dump after each pass, and ``graph.json``, written into ``dump_dir``.

    Args:
        dump_dir: the folder of this graph's dumps (``None``: the dumps are only collected,
            for another graph's folder or the trace to hold).
        index: the number a pass's file starts with (its place in the full pipeline).
        settings: what the dump shows.
        trace: also emit the dumps into the structured trace (default: whether it is on).
    """

    def __init__(
        self, dump_dir: str | None, index: Callable[[Pass], int], settings: printer.PrintSettings | None = None,
        trace: bool | None = None,
    ) -> None:
        self.dump_dir = dump_dir
        self.index = index
        self.settings = settings or printer.PrintSettings()
        self.trace = structured_trace_on() if trace is None else trace
        self.dumps: list[tuple[str, str]] = []

    def run_after_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        fname = f"{self.index(p):03d}_{p.name}.txt"
        self.dumps.append((fname, printer.dump(gm, title=f"after {p.name}", settings=self.settings)))

    def append(self, pass_name: str, text: str) -> None:
        """Appends ``text`` to the dump of pass ``pass_name`` (the outer program to ``emit``'s)."""
        for i, (fname, body) in enumerate(self.dumps):
            if fname.endswith(f"_{pass_name}.txt"):
                self.dumps[i] = (fname, body + text)

    def write(self, gm: fx.GraphModule | None, before: Sequence[tuple[str, str]] = ()) -> None:
        """Writes ``before`` (earlier stages' dumps) and this run's dumps, and ``graph.json`` of
        ``gm``, into the dump directory, and into the structured trace when it is on."""
        dumps = [*before, *self.dumps]
        wanted = self.dump_dir is not None or self.trace
        graph_text = printer.dumps_json(gm) if gm is not None and wanted else None
        if self.dump_dir is not None:
            os.makedirs(self.dump_dir, exist_ok=True)
            for fname, text in dumps:
                with open(os.path.join(self.dump_dir, fname), "w") as f:
                    f.write(text)
            if graph_text is not None:
                with open(os.path.join(self.dump_dir, "graph.json"), "w") as f:
                    f.write(graph_text)
        if self.trace:
            graph = meta.graph_info(gm).name if gm is not None else "graph"
            for fname, text in dumps:
                emit_structured(f"capturepass_{graph}_{os.path.splitext(fname)[0]}", text)
            if graph_text is not None:
                emit_structured(f"capturepass_{graph}_graph", graph_text, encoding="json")
