"""The pass pipeline, as data.

``PIPELINE`` is the one literal list of passes, in order. ``build_pipeline``
checks the named constraints when the pipeline is made: every ``requires`` of a
pass is ``ensure``-d by an earlier pass, and every Dynamo-stage pass comes
before every ATen-stage pass. Disabling a pass by name (for bisecting) is
checked the same way: disabling a pass that a later one depends on is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from capturepass.errors import PipelineError
from capturepass.ir.meta import Stage
from capturepass.passes.absorb_streams import AbsorbStreams
from capturepass.passes.annotate_capabilities import AnnotateCapabilities
from capturepass.passes.assign_streams import AssignStreams
from capturepass.passes.base import Pass
from capturepass.passes.bind_resources import BindResources
from capturepass.passes.emit import Emit
from capturepass.passes.insert_retention import InsertRetention
from capturepass.passes.insert_syncs import InsertSyncs
from capturepass.passes.lease_events import LeaseEvents
from capturepass.passes.partition import Partition
from capturepass.passes.read_hints import ReadHints
from capturepass.passes.verify import Verify

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

STAGES = tuple(Stage)


def build_pipeline(passes: Sequence[Pass], disabled: Iterable[str] = ()) -> list[Pass]:
    """Checks ordering constraints and returns the passes to run.

    Raises:
        PipelineError: an unknown disabled name, a requirement no earlier pass
            ensures, or a Dynamo-stage pass after an ATen-stage pass.
    """
    disabled = set(disabled)
    names = [p.name for p in passes]
    unknown = sorted(disabled - set(names))
    if unknown:
        raise PipelineError(f"cannot disable unknown pass(es) {unknown}; passes are {names}")
    ensured: set[str] = set()
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


def default_pipeline(registry_key: str = "", disabled: Iterable[str] = ()) -> list[Pass]:
    """The standard pipeline, checked."""
    passes: list[Pass] = []
    for cls in PIPELINE:
        passes.append(cls(registry_key) if cls is AnnotateCapabilities else cls())
    return build_pipeline(passes, disabled)


def pipeline_uuid(passes: Sequence[Pass]) -> str:
    """One digest over every pass's uuid, for cache keys."""
    import hashlib

    digest = hashlib.sha256()
    for p in passes:
        digest.update(f"{p.name}:{p.uuid()};".encode())
    return digest.hexdigest()
