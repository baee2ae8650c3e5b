"""Inner compilers: what compiles each region.

- ``inductor``: ``torch._inductor.standalone_compile`` with the ambient tracing
  context's shape environment, so dynamic sizes stay symbolic across regions.
- ``eager``: the region's FX graph itself (no code generation).
- ``tensorrt``: ``torch_tensorrt.dynamo.compile``. Torch-TensorRT cannot be
  installed on the machines capturepass is tested on, so this adapter is
  untested; it raises a clear error when the package is missing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import OptionError


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
    artifact = torch._inductor.standalone_compile(
        gm, example_inputs, dynamic_shapes="from_tracing_context", aot=True
    )
    return artifact


def _eager(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
    gm.recompile()
    return gm.forward


def _tensorrt(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
    if importlib.util.find_spec("torch_tensorrt") is None:
        raise OptionError(
            "inner='tensorrt' needs the torch_tensorrt package, which is not installed; "
            "install capturepass[tensorrt] or use inner='inductor' or inner='eager'"
        )
    import torch_tensorrt  # type: ignore[import-not-found]

    return torch_tensorrt.dynamo.compile(gm, inputs=example_inputs)


_COMPILERS = {"inductor": _inductor, "eager": _eager, "tensorrt": _tensorrt}


def check_available(name: str) -> None:
    """Raises a clear error if the inner compiler ``name`` cannot run here."""
    if name == "tensorrt" and importlib.util.find_spec("torch_tensorrt") is None:
        raise OptionError(
            "inner='tensorrt' needs the torch_tensorrt package, which is not installed; "
            "install capturepass[tensorrt] or use inner='inductor' or inner='eager'"
        )


def compile_region(gm: fx.GraphModule, example_inputs: list[Any], inner: str) -> Callable[..., Sequence[Any]]:
    """Compiles one region graph (which returns a tuple) with the named inner compiler."""
    return _COMPILERS[inner](gm, example_inputs)
