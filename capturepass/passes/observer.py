"""The observer: the one place that times, dumps, counts and verifies around passes.

Passes never print. The observer runs each pass of a stage in order and, around
it:

- times it (logged at DEBUG on the ``capturepass`` logger, and kept in
  ``timings``);
- logs at INFO each decision the pass added to the graph record
  (``meta.add_decision``), the lane assignment once lanes exist, and each new
  break, so that ``TORCH_LOGS=capturepass`` shows one line per decision;
- records the IR properties the pass ensures in the graph record, and with
  ``verify=True`` runs the verifier on every established property, so that a
  broken invariant is reported at the pass that broke it;
- writes ``NNN_<pass>.txt``, the canonical dump after the pass, when a dump
  directory is set, and ``graph.json`` after the last pass;
- emits the same dumps into PyTorch's structured trace when it is on
  (``TORCH_TRACE=DIR``, read by ``tlparse``), beside Dynamo's, AOT autograd's and
  Inductor's own artifacts: one ``artifact`` per pass dump, named
  ``capturepass_<graph>_<NNN>_<pass>`` (a string), and ``capturepass_<graph>_graph``
  (``graph.json``, JSON). This needs no dump directory.

Each pass runs inside :func:`capturepass.ir.meta.shared_records`: nodes whose
records the pass changes alike share the new (frozen) record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import torch
import torch.fx as fx

from capturepass.ir import meta, printer
from capturepass.ir import verify as ir_verify
from capturepass.passes.base import LANES, Pass, PassContext
from capturepass.passes.pipeline import PIPELINE

log = logging.getLogger("capturepass")


def describe_program(program) -> str:
    """The outer program's generated code, bound to a throwaway host owner (handles as in the IR)."""
    from capturepass.runtime.owner import GraphOwner

    owner = GraphOwner(program.info.name, len(program.info.lanes), None, captured=False)
    try:
        return program.bind(owner, owner.lanes("eager")).code().strip()
    finally:
        owner.close()


def _lane_summary(gm: fx.GraphModule) -> str:
    gi = meta.graph_info(gm)
    counts = [0] * len(gi.lanes)
    for node in gm.graph.nodes:
        lane = meta.info(node).lane
        if meta.effect_of(node) is meta.Effect.COMPUTE and lane is not None and lane.index < len(counts):
            counts[lane.index] += 1
    return ", ".join(f"s{i}={name} ({n} node{'s' if n != 1 else ''})" for i, (name, n) in enumerate(zip(gi.lanes, counts)))


def _log_decisions(p: Pass, before: meta.GraphInfo, gm: fx.GraphModule) -> None:
    """INFO lines for what pass ``p`` decided: new decisions, the lanes it assigned, new breaks."""
    after = meta.graph_info(gm)
    pass_name = p.name
    for line in after.decisions[len(before.decisions):]:
        log.info("capturepass: %s %s: %s", after.name, pass_name, line)
    if LANES in p.ensures:
        log.info("capturepass: %s %s: lanes %s", after.name, pass_name, _lane_summary(gm))
    for brk in after.breaks:
        if brk not in before.breaks:
            where = f" at %{brk.node}" if brk.node else ""
            log.info("capturepass: %s %s: %s break%s: %s", after.name, pass_name, brk.source, where, brk.reason)


def structured_trace_on() -> bool:
    """Whether PyTorch's structured trace (``TORCH_TRACE``) is being written in this process.

    ``torch._logging.trace_structured`` writes through the handlers of its ``trace_log``
    (``torch/_logging/_internal.py``); asking first spares printing dumps nobody reads.
    Feature-detected: ``False`` where torch has no structured trace.
    """
    internal = getattr(getattr(torch, "_logging", None), "_internal", None)
    trace_log = getattr(internal, "trace_log", None)
    if not callable(getattr(torch._logging, "trace_structured", None)):
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


def _index(p: Pass) -> int:
    for i, cls in enumerate(PIPELINE):
        if isinstance(p, cls):
            return i
    return len(PIPELINE)


@dataclasses.dataclass
class Observer:
    """Runs passes with timing, dumps, counters and optional verification.

    Attributes:
        dump_dir: where this graph's dumps go, or ``None``.
        verify_each: verify after every pass.
        timings: seconds per pass name, accumulated.
        trace: also emit the dumps into the structured trace (default: whether it is on,
            :func:`structured_trace_on`).
    """

    dump_dir: str | None = None
    verify_each: bool = False
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    settings: printer.PrintSettings = dataclasses.field(default_factory=printer.PrintSettings)
    trace: bool = dataclasses.field(default_factory=structured_trace_on)

    def run(self, passes: Sequence[Pass], gm: fx.GraphModule, ctx: PassContext) -> list[tuple[str, str]]:
        """Runs ``passes`` on ``gm``; returns ``(file name, dump text)`` of each pass."""
        dumps: list[tuple[str, str]] = []
        for p in passes:
            before = meta.graph_info(gm)
            start = time.perf_counter()
            with meta.shared_records():  # nodes the pass changes alike share the new record
                p.run(gm, ctx)
            elapsed = time.perf_counter() - start
            self.timings[p.name] = self.timings.get(p.name, 0.0) + elapsed
            log.debug("capturepass: pass %s took %.3f ms on %s", p.name, elapsed * 1e3, meta.graph_info(gm).name)
            if log.isEnabledFor(logging.INFO):
                _log_decisions(p, before, gm)
            if p.stage == "aten":
                gi = meta.graph_info(gm)
                meta.update_graph(gm, properties=gi.properties | frozenset(p.ensures))
                if self.verify_each and p.name not in ("verify", "emit"):
                    ir_verify.verify(gm)
            if self.dump_dir is not None or self.trace:
                fname = f"{_index(p):03d}_{p.name}.txt"
                text = printer.dump(gm, title=f"after {p.name}", settings=self.settings)
                if p.name == "emit" and "program" in ctx.artifacts:
                    text += "\n# outer program\n" + describe_program(ctx.artifacts["program"]) + "\n"
                dumps.append((fname, text))
        return dumps

    def write(self, dumps: Sequence[tuple[str, str]], gm: fx.GraphModule | None = None) -> None:
        """Writes dump files (and ``graph.json`` for ``gm``) into the dump directory, and the
        structured trace when it is on."""
        graph_text = printer.dumps_json(gm) if gm is not None and (self.dump_dir is not None or self.trace) else None
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
