"""The capability registry: declarations in every form, defaults, launch plans, the cache key.

Every op these tests define lives in the test-private ``cptest_caps`` namespace,
and every declaration is made through the ``declared`` fixture, which forgets it
afterwards and checks that the global registry's key is back where it started.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.fx as fx

import capturepass
from capturepass.ir.capabilities import REGISTRY, CallInfo, CapabilityRegistry, op_qualname
from capturepass.errors import CapabilityError
from capturepass.ir import meta, printer
from capturepass.ir.meta import Capability
from tests.helpers import aten_graph

NS = "cptest_caps"
_fresh_names = itertools.count()


def _fresh(stem: str) -> str:
    """A new op name: custom ops cannot be defined twice in one process."""
    return f"{NS}::{stem}_{next(_fresh_names)}"


@torch.library.custom_op(f"{NS}::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    """A plain custom op the tests declare in every accepted form."""
    return x * 2


@scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::plan", mutates_args=())
def plan(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose capability comes from a launch-plan callable."""
    return x + 1


@plan.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::undeclared", mutates_args=())
def undeclared(x: torch.Tensor) -> torch.Tensor:
    """A custom op nobody declares."""
    return x - 1


@undeclared.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::unsafe", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def unsafe(x: torch.Tensor) -> torch.Tensor:
    """A custom op tagged as unsafe to capture."""
    return x.clone()


@unsafe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def declared():
    """Collects ops the test declares on the global registry and forgets them afterwards."""
    before = REGISTRY.key()
    ops: list = []
    yield ops
    for op in ops:
        REGISTRY.unregister(op)
    assert REGISTRY.key() == before, "a test left a capability declared on the global registry"


def _calls(gm: fx.GraphModule, qualname: str) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target._schema.name == qualname
    ]


def _only_call(gm: fx.GraphModule, qualname: str) -> fx.Node:
    nodes = _calls(gm, qualname)
    assert len(nodes) == 1, f"expected one call of {qualname}, found {len(nodes)}"
    return nodes[0]


def _scale_node() -> fx.Node:
    gm = aten_graph(lambda x: torch.ops.cptest_caps.scale(x).relu(), torch.randn(4, 8))
    return _only_call(gm, f"{NS}::scale")


# -- declaration forms ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(lambda: f"{NS}::scale", id="string"),
        pytest.param(lambda: f"{NS}::scale.default", id="string-with-overload"),
        pytest.param(lambda: torch.ops.cptest_caps.scale.default, id="overload"),
        pytest.param(lambda: torch.ops.cptest_caps.scale, id="packet"),
        pytest.param(lambda: scale, id="custom-op-object"),
    ],
)
def test_register_forms_all_name_the_same_op(declared, form):
    op = form()
    assert op_qualname(op) == f"{NS}::scale"
    node = _scale_node()
    # Undeclared, a custom op is serialized by default; a declaration makes it safe.
    assert REGISTRY.query(node).source == "default"
    capturepass.register_capability(op, overlap="safe", resources=("workspace",))
    declared.append(op)
    cap = REGISTRY.query(node)
    assert cap == Capability(
        capturable=True,
        overlap="safe",
        reason="declared overlap=safe",
        resources=("workspace",),
        source="registry",
    )


def test_unregister_by_another_form(declared):
    node = _scale_node()
    capturepass.register_capability(f"{NS}::scale", capturable=False, overlap="serialize")
    cap = REGISTRY.query(node)
    assert (cap.capturable, cap.overlap, cap.source) == (False, "serialize", "registry")
    assert "not capturable" in cap.reason
    REGISTRY.unregister(scale)  # the custom-op object names the op declared by string
    assert REGISTRY.query(node).source == "default"


def test_redeclaring_replaces_the_answer(declared):
    node = _scale_node()
    capturepass.register_capability(torch.ops.cptest_caps.scale, overlap="serialize")
    declared.append(scale)
    assert REGISTRY.query(node).overlap == "serialize"
    capturepass.register_capability(torch.ops.cptest_caps.scale.default, overlap="safe")
    assert REGISTRY.query(node).overlap == "safe"


