"""The pass contract: one module, one public pass class, named IR properties.

A pass is a callable object with

- ``name``: equal to its module name and to the suffix of its dump file;
- ``stage``: ``"dynamo"`` (runs on Dynamo's torch-level graph, before AOT
  autograd) or ``"aten"`` (runs on the functional ATen graph);
- ``requires`` / ``ensures``: named IR properties; the pipeline checks when it
  is built that every requirement is ensured by an earlier pass;
- ``uuid()``: a digest of the pass's source and configuration, folded into the
  torch.compile and vLLM cache keys;
- ``run(gm, ctx)``: mutates ``gm`` in place. Passes never print: they record
  their decisions in the graph record (``meta.add_decision``), and the pass
  manager's instruments (``passes.instruments``) time them, log the decisions,
  verify after them and dump them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
from collections import Counter
from typing import TYPE_CHECKING, ClassVar

import torch.fx as fx

from capturepass.ir.meta import Property, Stage

if TYPE_CHECKING:
    from capturepass.ir.capabilities import CapabilityRegistry
    from capturepass.ir.options import Options

log = logging.getLogger("capturepass")

# Named IR properties (``capturepass.ir.meta.Property``), in the order the pipeline establishes them.
HINTS = Property.HINTS
CAPABILITIES = Property.CAPABILITIES
LANES = Property.LANES
SYNCED = Property.SYNCED
LEASED = Property.LEASED
BOUND = Property.BOUND
RETAINED = Property.RETAINED
PARTITIONED = Property.PARTITIONED
VERIFIED = Property.VERIFIED
EMITTED = Property.EMITTED

ALL_PROPERTIES = tuple(Property)


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph, and where it reports.

    Attributes:
        options: the validated backend options.
        registry: the capability registry to query.
        counters: per-pass counters (``counters[pass_name][key]``), read by tests
            and ``capturepass show``.
        example_inputs: the graph's example inputs (fake tensors) if known.
        artifacts: what a pass hands to the backend (the emitted program).
        not_capturable: nodes (by name) that failed under a real capture, with the
            reason; ``annotate_capabilities`` makes them breaks (the runtime
            rebuilds a graph this way after a capture failed on one op).
    """

    options: "Options"
    registry: "CapabilityRegistry"
    counters: dict[str, Counter] = dataclasses.field(default_factory=dict)
    example_inputs: list | None = None
    artifacts: dict = dataclasses.field(default_factory=dict)
    not_capturable: dict[str, str] = dataclasses.field(default_factory=dict)

    def count(self, pass_name: str, key: str, n: int = 1) -> None:
        """Adds ``n`` to a counter of ``pass_name``."""
        self.counters.setdefault(pass_name, Counter())[key] += n


class Pass:
    """Base class of every capturepass pass."""

    name: ClassVar[str] = ""
    stage: ClassVar[Stage] = Stage.ATEN
    requires: ClassVar[tuple[str, ...]] = ()
    ensures: ClassVar[tuple[str, ...]] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Transforms ``gm`` in place."""
        raise NotImplementedError(f"pass {type(self).__name__} does not implement run()")

    def config(self) -> tuple:
        """The configuration that changes what this pass produces (part of ``uuid``)."""
        return ()

    def uuid(self) -> str:
        """A digest of this pass's module source and configuration."""
        source = inspect.getsource(inspect.getmodule(type(self)))
        digest = hashlib.sha256(source.encode())
        digest.update(repr(self.config()).encode())
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"<pass {self.name}>"
