"""The pass route's rewrite: a post-grad graph's lanes written into the graph Inductor compiles.

``capturepass.post_grad_pass`` runs inside someone else's Inductor compile (vLLM's
``inductor_passes``, or ``torch._inductor.config.post_grad_custom_post_pass``): it cannot
split the graph into regions or bind a runtime to it. What it can do is what the inline
route does inside one capture segment (``capturepass.backends.inline``): rebuild the graph
in the plan's order with a sync call wherever the plan syncs or changes lane, and let
Inductor compile that. The calls here are ``capturepass::lane_step``, which carry their
records and waits as data and take their streams and events from the running thread's pool
(``capturepass.runtime.inline``): the compiled code runs wherever the compiler's caller puts
it (vLLM's piecewise CUDA graphs, PyTorch's cudagraph trees, a cache that loads it in another
process) with nothing of capturepass's to bind.

A graph is rewritten only when its whole plan is one capture segment that fuses into one
region of more than one lane, with no step that needs capturepass's runtime (a retention of
captured storage, an external stream, a break); otherwise it is left as it was, and
:func:`apply_lanes` says why.

Inductor's buffer reuse, in-place buffers and reordering passes do not know lanes (a buffer
freed by one lane's kernel, handed by the generated code to another lane's, races). A pass
cannot patch Inductor's options around the one compile it runs in: :func:`lane_safe_options`
turns them off from the rewrite until the next graph the pass sees or the end of Dynamo's
compile, which restore them (a compile runs its post-grad passes and its code generation in
one call). The code Inductor then generates is checked as the inline route's is
(``backends/inline_check.py``): a finding fails the compile with a ``VerificationError``, since
nothing can be compiled again from inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_map

from capturepass.backends import inline as inline_segments
from capturepass.backends.candidates import estimated_lane_ratio
from capturepass.errors import VerificationError
from capturepass.ir import meta
from capturepass.ir.options import Options
from capturepass.ir.plan import Plan, RegionPlan, StepKind, SyncPoint
from capturepass.runtime import inline as lane_ops
from capturepass.runtime.calibration import lanes_predicted

_saved_options: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class Applied:
    """What :func:`apply_lanes` did: ``lanes`` written (0 when the graph was left as it was),
    the number of sync ``points``, and ``why`` a graph was left."""

    lanes: int
    points: int
    why: str = ""


def restore_options() -> None:
    """Inductor's options as they were before the last rewrite turned its lane-blind ones off,
    and no check of generated code pending."""
    config = torch._inductor.config
    for key, value in _saved_options.items():
        setattr(config, key, value)
    _saved_options.clear()
    _uncheck()


class _CodeCheck:
    """The lane checks (``backends/inline_check.py``) of the code Inductor generates for the graph
    just rewritten: ``GraphLowering.save_output_code`` is called with it within the same compile.
    A finding is an error: the code would run with a race, and the compile cannot go back."""

    def __init__(self, points: tuple[SyncPoint, ...], title: str) -> None:
        from torch._inductor.graph import GraphLowering

        self.points, self.title = points, title
        self.prev = GraphLowering.save_output_code

    def __call__(self, code: str) -> None:
        from capturepass.backends.inline_check import findings

        if self.prev is not None:
            self.prev(code)
        if "lane_step.default(" not in code:
            return
        _uncheck()
        found = findings([code], self.points, op="lane_step")
        if found:
            raise VerificationError(
                "lane-check", self.title,
                f"capturepass: {self.title}: Inductor's code for the lanes written into it fails the lane "
                f"checks ({found[0]}); compile it with {{\"policy\": \"off\"}} in CAPTUREPASS_OPTIONS, or "
                "through the backend route (backend=\"capturepass\"), which falls back to lane regions")


def _check_code(points: tuple[SyncPoint, ...], title: str) -> None:
    from torch._inductor.graph import GraphLowering

    _uncheck()
    if hasattr(GraphLowering, "save_output_code"):
        GraphLowering.save_output_code = _CodeCheck(points, title)


def _uncheck() -> None:
    from torch._inductor.graph import GraphLowering

    hook = getattr(GraphLowering, "save_output_code", None)
    if isinstance(hook, _CodeCheck):
        GraphLowering.save_output_code = hook.prev


def _restore_at_end(_args: object) -> None:
    restore_options()


def lane_blind_options() -> list[str]:
    """Inductor's options that place work by buffer identity or move nodes, blind to lanes."""
    config = torch._inductor.config
    return [key for key in inline_segments.LANE_BLIND if hasattr(config, key)]