def test_decorator_next_to_custom_op(declared):
    name = _fresh("decorated")

    @capturepass.capability(overlap="serialize", resources=("scratch",))
    @torch.library.custom_op(name, mutates_args=())
    def decorated(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    declared.append(name)

    @decorated.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    # The decorator hands back the custom op itself: it still runs and traces.
    x = torch.randn(2, 3)
    torch.testing.assert_close(decorated(x), x * 3)
    op = getattr(getattr(torch.ops, NS), name.split("::")[1])
    gm = aten_graph(lambda x: op(x), x)
    cap = REGISTRY.query(_only_call(gm, name))
    assert (cap.overlap, cap.resources, cap.source) == ("serialize", ("scratch",), "registry")


# -- invalid declarations ------------------------------------------------------------------------


def test_invalid_overlap_lists_the_choices():
    with pytest.raises(CapabilityError, match=r"'safe', 'join', 'serialize'.*got 'sometimes'") as info:
        capturepass.register_capability(f"{NS}::scale", overlap="sometimes")
    assert f"{NS}::scale" in str(info.value)
    assert REGISTRY.query(_scale_node()).source == "default"  # nothing was declared


def test_invalid_capturable_is_refused():
    with pytest.raises(CapabilityError, match=r"capturable must be a bool, got 'yes'"):
        capturepass.register_capability(f"{NS}::scale", capturable="yes")


@pytest.mark.parametrize(
    "op, pattern",
    [
        ("scale", r"must be qualified as 'namespace::name'"),
        (42, r"pass an op name 'ns::name', a torch.ops overload or packet, or a torch.library.custom_op"),
        (torch.sin, r"pass an op name 'ns::name'"),
    ],
)
def test_invalid_op_is_refused(op, pattern):
    with pytest.raises(CapabilityError, match=pattern):
        capturepass.register_capability(op)


# -- defaults ------------------------------------------------------------------------------------


def test_undeclared_custom_op_is_serialized_and_logged_once(caplog):
    registry = CapabilityRegistry()  # its own "already warned" set
    gm = aten_graph(lambda x: torch.ops.cptest_caps.undeclared(x) * 2, torch.randn(4))
    node = _only_call(gm, f"{NS}::undeclared")
    caplog.set_level(logging.INFO, logger="capturepass")
    first = registry.query(node)
    assert (first.capturable, first.overlap, first.source) == (True, "serialize", "default")
    assert f"{NS}::undeclared" in first.reason
    lines = [r.getMessage() for r in caplog.records if r.name == "capturepass"]
    assert len(lines) == 1, lines
    assert f"{NS}::undeclared" in lines[0]
    assert "\n" not in lines[0]
    caplog.clear()
    assert registry.query(node) == first
    assert [r for r in caplog.records if r.name == "capturepass"] == []


def test_aten_ops_are_overlap_safe_without_a_log_line(caplog):
    registry = CapabilityRegistry()
    gm = aten_graph(lambda x, w: torch.mm(x, w).relu(), torch.randn(4, 4), torch.randn(4, 4))
    caplog.set_level(logging.INFO, logger="capturepass")
    for node in gm.graph.nodes:
        if node.op == "call_function":
            cap = registry.query(node)
            assert (cap.capturable, cap.overlap, cap.source) == (True, "safe", "default"), node.name
    assert [r for r in caplog.records if r.name == "capturepass"] == []


def test_cudagraph_unsafe_tag_is_not_capturable():
    gm = aten_graph(lambda x: torch.ops.cptest_caps.unsafe(x) + 1, torch.randn(4))
    cap = REGISTRY.query(_only_call(gm, f"{NS}::unsafe"))
    assert cap.capturable is False
    assert "cudagraph_unsafe" in cap.reason


def test_item_is_not_capturable():
    gm = aten_graph(lambda x: x * x.sum().item(), torch.randn(4))
    cap = REGISTRY.query(_only_call(gm, "aten::_local_scalar_dense"))
    assert cap.capturable is False
    assert cap.reason.startswith("host sync")


def test_nonzero_is_not_capturable():
    gm = aten_graph(lambda x: torch.nonzero(x), torch.randn(4, 4), tracing_mode="symbolic")
    cap = REGISTRY.query(_only_call(gm, "aten::nonzero"))
    assert cap.capturable is False
    assert "depends on data" in cap.reason


def test_integer_index_is_capturable():
    """aten.index.Tensor carries the dynamic_output_shape tag (for boolean masks); with an
    integer index the output size is known, so it must stay capturable."""
    gm = aten_graph(lambda x, i: x[i], torch.randn(4, 4), torch.tensor([0, 2]))
    cap = REGISTRY.query(_only_call(gm, "aten::index"))
    assert (cap.capturable, cap.overlap) == (True, "safe")


def test_boolean_mask_index_is_not_capturable():
    gm = aten_graph(lambda x, m: x[m], torch.randn(4, 4), torch.tensor([True, False, True, True]),
                    tracing_mode="symbolic")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not REGISTRY.query(n).capturable]
    assert nodes, "a boolean-mask index has a data-dependent size and must not be capturable"


