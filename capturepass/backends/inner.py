"""Inner compilers: what compiles each region.

- ``inductor``: Inductor's compile of an AOT autograd inference graph (``compile_fx_forward``,
  :func:`_forward_compiler`), in the frame's fake mode, so dynamic sizes stay symbolic across
  regions; where torch has none, ``torch._inductor.standalone_compile`` with the ambient
  tracing context's shape environment and Inductor's configuration as ``torch.compile`` would
  use it (:func:`_as_torch_compile`).
- ``eager``: the region's FX graph itself (no code generation).
- ``tensorrt``: ``torch_tensorrt.dynamo.compile``. Torch-TensorRT cannot be
  installed on the machines capturepass is tested on, so this adapter is
  untested; it raises a clear error when the package is missing.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import OptionError

log = logging.getLogger("capturepass")


@functools.cache
def _takes_options() -> bool:
    takes = "options" in inspect.signature(torch._inductor.standalone_compile).parameters
    if not takes:
        log.info("capturepass: this torch's standalone_compile takes no options: Inductor tunes each "
                 "region's Triton kernels during the compile, on random tensors as large as their "
                 "arguments (more peak memory than torch.compile's tuning at the first call)")
    return takes


def _as_torch_compile() -> dict[str, Any]:
    """The options that undo what ``standalone_compile`` changes for artifacts it saves.

    It turns on ``triton.autotune_at_compile_time`` so that a saved artifact carries tuned
    kernels. That tunes every Triton kernel during the compile on random tensors as large as
    its arguments: on a Llama with a 32000-word vocabulary (H200), a random [32000, 2048] bf16
    weight (125 MiB) and the benchmark's 60 MiB cache flush buffer beside the real weights,
    which made the peak memory of a compile twice ``mode="reduce-overhead"``'s. capturepass
    keeps no artifact: its kernels are tuned at their first call, as ``torch.compile``'s are,
    in the warm-up that every capture runs first (on the real inputs, in the capture's pool).
    The user's own setting is passed on.
    """
    setting = torch._inductor.config.triton.autotune_at_compile_time
    return {"config_patches": {"triton.autotune_at_compile_time": setting}}


@functools.cache
def _forward_compiler() -> Callable[[fx.GraphModule, list[Any]], Callable[..., Sequence[Any]]] | None:
    """Inductor's compile of an inference graph AOT autograd produced (``compile_fx_forward``: the
    joint-graph passes, the user-visible output strides, then ``compile_fx_inner``), called
    directly; ``None`` where this torch has no such function of the expected signature.

    A region's graph is a piece of the graph AOT autograd already produced for the whole
    frame: functional, decomposed, its input writes kept as copies. ``standalone_compile``
    would trace it through AOT autograd once more (about a tenth of each compile, and a
    runtime wrapper on every call) to produce the same graph.
    """
    try:
        cf = importlib.import_module("torch._inductor.compile_fx")
        virtualized = importlib.import_module("torch._inductor.virtualized")
    except ImportError:
        return _standalone_because("it has no torch._inductor.compile_fx")
    forward, make_extra = getattr(cf, "compile_fx_forward", None), getattr(cf, "create_compiler_config_extra", None)
    if forward is None or make_extra is None:
        return _standalone_because("it has no compile_fx_forward")
    wanted = {"num_orig_model_outputs", "num_example_inputs", "compiler_config_extra", "is_inference"}
    if not wanted <= set(inspect.signature(forward).parameters):
        return _standalone_because("its compile_fx_forward takes other arguments")
    # Its argument is the graph in newer releases, Inductor's config module in older ones.
    extra_of: Callable[[fx.GraphModule], Any]
    takes = list(inspect.signature(make_extra).parameters)
    if takes == ["gm"]:
        extra_of = make_extra
    elif takes == ["config"]:
        extra_of = lambda gm: make_extra(torch._inductor.config)  # noqa: E731
    else:
        return _standalone_because("its create_compiler_config_extra takes other arguments")

    def compile_forward(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
        gm = copy.deepcopy(gm)  # the joint-graph passes rewrite the graph they are given
        for node in gm.graph.nodes:
            # What AOT autograd's trace would note, and Inductor names kernels and comments by.
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                node.meta.setdefault("original_aten", node.target)
        extra = extra_of(gm)
        extra.cudagraphs.value = False  # capturepass captures; Inductor must not
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        # A tracing context of its own: Inductor records output strides in the ambient one,
        # which belongs to the frame's compile.
        with virtualized.V.set_fake_mode(fake_mode), \
                torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            code = forward(gm, list(example_inputs), num_orig_model_outputs=len(outputs),
                           num_example_inputs=len(example_inputs), compiler_config_extra=extra,
                           is_inference=True)

        def call(*args: Any) -> Sequence[Any]:
            return code(list(args))

        return call

    return compile_forward


def _standalone_because(why: str) -> None:
    log.info("capturepass: this torch's Inductor is called through standalone_compile (%s): each region "
             "is traced by AOT autograd once more", why)
    return None


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
    forward = _forward_compiler()
    if forward is not None:
        return forward(gm, example_inputs)
    return _standalone(gm, example_inputs)


def _standalone(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Sequence[Any]]:
    kwargs: dict[str, Any] = {"options": _as_torch_compile()} if _takes_options() else {}
    artifact = torch._inductor.standalone_compile(
        gm, example_inputs, dynamic_shapes="from_tracing_context", aot=True, **kwargs
    )
    return _runtime_wrapper(artifact) or artifact


def _runtime_wrapper(artifact: Any) -> Callable[..., Sequence[Any]] | None:
    """AOT autograd's runtime wrapper inside a ``standalone_compile`` artifact, as a function of
    the region's inputs; ``None`` where this torch builds the artifact otherwise.

    The artifact's own call passes through four more layers (the artifact, its bundle, a
    ``torch._dynamo.disable`` wrapper and ``aot_module_simplified``'s ``forward``, which
    prepends the graph's parameters) before the runtime wrapper: about 0.9 us per region call
    on an x86 CPU, which every uncaptured call pays per region. A region is only called from
    inside the graph Dynamo compiled, which already runs with Dynamo's frame evaluation off,
    and its graph has no parameters (every tensor is an input).
    """
    bundle = getattr(artifact, "inner_fn", None)
    disabled = getattr(bundle, "compiled_fn", None)
    forward = getattr(disabled, "__wrapped__", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or cells is None or len(code.co_freevars) != len(cells):
        return None
    free = dict(zip(code.co_freevars, cells))
    if set(free) != {"compiled_fn", "params_buffers_flat"}:
        return None
    try:
        wrapper, params = free["compiled_fn"].cell_contents, free["params_buffers_flat"].cell_contents
    except ValueError:  # an empty cell
        return None
    if not callable(wrapper) or not isinstance(params, list) or params:
        return None

    def call(*args: Any) -> Sequence[Any]:
        return wrapper(list(args))

    return call


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
