"""The pass pipeline, as data, and the pass manager that runs it.

``PIPELINE`` is the one literal list of passes, in order; the sub-pipelines
are named lists of it: ``FRONT`` (the Dynamo-stage passes), ``ATEN`` (the
ATen-stage passes through ``emit``) and ``ANALYSIS`` (``ATEN`` without ``emit``:
annotate, verify and dump, where no plan is wanted). ``build_pipeline`` checks the
named constraints when a pipeline is made: every ``requires`` of a pass is
``ensure``-d by an earlier pass, and every Dynamo-stage pass comes before every
ATen-stage pass. Disabling a pass by name
(for bisecting; option ``disable``) is checked the same way: disabling a pass
that a later one depends on is an error.

:func:`run_pipeline` is the pass manager: it runs each pass (inside
:func:`capturepass.ir.meta.shared_records`), records the properties it
ensures, calls the instruments (``capturepass.passes.instruments``) around
it, and re-raises a pass's exception naming the pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch.fx as fx

from capturepass.errors import CapturePassError, PassError, PipelineError, is_dynamo_signal
from capturepass.ir import meta
from capturepass.ir.meta import Stage
from capturepass.passes.absorb_streams import AbsorbStreams
from capturepass.passes.annotate_capabilities import AnnotateCapabilities
from capturepass.passes.assign_streams import AssignStreams
from capturepass.passes.base import Pass, PassContext
from capturepass.passes.bind_resources import BindResources
from capturepass.passes.emit import Emit
from capturepass.passes.insert_retention import InsertRetention
from capturepass.passes.insert_syncs import InsertSyncs
from capturepass.passes.instruments import PassInstrument
from capturepass.passes.lease_events import LeaseEvents
from capturepass.passes.partition import Partition
from capturepass.passes.read_hints import ReadHints
from capturepass.passes.verify import Verify

log = logging.getLogger("capturepass")

PIPELINE: tuple[type[Pass], ...] = (
    AbsorbStreams,
    ReadHints,
    AnnotateCapabilities,
    AssignStreams,
    InsertSyncs,
    LeaseEvents,
    BindResources,
    InsertRetention,
    Partition,
    Verify,
    Emit,
)

FRONT: tuple[type[Pass], ...] = tuple(cls for cls in PIPELINE if cls.stage == Stage.DYNAMO)
ATEN: tuple[type[Pass], ...] = tuple(cls for cls in PIPELINE if cls.stage == Stage.ATEN)
ANALYSIS: tuple[type[Pass], ...] = tuple(cls for cls in ATEN if cls is not Emit)

STAGES = tuple(Stage)


def build_pipeline(passes: Sequence[Pass], disabled: Iterable[str] = (), established: Iterable[str] = ()) -> list[Pass]:
    """Checks ordering constraints and returns the passes to run.

    ``established``: properties the graph has already (a run that continues an earlier one).

    Raises:
        PipelineError: an unknown disabled name, a requirement no earlier pass
            ensures, or a Dynamo-stage pass after an ATen-stage pass.
    """
    disabled = set(disabled)
    names = [p.name for p in passes]
    unknown = sorted(disabled - set(names))
    if unknown:
        raise PipelineError(f"cannot disable unknown pass(es) {unknown}; passes are {names}")
    ensured: set[str] = set(established)
    stage = 0
    out: list[Pass] = []
    for p in passes:
        if p.stage not in STAGES:
            raise PipelineError(f"pass {p.name} has unknown stage {p.stage!r}; stages are {STAGES}")
        if STAGES.index(p.stage) < stage:
            raise PipelineError(f"pass {p.name} (stage {p.stage}) comes after an ATen-stage pass")
        stage = STAGES.index(p.stage)
        if p.name in disabled:
            continue
        missing = [r for r in p.requires if r not in ensured]
        if missing:
            raise PipelineError(
                f"pass {p.name} requires {missing}, which no earlier enabled pass ensures "
                f"(pipeline: {names}, disabled: {sorted(disabled)})"
            )
        ensured.update(p.ensures)
        out.append(p)
    return out


def default_pipeline(
    registry_key: str = "", disabled: Iterable[str] = (), passes: Sequence[type[Pass]] = PIPELINE,
    upto: str | None = None, established: Iterable[str] = (),
) -> list[Pass]:
    """A pipeline of ``passes`` (a named list: ``PIPELINE``, ``FRONT``, ``ATEN``, ``ANALYSIS``),
    through the pass named ``upto`` when given, checked.

    Raises:
        PipelineError: ``upto`` names no pass of the list, or the checks of :func:`build_pipeline`.
    """
    classes = list(passes)
    if upto is not None:
        names = [cls.name for cls in classes]
        if upto not in names:
            raise PipelineError(f"no pass {upto!r} in the pipeline; passes are {names}")
        classes = classes[: names.index(upto) + 1]
    instances = [cls(registry_key) if cls is AnnotateCapabilities else cls() for cls in classes]
    return build_pipeline(instances, disabled, established)


def position(p: Pass) -> int:
    """The place of ``p``'s class in ``PIPELINE`` (the number its dump file starts with)."""
    for i, cls in enumerate(PIPELINE):
        if isinstance(p, cls):
            return i
    return len(PIPELINE)


def run_pipeline(
    passes: Sequence[Pass], gm: fx.GraphModule, ctx: PassContext, instruments: Sequence[PassInstrument] = ()
) -> None:
    """Runs ``passes`` on ``gm`` in order, with ``instruments`` around each.

    Raises:
        PassError: a pass raised an exception that is not capturepass's own (a bug), named.
        CapturePassError: a pass refused the graph; its message names the node, and (where
            the Python has exception notes) a note names the pass.
    """
    for inst in instruments:
        inst.enter_pipeline(gm, ctx)
    for p in passes:
        if not all(inst.should_run(p, gm, ctx) for inst in instruments):
            log.info("capturepass: %s: pass %s skipped by an instrument", meta.graph_info(gm).title, p.name)
            continue
        for inst in instruments:
            inst.run_before_pass(p, gm, ctx)
        try:
            with meta.shared_records():  # nodes the pass changes alike share the new record
                p.run(gm, ctx)
        except Exception as exc:
            if is_dynamo_signal(exc):
                raise  # Dynamo steering its own compile (a restart): not a failure of the pass
            if isinstance(exc, CapturePassError):
                add_note = getattr(exc, "add_note", None)
                if add_note is not None:
                    add_note(f"(in capturepass pass {p.name})")
                raise
            raise PassError(p.name, exc) from exc
        if p.stage == Stage.ATEN:
            gi = meta.graph_info(gm)
            meta.update_graph(gm, properties=gi.properties | frozenset(p.ensures))
        for inst in instruments:
            inst.run_after_pass(p, gm, ctx)
    for inst in instruments:
        inst.exit_pipeline(gm, ctx)


def pipeline_uuid(passes: Sequence[Pass]) -> str:
    """One digest over every pass's uuid, for cache keys."""
    import hashlib

    digest = hashlib.sha256()
    for p in passes:
        digest.update(f"{p.name}:{p.uuid()};".encode())
    return digest.hexdigest()