# -- launch plans ----------------------------------------------------------------------------------


def _plan_graph(tracing_mode: str = "fake") -> fx.GraphModule:
    def fn(a, b, c):
        return torch.ops.cptest_caps.plan(a), torch.ops.cptest_caps.plan(b), torch.ops.cptest_caps.plan(c)

    return aten_graph(fn, torch.randn(4, 8), torch.randn(4, 8), torch.randn(2, 8), tracing_mode=tracing_mode)


def test_launch_plan_called_once_per_shape_and_cached(declared):
    seen: list[CallInfo] = []

    def launch_plan(call: CallInfo) -> dict:
        seen.append(call)
        big = call.shapes[0][0] >= 4
        return {"overlap": "serialize" if big else "safe", "reason": f"rows={call.shapes[0][0]}"}

    capturepass.register_capability(plan, overlap=launch_plan)
    declared.append(plan)
    nodes = _calls(_plan_graph(), f"{NS}::plan")
    assert len(nodes) == 3
    caps = [REGISTRY.query(n) for n in nodes]
    assert [c.overlap for c in caps] == ["serialize", "serialize", "safe"]
    assert [c.reason for c in caps] == ["rows=4", "rows=4", "rows=2"]
    assert {c.source for c in caps} == {"launch-plan"}
    assert [c.shapes for c in seen] == [((4, 8),), ((2, 8),)]
    assert {c.op for c in seen} == {f"{NS}::plan"}
    assert {c.dtypes for c in seen} == {(torch.float32,)}
    assert {str(c.device) for c in seen} == {"cpu"}
    assert {c.sm_count for c in seen} == {None}
    # Asked again: answered from the cache.
    assert [REGISTRY.query(n) for n in nodes] == caps
    assert len(seen) == 2
    # Re-declaring drops the cache.
    capturepass.register_capability(plan, overlap=launch_plan)
    REGISTRY.query(nodes[0])
    assert len(seen) == 3


def test_launch_plan_sees_shape_hints_when_dynamic_and_is_serialized(declared):
    """A plan asked at traced sizes cannot vouch for other sizes of a dynamic shape."""
    seen: list[CallInfo] = []

    def launch_plan(call: CallInfo) -> Capability:
        seen.append(call)
        return Capability(overlap="safe")

    capturepass.register_capability(plan, overlap=launch_plan)
    declared.append(plan)
    nodes = _calls(_plan_graph("symbolic"), f"{NS}::plan")
    caps = [REGISTRY.query(n) for n in nodes]
    assert {c.overlap for c in caps} == {"serialize"}
    assert all("the shape is dynamic" in c.reason for c in caps)
    assert sorted({c.shapes for c in seen}) == [((2, 8),), ((4, 8),)]
    assert all(call.dynamic for call in seen)
    for call in seen:
        assert all(type(d) is int for shape in call.shapes for d in shape)


