"""vLLM's general plugin, the backend route and the pass route.

Nothing here imports vLLM at import time, and nothing touches a device: this
module is imported by ``import capturepass`` (for ``capturepass.backend`` and
``capturepass.post_grad_pass``) and by vLLM's plugin loader in every vLLM
process.

Routes (docs/vllm.md):

- backend: ``compilation_config={"mode": "DYNAMO_TRACE_ONCE", "backend":
  "capturepass"}`` (the name registered by :func:`register`, vLLM's
  ``vllm.general_plugins`` entry point) or ``"capturepass.backend"`` (a
  qualified name vLLM imports, no plugin needed). Both compile with
  :func:`backend`, which returns a
  :class:`~capturepass.backends.vllm.compiled.CapturePassFunction`: a
  ``SerializableCallable`` that vLLM's AOT compile saves and loads.
- pass: ``compilation_config={"inductor_passes": {"post_grad_custom_post_pass":
  "capturepass.post_grad_pass"}}`` in vLLM's own mode (``VLLM_COMPILE``):
  :class:`PostGradPass` runs the pipeline on a copy of each piece Inductor
  compiles and writes the lanes into the piece (``capturepass.backends.post_grad``).

Options: vLLM passes none to a backend, so they come from the environment,
``CAPTUREPASS_OPTIONS`` (a JSON object), ``CAPTUREPASS_DUMP_DIR`` and
``CAPTUREPASS_VERIFY``; worker processes inherit it.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import os
import threading
from typing import Any

log = logging.getLogger("capturepass")

_lock = threading.Lock()
_piece_ids = itertools.count()
_said = threading.Event()


def inductor_lowers_streams() -> tuple[bool, str]:
    """Whether the installed Inductor lowers user streams itself (``node.meta["custom"]["stream"]``),
    and why not: detected by the functions that lowering consists of, never by version."""
    try:
        from torch._inductor.graph import GraphLowering
        from torch._inductor.scheduler import Scheduler
    except ImportError as e:  # pragma: no cover - torch without Inductor
        return False, f"torch._inductor cannot be imported ({e})"
    missing = [
        name for owner, name in ((GraphLowering, "_get_node_stream"), (Scheduler, "_populate_stream_assignments"))
        if not hasattr(owner, name)
    ]
    if missing:
        return False, f"this torch's Inductor does not lower user streams (it has no {', '.join(missing)})"
    return True, ""


def _say_once(message: str, *args: Any) -> None:
    """Logs, once per process, how the pass route treats the pieces Inductor compiles."""
    if _said.is_set():
        return
    _said.set()
    log.warning(message, *args)


_registered_pass_class = False
_declared_kernels = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``capturepass`` backend.

    Idempotent, and touches no device (vLLM runs it in every process before the
    model is built). In a vLLM process the name ``capturepass`` compiles with
    :func:`backend`, whose result vLLM's AOT compile can save.
    """
    global _registered_pass_class, _declared_kernels
    from torch._dynamo.backends import registry

    with _lock:
        if registry._COMPILER_FNS.get("capturepass") is not backend:
            # The torch_dynamo_backends entry point may have announced the name
            # (or registered the plain backend); the vLLM-aware one replaces it.
            registry._COMPILER_FNS.pop("capturepass", None)
            registry.register_backend(compiler_fn=backend, name="capturepass")
        if not _registered_pass_class:
            _registered_pass_class = _register_inductor_pass()
        if not _declared_kernels:
            from capturepass.backends.vllm import kernels

            kernels.declare()  # vLLM's norms, activations and rotary embeddings may overlap
            _declared_kernels = True


def _register_inductor_pass() -> bool:
    """Makes :class:`PostGradPass` a virtual subclass of vLLM's ``InductorPass``, so that
    vLLM keeps the pass (and its ``uuid``) instead of wrapping it in a pass whose uuid
    hashes only this class's source."""
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
    except Exception:  # vLLM absent, or moved the class: the wrapper still runs the pass
        return False
    InductorPass.register(PostGradPass)
    return True


