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
- :func:`retain` / :func:`workspace` / :func:`suspend_retention` / :func:`weak_ref`: for
  custom ops whose storage a capture bakes in;
- :func:`resource_pool` / :class:`Workspaces` / :func:`profiling_capture` /
  :func:`external_stream`: engine resources that follow graph ownership (docs/resources.md);
- :func:`release`: releases one model's owners (graphs, pools, leases, workspaces,
  channels, retained objects) in every compiled graph (docs/runtime.md);
- :func:`trace`: a measured run of compiled graphs on a GPU, lane by lane, as a Chrome trace;
- :func:`capturepass.show.summarize_dir` (and the ``capturepass show`` command): what a
  compile did, read back from its dumps;
- :class:`Options`, :class:`CapturePassError` and its subclasses;
- for vLLM (docs/vllm.md): :func:`backend` (``"capturepass.backend"``) and
  :data:`post_grad_pass` (``"capturepass.post_grad_pass"``).
"""

from capturepass.ir.capabilities import CallInfo, capability, register_capability
from capturepass.errors import (
    CapabilityError,
    CapturePassError,
    DumpError,
    EmitError,
    HintError,
    OptionError,
    PassError,
    PipelineError,
    ResourceError,
    SimulationError,
    TraceError,
    VerificationError,
)
from capturepass.hints import lane
from capturepass.ir.meta import Capability
from capturepass.measure import trace
from capturepass.ir.options import Options
from capturepass.runtime.external import external_stream
from capturepass.runtime.lifetime import release
from capturepass.runtime.pools import ChannelKey, ResourcePool, register_pool, resource_pool, unregister_pool
from capturepass.runtime.profiling import profiling_capture
from capturepass.runtime.resources import retain, suspend_retention, weak_ref, workspace
from capturepass.runtime.workspaces import Workspaces
from capturepass.backends.vllm.plugin import post_grad_pass

from capturepass import logs as _logs

_logs.register()


def backend(gm, example_inputs, options=None, mode=None):
    """The backend under a qualified name, for vLLM's ``compilation_config={"backend": "capturepass.backend"}``.

    See :func:`capturepass.backends.vllm.plugin.backend`.
    """
    from capturepass.backends.vllm.plugin import backend as vllm_backend

    return vllm_backend(gm, example_inputs, options, mode)


__version__ = "0.1.0"

__all__ = [
    "CallInfo",
    "Capability",
    "CapabilityError",
    "CapturePassError",
    "ChannelKey",
    "DumpError",
    "EmitError",
    "HintError",
    "OptionError",
    "Options",
    "PassError",
    "PipelineError",
    "ResourceError",
    "ResourcePool",
    "SimulationError",
    "TraceError",
    "VerificationError",
    "Workspaces",
    "backend",
    "capability",
    "external_stream",
    "lane",
    "post_grad_pass",
    "profiling_capture",
    "register_capability",
    "register_pool",
    "release",
    "resource_pool",
    "retain",
    "suspend_retention",
    "trace",
    "unregister_pool",
    "weak_ref",
    "workspace",
]