def test_launch_plan_that_raises_names_op_and_node(declared):
    def launch_plan(call: CallInfo) -> dict:
        raise ValueError("no plan for this shape")

    capturepass.register_capability(plan, overlap=launch_plan)
    declared.append(plan)
    node = _calls(_plan_graph(), f"{NS}::plan")[0]
    with pytest.raises(CapabilityError) as info:
        REGISTRY.query(node)
    msg = str(info.value)
    assert f"{NS}::plan" in msg
    assert f"%{node.name}" in msg
    assert "ValueError: no plan for this shape" in msg
    assert "(4, 8)" in msg


@pytest.mark.parametrize(
    "answer, pattern",
    [
        ({"overlap": "whenever"}, r"answered overlap='whenever'"),
        ({"overlap": "safe", "colour": "red"}, r"unknown field\(s\) \['colour'\]; valid fields are"),
        ("safe", r"must return a Capability or a mapping"),
    ],
)
def test_launch_plan_with_invalid_answer(declared, answer, pattern):
    capturepass.register_capability(plan, overlap=lambda call: answer)
    declared.append(plan)
    node = _calls(_plan_graph(), f"{NS}::plan")[0]
    with pytest.raises(CapabilityError, match=pattern):
        REGISTRY.query(node)


def test_launch_plan_mapping_inherits_declared_fields(declared):
    capturepass.register_capability(
        plan, capturable=False, overlap=lambda call: {"overlap": "safe"}, resources=("ws",)
    )
    declared.append(plan)
    cap = REGISTRY.query(_calls(_plan_graph(), f"{NS}::plan")[0])
    assert (cap.capturable, cap.overlap, cap.resources, cap.source) == (False, "safe", ("ws",), "launch-plan")



@torch.library.custom_op(f"{NS}::moe", mutates_args=())
def moe(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, quant: str, topk: int) -> torch.Tensor:
    """A MoE-like op whose launch depends on non-tensor arguments."""
    return x.clone()


@moe.register_fake
def _(x, w, b, quant, topk):
    return torch.empty_like(x)


def test_launch_plan_is_asked_again_when_any_argument_differs(declared):
    """Regression: the plan cache was keyed by (op, shapes, dtypes, device, SMs) only, so a
    ``quant="w4a16"`` call got the answer of an earlier ``quant="nvfp4"`` call."""
    seen: list[CallInfo] = []

    def launch_plan(call: CallInfo) -> dict:
        seen.append(call)
        mode = call.arg("quant")
        return {"overlap": "safe" if mode == "nvfp4" else "serialize", "reason": mode}

    capturepass.register_capability(moe, overlap=launch_plan)
    declared.append(moe)
    m = torch.ops.cptest_caps.moe

    def fn(x, xt, t):
        return (
            m(x, t, None, "nvfp4", 2),
            m(x, t, None, "w4a16", 2),
            m(x, t, None, "nvfp4", 4),      # another non-tensor value
            m(x, None, t, "nvfp4", 2),      # the tensor in another position: the same shapes
            m(xt, t, None, "nvfp4", 2),     # the same shape, other strides
            m(x, t, None, "nvfp4", 2),      # the first call again: from the cache
        )

    x = torch.randn(8, 8)
    gm = aten_graph(fn, x, x.t(), torch.randn(8))
    caps = [REGISTRY.query(n) for n in _calls(gm, f"{NS}::moe")]
    assert [c.reason for c in caps] == ["nvfp4", "w4a16", "nvfp4", "nvfp4", "nvfp4", "nvfp4"]
    assert [c.overlap for c in caps] == ["safe", "serialize", "safe", "safe", "safe", "safe"]
    assert len(seen) == 5
    assert [c.arg("topk") for c in seen] == [2, 2, 4, 2, 2]
    assert seen[3].shapes == seen[0].shapes and seen[3].args[1] is None
    assert seen[4].shapes == seen[0].shapes and seen[4].args[0].stride() == (1, 8)