def backend(gm: Any, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    """The capturepass backend for vLLM (``"capturepass"`` with the plugin, or ``"capturepass.backend"``).

    Compiles like ``torch.compile(backend="capturepass")`` and returns a
    :class:`~capturepass.backends.vllm.compiled.CapturePassFunction`, which vLLM's AOT
    compile serializes (the Dynamo graph and the options) and loads on a warm
    restart (``finalize_loading`` compiles the loaded graph again).
    """
    from capturepass.backends.vllm.compiled import CapturePassFunction

    return CapturePassFunction.compile(gm, example_inputs, options, mode)


def _source_digest(*objs: Any) -> str:
    digest = hashlib.sha256()
    for obj in objs:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()


class PostGradPass:
    """Inductor's ``CustomGraphPass`` protocol (``__call__(graph)``, ``uuid()``) for the pass route.

    Under vLLM's ``inductor_passes`` (``VLLM_COMPILE``) or as
    ``torch._inductor.config.post_grad_custom_post_pass``: on each post-grad graph it runs
    the pipeline through ``emit`` on a copy, with the options from the environment, writes
    the dumps into ``<dump_dir>/post_grad_<pid>_<n>`` when a dump directory is set, and then
    writes the lanes into the graph Inductor compiles (``capturepass.backends.post_grad``):
    one graph in the plan's order, a ``capturepass::lane_step`` call at each sync point, so
    that vLLM's piecewise CUDA graphs and PyTorch's cudagraph trees capture the lanes. A
    graph whose plan has one lane, or needs capturepass's own runtime (retained storage,
    external streams, breaks), or ``regions="lanes"``, is left as it was, with the reason
    logged; on the host (no CUDA tensor) only ``regions="segments"`` writes lanes, which
    run there in program order.
    """

    def __call__(self, graph: Any) -> None:
        import torch
        import torch.fx as fx

        from capturepass.backends import compile as driver
        from capturepass.backends import dynamo, post_grad
        from capturepass.ir import cost, meta
        from capturepass.ir.meta import OwnerId

        post_grad.restore_options()
        root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
        inputs = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        piece = next(_piece_ids)
        opts = driver.resolve(None)
        dump_dir = None if opts.dump_dir is None else os.path.join(
            os.fspath(opts.dump_dir), f"post_grad_{os.getpid()}_{piece:03d}")
        # Nothing measures this route's schedules: the device's calibrated cost model, where
        # the backend route's measured choices made one, prices them.
        device = dynamo.cuda_device(inputs)
        device_model = dynamo.calibrated_model(opts, device)

        def plan(split: frozenset[fx.Node] | None) -> tuple[Any, dict[fx.Node, fx.Node], list[post_grad.BiasSplit]]:
            copy = fx.Graph()
            value_map: dict[fx.Node, fx.Node] = {}
            copy.output(copy.graph_copy(graph, value_map))
            splits = post_grad.split_bias_adds(copy, value_map, split)
            with cost.device_model(device_model):
                compiled = driver.compile_graph(
                    fx.GraphModule(root, copy), inputs, opts, name="post_grad", owner=OwnerId(1_000_000 + piece),
                    dump_dir=dump_dir, regions=False, record=False,
                )
            return compiled, value_map, splits

        compiled, value_map, splits = plan(None)
        # A split the schedule left on one lane only costs a kernel: planned again without it.
        kept = frozenset(s.source for s in splits if post_grad.split_pays(s))
        if len(kept) < len(splits) and len(meta.graph_info(compiled.graph).lanes) > 1:
            log.info("capturepass: post-grad piece %d: %d of %d addmm split off their bias run on the bias's lane; "
                     "planned again with them fused", piece, len(splits) - len(kept), len(splits))
            compiled, value_map, splits = plan(kept)
        gi = meta.graph_info(compiled.graph)
        if device_model is not None:
            log.info("capturepass: post-grad piece %d: %s", piece, device_model.describe())
        applied = post_grad.apply_lanes(graph, value_map, compiled.plan, opts, f"post-grad piece {piece}",
                                        lane_factor=dynamo.lane_factor(opts, device))
        if applied.lanes:
            lowers, why = inductor_lowers_streams()
            _say_once("capturepass: the post-grad pass writes lanes into the pieces Inductor compiles, as "
                      "capturepass::lane_step calls (%s); Inductor's lane-blind options (%s) are off while it "
                      "compiles such a piece",
                      "this torch's Inductor also lowers user streams itself, which the pass does not use yet"
                      if lowers else why, ", ".join(post_grad.lane_blind_options()))
            log.info("capturepass: post-grad piece %d: %d lanes, %d sync points written into the graph%s",
                     piece, applied.lanes, applied.points,
                     f"; {len(splits)} addmm split off a bias from another path "
                     f"({', '.join('%' + s.source.name for s in splits)})" if splits else "")
        else:
            log.info("capturepass: post-grad piece %d: %d lane(s), %d segment(s); the graph is left as it "
                     "was: %s", piece, len(gi.lanes), len(gi.segments), applied.why)
        if dump_dir is not None:
            head = f"lanes written: {applied.lanes}" if applied.lanes else f"left as it was: {applied.why}"
            with open(os.path.join(dump_dir, "post_grad.txt"), "w") as f:
                f.write(f"# {head}\n{graph}")

    @staticmethod
    def passes() -> list[Any]:
        """The ATen-stage passes this pass runs (``ATEN``, through ``emit``)."""
        from capturepass.ir.capabilities import REGISTRY
        from capturepass.passes.pipeline import ATEN, default_pipeline

        return default_pipeline(REGISTRY.key(), passes=ATEN)

    def uuid(self) -> str:
        """A digest of the passes' sources, the capability registry, the options, this class,
        the modules that write the lanes into the graph (and the ops it calls), the cost model
        that chooses the lanes (``ir/cost.py``, which also says what Inductor fuses), and the
        current CUDA device's calibrated cost model and lane factor, which price the schedules
        and decide whether the lanes are written."""
        import torch

        from capturepass.backends import inline, post_grad
        from capturepass.ir import cost
        from capturepass.ir.options import Options
        from capturepass.passes.pipeline import pipeline_uuid
        from capturepass.runtime import inline as ops

        opts = Options.from_mapping(None)
        digest = hashlib.sha256()
        digest.update(pipeline_uuid(self.passes()).encode())
        digest.update(opts.key().encode())
        digest.update(_source_digest(PostGradPass, inline, post_grad, ops, cost).encode())
        if torch.cuda.is_available():
            from capturepass.backends import dynamo

            device = torch.device("cuda", torch.cuda.current_device())
            model = dynamo.calibrated_model(opts, device)
            digest.update((model.describe() if model is not None else "nominal").encode())
            factor = dynamo.lane_factor(opts, device)
            digest.update(f"lane factor {factor if factor is None else round(factor, 4)}".encode())
        return digest.hexdigest()

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's ``InductorPass`` hook: the pass applies to every compile range."""
        return True

    def __repr__(self) -> str:
        return "capturepass.post_grad_pass"


post_grad_pass = PostGradPass()
