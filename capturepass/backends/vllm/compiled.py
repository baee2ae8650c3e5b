"""The serializable result of the capturepass backend, for vLLM's AOT compile.

vLLM (with ``VLLM_USE_AOT_COMPILE``, its default on torch 2.10 and newer)
compiles the model with ``torch.compile(...).aot_compile``, saves the result
under ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/`` and, on
a warm restart, loads it with ``torch.compiler.load_compiled_function`` and
calls ``finalize_loading(vllm_config)`` on the backend's result. torch requires
that result to implement ``SerializableCallable``
(``serialize_compile_artifacts`` / ``deserialize_compile_artifacts``).

What is saved is the Dynamo graph (as ``torch.fx._graph_pickler`` writes it,
the way vLLM saves its own), its example inputs as meta tensors, and the
options given in code; not the compiled regions. Loading skips Dynamo and
compiles the loaded graph again with capturepass (``finalize_loading``), with
the options the environment gives then; Inductor's own caches make the regions'
compile fast. Saving the Inductor artifacts of the regions themselves is not
done (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import CapturePassError

try:
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # pragma: no cover - torch without AOT compile: a plain base
    SerializableCallable = object  # type: ignore[assignment,misc]

FORMAT = 1
_DROPPED_META = ("source_fn_stack", "nn_module_stack")


@contextlib.contextmanager
def _without_meta(gm: fx.GraphModule, keys: tuple[str, ...]):
    """Removes ``keys`` from every node's meta for the duration (they do not pickle), then restores them."""
    saved = []
    for node in gm.graph.nodes:
        for key in keys:
            if key in node.meta:
                saved.append((node, key, node.meta.pop(key)))
    try:
        yield
    finally:
        for node, key, value in saved:
            node.meta[key] = value


def _dump_graph(gm: fx.GraphModule) -> bytes:
    try:  # vLLM's pickler override handles sympy functions and the fake mode
        from vllm.compilation.caching import VllmSerializableFunction

        with _without_meta(gm, _DROPPED_META):
            return VllmSerializableFunction.serialize_graph_module(gm)
    except ImportError:
        from torch.fx._graph_pickler import GraphPickler, Options

        with _without_meta(gm, _DROPPED_META):
            return GraphPickler.dumps(gm, Options(ops_filter=None))


def _load_graph(data: bytes, fake_mode: Any) -> fx.GraphModule:
    try:
        from vllm.compilation.caching import VllmSerializableFunction

        return VllmSerializableFunction.deserialize_graph_module(data, fake_mode)
    except ImportError:
        from torch.fx._graph_pickler import GraphPickler

        return GraphPickler.loads(data, fake_mode)


def _no_autograd_cache() -> Any:
    """torch's AOT compile forces AOT autograd's cache, whose entries hold only Inductor's output
    code; capturepass's compiled graphs are not that, and are saved by this class instead."""
    return torch._functorch.config.patch(force_autograd_cache=False, bundled_autograd_cache=False)


def _dump_inputs(example_inputs: list[Any]) -> bytes:
    from torch.fx._graph_pickler import GraphPickler
    from torch.utils import _pytree as pytree

    meta_inputs = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty_like(t, device="meta"), list(example_inputs)
    )
    return GraphPickler.dumps(meta_inputs)


class CapturePassFunction(SerializableCallable):  # type: ignore[misc]
    """A capturepass-compiled Dynamo graph that torch's AOT compile (and so vLLM) can save and load.

    Attributes:
        graph: the pickled Dynamo graph, as the backend received it.
        inputs: the pickled example inputs (meta tensors and symbolic sizes).
        options: the options given in code (``None`` in vLLM: they come from the environment).
        loaded: whether this function came from a cache (compiled again on load).
    """

    def __init__(
        self,
        graph: bytes,
        inputs: bytes,
        options: dict[str, Any] | None,
        compiled: Any = None,
        pending: tuple[fx.GraphModule, list[Any], Any] | None = None,
    ) -> None:
        self.graph = graph
        self.inputs = inputs
        self.options = options
        self.loaded = pending is not None
        self._compiled = compiled
        self._pending = pending

    @classmethod
    def compile(
        cls, gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: str | None = None
    ) -> "CapturePassFunction":
        """Saves ``gm`` (before any pass changes it) and compiles it with capturepass."""
        from capturepass.backends.dynamo import capturepass_backend
        from capturepass.ir.options import Options

        Options.from_mapping(options)  # bad options fail before the graph is pickled
        graph = _dump_graph(gm)
        inputs = _dump_inputs(example_inputs)
        with _no_autograd_cache():
            compiled = capturepass_backend(gm, example_inputs, options=options, mode=mode)
        return cls(graph, inputs, None if options is None else dict(options), compiled=compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self.finalize_loading(None)
        return self._compiled(*args, **kwargs)

    def finalize_loading(self, vllm_config: Any = None) -> None:
        """Compiles the loaded graph with capturepass (vLLM calls this after loading from its cache)."""
        if self._compiled is not None or self._pending is None:
            return
        from torch._guards import TracingContext, tracing

        from capturepass.backends.dynamo import capturepass_backend

        gm, inputs, fake_mode = self._pending
        with tracing(TracingContext(fake_mode)), _no_autograd_cache():
            self._compiled = capturepass_backend(gm, inputs, options=self.options)
        self._pending = None

    @classmethod
    def serialize_compile_artifacts(cls, fn: "CapturePassFunction") -> bytes:
        return pickle.dumps({"format": FORMAT, "graph": fn.graph, "inputs": fn.inputs, "options": fn.options})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "CapturePassFunction":
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(data)
        if state.get("format") != FORMAT:
            raise CapturePassError(f"capturepass: saved artifact has format {state.get('format')!r}, expected {FORMAT}")
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = _load_graph(state["graph"], fake_mode)
        gm.recompile()
        saved_inputs = GraphPickler.loads(state["inputs"], fake_mode)
        # The placeholders' example values keep each input's device; the saved inputs are on meta.
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for node in placeholders:
            # Dynamo's input sources do not survive pickling; AOT autograd reads them only for
            # guards and static-input marks, and accepts None.
            if not hasattr(node, "_dynamo_source"):
                node._dynamo_source = None
        inputs = []
        for i, saved in enumerate(saved_inputs):
            value = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
            inputs.append(saved if value is None else value)
        return cls(state["graph"], state["inputs"], state["options"], pending=(gm, inputs, fake_mode))