def test_call_key_never_fails_on_odd_arguments():
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __repr__(self) -> str:
            return "Unhashable()"

    class BadRepr:
        __hash__ = None  # type: ignore[assignment]

        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    def call(*args) -> CallInfo:
        return CallInfo(op=f"{NS}::x", shapes=(), dtypes=(), device=None, sm_count=None, args=args)

    keys = [call(Unhashable()).key(), call([Unhashable()]).key(), call({"a": [1]}).key(), call(BadRepr()).key(),
            call(float("nan")).key(), call(1).key(), call(1.0).key(), call(True).key(), call(-0.0).key(), call(0.0).key()]
    assert all(isinstance(hash(k), int) for k in keys)
    assert call(Unhashable()).key() == keys[0] and call(float("nan")).key() == keys[4]
    assert len({keys[i] for i in (5, 6, 7)}) == 3  # 1, 1.0 and True are different arguments
    assert keys[8] != keys[9]


# -- the cache key ---------------------------------------------------------------------------------


def test_key_changes_when_a_declaration_changes(declared):
    k0 = REGISTRY.key()
    declared.append(scale)
    capturepass.register_capability(scale, overlap="safe")
    k1 = REGISTRY.key()
    capturepass.register_capability(scale, overlap="serialize")
    k2 = REGISTRY.key()
    capturepass.register_capability(scale, overlap="serialize", capturable=False)
    k3 = REGISTRY.key()
    capturepass.register_capability(scale, overlap="serialize", capturable=False, resources=("ws",))
    k4 = REGISTRY.key()
    assert len({k0, k1, k2, k3, k4}) == 5
    capturepass.register_capability(scale, overlap="serialize", capturable=False, resources=("ws",))
    assert REGISTRY.key() == k4  # the same declaration again: the same key
    REGISTRY.unregister(scale)
    assert REGISTRY.key() == k0


def test_key_changes_with_the_launch_plan_source(declared):
    def plan_a(call: CallInfo) -> dict:
        return {"overlap": "safe"}

    def plan_b(call: CallInfo) -> dict:
        return {"overlap": "serialize"}

    declared.append(plan)
    capturepass.register_capability(plan, overlap=plan_a)
    ka = REGISTRY.key()
    capturepass.register_capability(plan, overlap=plan_b)
    assert REGISTRY.key() != ka
    capturepass.register_capability(plan, overlap=plan_a)
    assert REGISTRY.key() == ka


def test_key_is_order_independent():
    r1, r2 = CapabilityRegistry(), CapabilityRegistry()
    r1.register(f"{NS}::a", overlap="safe")
    r1.register(f"{NS}::b", overlap="serialize")
    r2.register(f"{NS}::b", overlap="serialize")
    r2.register(f"{NS}::a", overlap="safe")
    assert r1.key() == r2.key()
    assert r1.key() != CapabilityRegistry().key()


# -- higher-order ops and wrappers ----------------------------------------------------------------


@torch.library.custom_op(f"{NS}::scale_into", mutates_args=("buf",))
def scale_into(x: torch.Tensor, buf: torch.Tensor, variant: str) -> torch.Tensor:
    """A custom op that mutates an argument: functionalization wraps it in auto_functionalized."""
    buf.mul_(2).add_(x)
    return x * 3 if variant == "fast" else x * 4


@scale_into.register_fake
def _(x: torch.Tensor, buf: torch.Tensor, variant: str) -> torch.Tensor:
    return torch.empty_like(x)


def _mutating_fn(x, buf, wg, wd):
    z = torch.ops.cptest_caps.scale_into(torch.mm(x, wd), buf, "fast")
    with capturepass.lane("shared"):
        shared = torch.mm(torch.mm(x, wg).relu(), wd)
    after = torch.mm(x, wg).sin()
    return shared + z + after


def _mutating_args(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=g) for _ in range(4)]


def _compile_mutating(**options):
    """Compiles ``_mutating_fn``, checks outputs and the mutated buffer against eager; the graph."""
    from tests.backends.e2e_util import new_compiles

    args = _mutating_args()
    expected_args = [a.clone() for a in args]
    compiled = torch.compile(_mutating_fn, backend="capturepass", options={"policy": "hints", **options})
    with new_compiles() as records:
        got = compiled(*args)
    torch.testing.assert_close(got, _mutating_fn(*expected_args))
    torch.testing.assert_close(args[1], expected_args[1])  # the buffer the op mutated
    (record,) = records
    return record.graph


def _wrapper_node(gm: fx.GraphModule) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if str(n.target).startswith("auto_functionalized")]
    return node


