"""capturepass: a declarative graph-capture compiler pass, shipped as a torch.compile backend.

It annotates FX graphs with lanes (logical CUDA streams), events and owners,
puts independent work on auxiliary lanes, inserts the minimal event waits,
leases events with the right lifetime, gates overlap on what each op says it
can tolerate, and emits monolithic or breakable CUDA graphs that keep every
owner of captured storage alive::

    compiled = torch.compile(model, backend="capturepass", options={"dump_dir": "dump"})

Public API:

- :func:`lane`: a lane hint, as a context manager or decorator;
- :func:`register_capability` / :func:`capability`: what an op may do;
- :func:`retain` / :func:`workspace`: for custom ops whose storage a capture bakes in;
- :class:`Options`, :class:`CapturePassError` and its subclasses.
"""

from capturepass.capabilities import CallInfo, capability, register_capability
from capturepass.errors import (
    CapabilityError,
    CapturePassError,
    EmitError,
    HintError,
    OptionError,
    PipelineError,
    VerificationError,
)
from capturepass.hints import lane
from capturepass.ir.meta import Capability
from capturepass.options import Options
from capturepass.runtime.resources import retain, workspace
from capturepass import logs as _logs

_logs.register()

__version__ = "0.1.0"

__all__ = [
    "CallInfo",
    "Capability",
    "CapabilityError",
    "CapturePassError",
    "EmitError",
    "HintError",
    "OptionError",
    "Options",
    "PipelineError",
    "VerificationError",
    "capability",
    "lane",
    "register_capability",
    "retain",
    "workspace",
]