def lane_safe_options() -> None:
    """Turns off Inductor's lane-blind options for the compile running now; they are restored
    by the next graph's pass (:func:`restore_options`) or at the end of Dynamo's compile,
    whichever comes first."""
    config = torch._inductor.config
    handler = getattr(torch._dynamo, "callback_handler", None)
    # Looked for at every rewrite: ``torch._dynamo.reset()`` clears the callbacks.
    if _restore_at_end not in getattr(handler, "end_callbacks", [_restore_at_end]):
        handler.register_end_callback(_restore_at_end)
    for key in lane_blind_options():
        if key not in _saved_options:
            _saved_options[key] = getattr(config, key)
            setattr(config, key, False)


def unguarded_inputs(count: int) -> set[int]:
    """Positions of the graph's inputs that no sync point may declare written: under Inductor's
    own CUDA graphs (``mode="reduce-overhead"``), which skip a graph that mutates an input that
    is not static (a parameter's address is; the cudagraph trees only allow those), every input
    that Inductor does not know as static."""
    config = torch._inductor.config
    if not config.triton.cudagraphs:
        return set()
    if not getattr(config.triton, "cudagraph_trees", False):
        return set(range(count))
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    static = set(getattr(metadata, "static_input_indices", None) or ())
    return {i for i in range(count) if i not in static}


def _steps(point: SyncPoint, slots: dict[Any, int]) -> list[int]:
    """The ``(kind, lane, slot)`` triples of ``point``'s records and waits (an event slot per
    lease, numbered in ``slots``); a step that needs capturepass's runtime raises
    ``KeepRegions``."""
    out: list[int] = []
    for step in point.steps:
        rec = meta.info(step.payload)
        if step.kind in (StepKind.RECORD, StepKind.WAIT):
            kind = lane_ops.RECORD if step.kind == StepKind.RECORD else lane_ops.WAIT
            out += [kind, step.lane.index, slots.setdefault(rec.lease, len(slots))]
        elif step.kind == StepKind.RELEASE:
            continue  # the value is read by the call; the allocator frees it after its last use
        else:
            raise inline_segments.KeepRegions(
                f"its plan has a {step.kind} step (%{step.payload.name}), which needs capturepass's runtime")
    return out


def _standalone(region: RegionPlan) -> None:
    """Makes ``region``'s ``inline_step`` calls ``lane_step`` calls that carry their steps."""
    points = region.inline.points
    slots: dict[Any, int] = {}
    calls = [n for n in region.graph.graph.nodes if n.target is torch.ops.capturepass.inline_step.default]
    graph = region.graph.graph
    for node in calls:
        _key, index, reads, guards = node.args
        point = points[index]
        with graph.inserting_before(node):
            call = graph.call_function(
                torch.ops.capturepass.lane_step.default,
                (index == 0, index == len(points) - 1, _steps(point, slots), point.lane, reads, guards))
        call.meta = dict(node.meta)
        graph.erase_node(node)
    region.graph.recompile()


@dataclasses.dataclass(frozen=True)
class BiasSplit:
    """An ``addmm`` of Inductor's post-grad graph that :func:`split_bias_adds` split: ``source``
    (the ``addmm`` in the graph Inductor compiles), and in the copy the pipeline plans,
    ``mm`` (the product) and ``add`` (its sum with the bias, which stands for ``source``)."""

    source: fx.Node
    mm: fx.Node
    add: fx.Node