def _waits_after(gm: fx.GraphModule, node: fx.Node, lane: str) -> list[fx.Node]:
    """The waits of ``lane`` between ``node`` and that lane's next compute node."""
    from capturepass.ir.meta import Effect

    gi = meta.graph_info(gm)
    order = list(gm.graph.nodes)
    out = []
    for n in order[order.index(node) + 1:]:
        if gi.lane_name(meta.lane_of(n)) != lane:
            continue
        if meta.effect_of(n) is Effect.COMPUTE:
            break
        if meta.effect_of(n) is Effect.WAIT:
            out.append(n)
    return out


def test_mutating_custom_op_uses_its_declared_capability(declared):
    """Regression: ``auto_functionalized_v2`` answered 'no kernel' (safe) whatever the wrapped
    op declared, so a serialized op could run beside the shared lane."""
    capturepass.register_capability(scale_into, overlap="serialize")
    declared.append(scale_into)
    gm = _compile_mutating()
    node = _wrapper_node(gm)
    cap = meta.info(node).capability
    assert (cap.overlap, cap.source, cap.reason) == ("serialize", "registry", "declared overlap=serialize")
    assert meta.graph_info(gm).lane_name(meta.lane_of(node)) == "main"
    assert "overlap=serialize" in printer.dump(gm).split(f"%{node.name} ", 1)[1].splitlines()[0]
    # The barrier: the shared lane waits for the op before it runs anything after it.
    assert _waits_after(gm, node, "shared")
    assert any(d.startswith(f"%{node.name}: declared overlap=serialize: serialized") for d in meta.graph_info(gm).decisions)


def test_undeclared_mutating_custom_op_is_serialized():
    gm = _compile_mutating()
    cap = meta.info(_wrapper_node(gm)).capability
    assert (cap.overlap, cap.reason) == ("serialize", f"undeclared custom op {NS}::scale_into")


def test_mutating_custom_op_declared_not_capturable_is_a_break(declared):
    capturepass.register_capability(scale_into, capturable=False)
    declared.append(scale_into)
    gm = _compile_mutating(cudagraphs="breakable")
    node = _wrapper_node(gm)
    assert not meta.info(node).capability.capturable
    assert meta.info(node).brk == "declared overlap=safe, not capturable"


def test_launch_plan_of_a_mutating_op_sees_the_wrapped_call(declared):
    seen: list[CallInfo] = []

    def launch_plan(call: CallInfo) -> dict:
        seen.append(call)
        return {"overlap": "safe", "reason": "small"}

    capturepass.register_capability(scale_into, overlap=launch_plan)
    declared.append(scale_into)
    from tests.backends.e2e_util import new_compiles

    def fn(x, buf):
        return torch.ops.cptest_caps.scale_into(x, buf[1], "fast") + 1

    x, buf = torch.randn(4, 8), torch.randn(2, 4, 8)
    expected_buf = buf.clone()
    with new_compiles() as records:
        got = torch.compile(fn, backend="capturepass")(x, buf)
    torch.testing.assert_close(got, fn(x, expected_buf))
    torch.testing.assert_close(buf, expected_buf)
    cap = meta.info(_wrapper_node(records[0].graph)).capability
    assert cap.reason == "small" and cap.source == "launch-plan"
    (call,) = seen
    assert call.op == f"{NS}::scale_into"
    assert call.arg_names == ("x", "buf", "variant")
    assert call.shapes == ((4, 8), (4, 8))  # buf is the view buf[1], as the op receives it
    assert call.arg("variant") == "fast" and call.args[2] == "fast"
    assert call.arg("buf").stride() == (8, 1) and call.arg("buf").storage_offset() == 32


