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


class PassError(CapturePassError):
    """A pass failed on an exception of its own (a bug in capturepass, or input it did not expect).

    Attributes:
        pass_name: the pass that raised.
    """

    def __init__(self, pass_name: str, exc: BaseException) -> None:
        super().__init__(f"capturepass pass {pass_name} failed: {type(exc).__name__}: {exc}")
        self.pass_name = pass_name


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


class TraceError(CapturePassError):
    """A measured trace cannot be recorded (no CUDA, no capturepass graph ran, no kernels seen)."""


class SimulationError(CapturePassError):
    """The simulated program cannot finish (a deadlock) or cannot be simulated."""


class DumpError(CapturePassError):
    """A dump (``graph.json`` and its folder) cannot be read back.

    Attributes:
        file: the file or folder at fault.
        field: the field at fault, as a path into the document (``nodes[3].lane``);
            ``""`` when the file as a whole is.
    """

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file!r}: {field}: {problem}" if field else f"{file!r}: {problem}")
        self.file = file
        self.field = field


# Dynamo's own control-flow exceptions, by name (feature-detected: not every torch has each).
_DYNAMO_SIGNALS = ("RestartAnalysis", "SkipFrame", "Unsupported", "ShortenTraceback")


def is_dynamo_control_flow(exc: BaseException) -> bool:
    """Whether ``exc`` restarts Dynamo's analysis or skips the frame (not a compile failure)."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover - torch without Dynamo
        return False
    kinds = tuple(k for k in (getattr(dynamo_exc, n, None) for n in ("RestartAnalysis", "SkipFrame")) if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)


def is_dynamo_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is one Dynamo raises to steer its own compile, and must see unwrapped.

    Dynamo restarts its analysis on ``RestartAnalysis`` and its subclasses
    (``TensorifyScalarRestartAnalysis`` when a Python float it specialized should become
    a tensor), skips the frame on ``SkipFrame``, reports ``Unsupported`` as a graph
    break, re-raises its own formatted errors (``ShortenTraceback``, which
    ``BackendCompilerFailed`` is) and turns the fake-tensor errors it lists in
    ``exceptions_allowed_to_be_fallback`` into a graph break with a warning. Wrapped in a
    capturepass error, each would end the compile as a failure instead.
    """
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover - torch without Dynamo
        return False
    kinds = tuple(k for k in (getattr(dynamo_exc, name, None) for name in _DYNAMO_SIGNALS) if isinstance(k, type))
    kinds += tuple(k for k in getattr(dynamo_exc, "exceptions_allowed_to_be_fallback", ()) if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)
