"""Errors raised by capturepass.

Every error a user can trigger is a :class:`CapturePassError`. Errors about a
graph name the node, the lanes and events involved, and the pass that created
the offending node, so that a report can be read without a debugger.
"""

from __future__ import annotations


class CapturePassError(RuntimeError):
    """Base class of every error capturepass raises on purpose."""


class OptionError(CapturePassError, ValueError):
    """An option key or value is not valid; the message lists the valid ones."""


class HintError(CapturePassError):
    """A lane hint cannot be honoured (for example, it names the main lane)."""


class CapabilityError(CapturePassError):
    """A capability declaration or a capability callable is invalid."""


class PipelineError(CapturePassError):
    """The pass pipeline is malformed (a missing prerequisite, an unknown pass)."""


class VerificationError(CapturePassError):
    """The verifier found a graph that violates a synchronisation invariant.

    Attributes:
        rule: short name of the violated rule (for example ``"unordered-read"``).
        node: name of the node at fault.
    """

    def __init__(self, rule: str, node: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.node = node


class EmitError(CapturePassError):
    """A region could not be compiled or stitched by the inner compiler."""


class ResourceError(CapturePassError):
    """An owner-bound resource (a pool channel, a workspace, a profiling capture) was misused:
    the message names the resource, the owner and the lane or slot at fault."""