def test_cond_reads_its_predicate_on_the_host():
    def fn(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    gm = aten_graph(fn, torch.randn(4, 4))
    (node,) = [n for n in gm.graph.nodes if str(n.target) == "cond"]
    cap = REGISTRY.query(node)
    assert (cap.capturable, cap.overlap) == (False, "safe")
    assert cap.reason == "host sync: cond reads its tensor predicate on the host"


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_cond_in_a_captured_graph_is_a_break(inner):
    """A captured graph cannot hold cond's device-to-host read: cond runs eagerly between segments."""
    from tests.backends.e2e_util import new_compiles

    def fn(x, y):
        return torch.cond(x.sum() > 0, lambda x: x.sin() + 1, lambda x: x.cos() - 1, (x,)) * y

    compiled = torch.compile(fn, backend="capturepass", options={"inner": inner, "cudagraphs": "monolithic"})
    x, y = torch.randn(4, 4).abs() + 0.1, torch.randn(4, 4)
    with new_compiles() as records:
        for sign in (1, -1):  # both branches
            torch.testing.assert_close(compiled(sign * x, y), fn(sign * x, y))
    (record,) = records
    gi = meta.graph_info(record.graph)
    assert gi.cudagraphs == "breakable"
    assert [(b.node, b.reason) for b in gi.breaks] == [("cond", "host sync: cond reads its tensor predicate on the host")]


def test_higher_order_op_answers_for_its_subgraphs(declared):
    """``invoke_subgraph`` (``nested_compile_region``) may do what the ops inside it may do."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        pytest.skip("this torch has no torch.compiler.nested_compile_region")
    from tests.backends.e2e_util import new_compiles

    capturepass.register_capability(scale, overlap="serialize", resources=("ws",))
    declared.append(scale)

    @region
    def block(x, w):
        return torch.ops.cptest_caps.scale(x @ w).relu()

    def fn(x, w, wg):
        y = block(x, w)
        with capturepass.lane("shared"):
            s = torch.mm(torch.mm(x, wg).relu(), wg)
        return block(y, w) + s + torch.mm(x, wg).sin()

    args = [torch.randn(8, 8) for _ in range(3)]
    compiled = torch.compile(fn, backend="capturepass", options={"policy": "hints"})
    with new_compiles() as records:
        torch.testing.assert_close(compiled(*args), fn(*args))
    (record,) = records
    gm = record.graph
    calls = [n for n in gm.graph.nodes if str(n.target) == "invoke_subgraph"]
    assert len(calls) == 2
    for node in calls:
        cap = meta.info(node).capability
        assert (cap.capturable, cap.overlap, cap.resources) == (True, "serialize", ("ws",))
        assert cap.reason.startswith("invoke_subgraph subgraph: %") and cap.reason.endswith("declared overlap=serialize")
        assert meta.graph_info(gm).lane_name(meta.lane_of(node)) == "main"


@torch.library.custom_op(f"{NS}::effectful", mutates_args=())
def effectful(x: torch.Tensor, tag: str) -> torch.Tensor:
    """A custom op with an ordered effect: AOT autograd wraps it in with_effects."""
    return x * 2


@effectful.register_fake
def _(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


def test_with_effects_answers_for_the_wrapped_op(declared):
    if not hasattr(effectful, "register_effect"):
        pytest.skip("this torch cannot declare an effect on a custom op")
    from torch._library.effects import EffectType

    from tests.backends.e2e_util import new_compiles

    effectful.register_effect(EffectType.ORDERED)
    seen: list[CallInfo] = []

    def launch_plan(call: CallInfo) -> dict:
        seen.append(call)
        return {"overlap": "serialize", "reason": f"tag={call.arg('tag')}"}

    capturepass.register_capability(effectful, overlap=launch_plan)
    declared.append(effectful)

    def fn(x):
        return torch.ops.cptest_caps.effectful(x.sin(), "a").cos()

    x = torch.randn(4, 8)
    with new_compiles() as records:
        torch.testing.assert_close(torch.compile(fn, backend="capturepass", options={"inner": "eager"})(x), fn(x))
    (node,) = [n for n in records[0].graph.graph.nodes if str(n.target) == "with_effects"]
    cap = meta.info(node).capability
    assert (cap.overlap, cap.reason, cap.source) == ("serialize", "tag=a", "launch-plan")
    (call,) = seen
    assert (call.op, call.shapes, call.arg_names) == (f"{NS}::effectful", ((4, 8),), ("x", "tag"))


# -- host syncs and copies found before capture; ops learned after a failed capture -------------------


@torch.library.custom_op(f"{NS}::ragged", mutates_args=())
def ragged(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose output size depends on its input's values."""
    return x[x > 0]


@ragged.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(n)


@torch.library.custom_op(f"{NS}::host_mutate", mutates_args=("x",))
def host_mutate(x: torch.Tensor) -> None:
    """A custom op that mutates its argument (it reaches the graph functionalized)."""
    x.add_(1)


@host_mutate.register_fake
def _(x: torch.Tensor) -> None:
    return None


def test_an_op_that_binds_a_data_dependent_size_is_not_capturable():
    gm = aten_graph(lambda x: torch.ops.cptest_caps.ragged(x) * 2, torch.randn(8), tracing_mode="symbolic")
    cap = REGISTRY.query(_only_call(gm, f"{NS}::ragged"))
    assert (cap.capturable, cap.reason) == (False, f"host sync: an output size of {NS}::ragged depends on data")


def _one_op_graph(op, arg_device: str, out_device: str, **kwargs) -> fx.Node:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        val_in = torch.empty(4, 4, device=arg_device)
        val_out = torch.empty(4, 4, device=out_device)
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = val_in
    node = graph.call_function(op, (x,), kwargs)
    node.meta["val"] = val_out
    graph.output(node)
    return node


@pytest.mark.parametrize(
    ("arg_device", "out_device", "what"),
    [("cuda", "cpu", "device-to-host"), ("cpu", "cuda", None)],
)
def test_copies_between_host_and_device_are_not_capturable(arg_device, out_device, what):
    node = _one_op_graph(torch.ops.aten._to_copy.default, arg_device, out_device, device=torch.device(out_device))
    cap = REGISTRY.query(node, torch.device("cuda", 0))
    assert cap.capturable is False
    if what is None:  # a host tensor read by a device graph: the first-input rule names it
        assert cap.reason == "CPU op aten::_to_copy in a CUDA graph"
    else:
        assert cap.reason == (f"{what} copy by aten::_to_copy: pageable host memory cannot be copied inside a "
                              "CUDA graph capture")
    same = _one_op_graph(torch.ops.aten._to_copy.default, "cuda", "cuda", dtype=torch.float16)
    assert REGISTRY.query(same, torch.device("cuda", 0)).capturable is True


def test_a_functionalized_custom_op_is_answered_as_the_op_it_wraps(declared):
    from capturepass.backends.compile import last_compiled
    from capturepass.ir import meta

    declared.append(host_mutate)
    capturepass.register_capability(host_mutate, capturable=False)

    def fn(x):
        torch.ops.cptest_caps.host_mutate(x)
        return x * 2

    compiled = torch.compile(fn, backend="capturepass", options={"inner": "eager", "cudagraphs": "breakable"})
    x = torch.randn(4)
    want = x + 1
    torch.testing.assert_close(compiled(x), want * 2)
    torch.testing.assert_close(x, want)
    graph = [g for g in last_compiled() if g.name == "inference"][-1].graph
    (wrapper,) = [n for n in graph.graph.nodes if "auto_functionalized" in str(n.target)]
    cap = meta.info(wrapper).capability
    assert (cap.capturable, cap.source) == (False, "registry")
    assert [b.node for b in meta.graph_info(graph).breaks] == [wrapper.name]


def test_learned_ops_are_not_capturable_and_change_the_key(declared):
    before = REGISTRY.key()
    node = _scale_node()
    assert REGISTRY.query(node).capturable is True
    try:
        assert REGISTRY.learn(scale, f"{NS}::scale failed under CUDA graph capture (RuntimeError: sync)") is True
        assert REGISTRY.learn(f"{NS}::scale", "again") is False
        cap = REGISTRY.query(node)
        assert (cap.capturable, cap.reason, cap.source) == (False, "again", "capture")
        assert REGISTRY.learned() == {f"{NS}::scale": "again"}
        assert REGISTRY.key() != before
    finally:
        REGISTRY.forget_learned(scale)
    assert REGISTRY.key() == before and REGISTRY.query(node).capturable is True