def _reaches(start: list[fx.Node], target: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether ``target`` is an ancestor of (or is) one of ``start``: only nodes placed after
    ``target`` can have it as an ancestor, so the walk stops at any node placed before it."""
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if node in seen or order[node] < order[target]:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


def _same_shape(a: Any, b: Any) -> bool:
    """Whether two shapes are known equal without a guard (a post-grad graph's shapes may be
    symbolic: comparing them must not add a guard to a compile that is under way)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def split_bias_adds(graph: fx.Graph, value_map: dict[fx.Node, fx.Node],
                    only: frozenset[fx.Node] | None = None) -> list[BiasSplit]:
    """Splits each ``addmm(bias, a, b)`` of ``graph`` (the copy of a post-grad graph that
    ``value_map`` maps into) whose bias is an activation computed on another path into
    ``mm(a, b)`` and ``add(bias, mm)``.

    Inductor's post-grad patterns fuse ``mm + add`` into ``addmm`` (cuBLAS adds the bias in
    the product's epilogue). That makes the product wait for its bias, so a product that
    could run on one lane while the bias is computed on another (a shared expert's down
    projection beside the routed experts' sum) runs after it, on the critical path. A bias
    the product's operands depend on (a residual stream) gains nothing from the split and is
    left fused, as is a bias that is not the product's full shape (a broadcast vector), a
    graph input, or scaled (``alpha``, ``beta``). The sum is the one eager computed before
    Inductor fused it.

    Args:
        graph: the copy the pipeline will plan (changed in place).
        value_map: the compiled graph's nodes to their copies in ``graph``; an ``addmm`` that
            is split maps to its ``add`` afterwards.
        only: the compiled graph's ``addmm`` nodes that may be split (``None``: any).

    Returns:
        the splits made, in program order.
    """
    addmm = torch.ops.aten.addmm.default
    original = {copy: node for node, copy in value_map.items()}
    order = {node: i for i, node in enumerate(graph.nodes)}
    splits = []
    for node in list(graph.find_nodes(op="call_function", target=addmm)):
        source = original.get(node)
        if source is None or (only is not None and source not in only):
            continue
        bias, a, b = node.args[:3]
        value, bias_value = node.meta.get("val"), getattr(bias, "meta", {}).get("val")
        if (len(node.args) > 3 or node.kwargs or not isinstance(bias, fx.Node) or bias.op != "call_function"
                or value is None or bias_value is None or not _same_shape(bias_value.shape, value.shape)
                or _reaches([a, b], bias, order)):
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(torch.ops.aten.mm.default, (a, b))
            add = graph.call_function(torch.ops.aten.add.Tensor, (bias, mm))
        for copy in (mm, add):
            copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
        # The two stand where the addmm stood: a later addmm's walk may pass through them.
        order[mm] = order[add] = order.pop(node)
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        value_map[source] = add
        _fill_values([mm, add], [n for n in graph.find_nodes(op="placeholder")])
        splits.append(BiasSplit(source, mm, add))
    return splits


def split_pays(split: BiasSplit) -> bool:
    """Whether a planned split can gain anything: its product runs on another lane than its
    bias, beside it (the sum's lane does not matter: a product on the sum's lane runs before
    that lane waits for the bias). On the bias's lane the two run one after the other as
    before, and the split only costs the kernel of the sum cuBLAS would have added in the
    product's epilogue."""
    return meta.lane_of(split.mm) != meta.lane_of(split.add.args[0])


def apply_lanes(graph: fx.Graph, value_map: dict[fx.Node, fx.Node], plan: Plan, opts: Options,
                title: str = "post-grad graph", lane_factor: float | None = None) -> Applied:
    """Rewrites ``graph`` (Inductor's post-grad graph) with the lanes of ``plan``.

    Args:
        graph: the graph Inductor compiles (changed in place when the lanes are written).
        value_map: ``graph``'s nodes to their copies in ``plan.graph``, the copy the pipeline
            annotated.
        plan: what ``emit`` planned for the copy.
        opts: the graph's options (``regions``: ``"lanes"`` is the backend route's, and a host
            graph, whose lanes run in program order, is written only with ``"segments"``).
        title: the graph's name in messages.
        lane_factor: the device's lane factor (``runtime.calibration``; ``None``: nothing
            measured on it): lanes predicted no faster than one lane are not written, since
            nothing measures them here.

    Returns:
        what was done; ``lanes == 0`` with ``why`` when the graph is left as it was.
    """
    if opts.regions == "lanes":
        return Applied(0, 0, 'regions="lanes" asks for lane regions, which only the backend route compiles')
    if not meta.graph_info(plan.graph).on_cuda and opts.regions != "segments":
        return Applied(0, 0, 'a host graph runs its lanes in program order (regions="segments" writes them anyway)')
    lanes = {r.lane for r in plan.regions}
    if len(lanes) < 2:
        return Applied(0, 0, "its plan has one lane")
    ratio = estimated_lane_ratio(plan.graph) if lane_factor is not None else None
    if ratio is not None and lane_factor is not None and (predicted := lanes_predicted(ratio, lane_factor)) >= 1.0:
        return Applied(0, 0, f"its lanes are predicted no faster than one lane on this device (cost model "
                             f"{ratio:.3f} x the device's lane factor {lane_factor:.3f} = {predicted:.3f})")
    placeholders = graph.find_nodes(op="placeholder")
    unguarded = frozenset(value_map[placeholders[i]] for i in unguarded_inputs(len(placeholders)))
    fused = inline_segments.fuse(plan, unguarded)
    if fused.kept:
        return Applied(0, 0, fused.kept[0])
    regions = fused.plan.regions
    if len(fused.plan.steps) != 1 or len(regions) != 1 or regions[0].inline is None:
        kinds = sorted({str(s.kind) for s in fused.plan.steps if s.kind != StepKind.REGION})
        return Applied(0, 0, f"its plan does not fuse into one region of one capture segment "
                             f"({len(regions)} regions{'; steps ' + ', '.join(kinds) if kinds else ''})")
    region = regions[0]
    try:
        _standalone(region)
    except inline_segments.KeepRegions as why:
        return Applied(0, 0, str(why))
    original = {copy: node for node, copy in value_map.items()}
    inputs = []
    for node in region.inputs:
        source = original.get(node)
        if source is None or source.op not in ("placeholder", "get_attr"):
            return Applied(0, 0, f"%{node.name}, an input of the fused graph, is not one of the graph's inputs")
        inputs.append(source)
    provided = set(region.outputs)
    for node in graph.output_node().all_input_nodes:
        if value_map[node] not in provided and node.op not in ("placeholder", "get_attr"):
            return Applied(0, 0, f"%{node.name}, an output of the graph, is not computed by the fused graph")
    _splice(graph, value_map, original, region, inputs)
    lane_safe_options()
    _check_code(region.inline.points, title)
    return Applied(len(lanes), len(region.inline.points))


def _fill_values(nodes: list[fx.Node], inputs: list[fx.Node]) -> None:
    """Gives each node the rewrite made (a size computed again from the inputs that bind its
    symbols) its fake value: Inductor lowers a post-grad graph by its nodes' ``meta["val"]``."""
    fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in inputs])
    context = fake_mode if fake_mode is not None else contextlib.nullcontext()
    for node in nodes:
        if "val" in node.meta or node.op != "call_function":
            continue
        args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
        with context:
            node.meta["val"] = node.target(*args, **kwargs)


def _splice(graph: fx.Graph, value_map: dict[fx.Node, fx.Node], original: dict[fx.Node, fx.Node],
            region: RegionPlan, inputs: list[fx.Node]) -> None:
    """Replaces ``graph``'s computation by ``region``'s graph, which reads ``inputs``."""
    output = graph.output_node()
    body = region.graph.graph
    env: dict[fx.Node, fx.Node] = dict(zip(body.find_nodes(op="placeholder"), inputs))
    results: list[fx.Node] = []
    with graph.inserting_before(output):
        for node in body.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = [env[n] for n in node.args[0]]
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
    provided = dict(zip(region.outputs, results))

    def result(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            return n
        copy = value_map[n]
        if copy in provided:
            return provided[copy]
        return original[copy]  # an input returned as it is

    _fill_values([env[n] for n in body.nodes if n in env], inputs)
    old = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in env.values()]
    output.args = tree_map(result, output.args)
    for node in reversed(old):
        graph.erase_node(node)
