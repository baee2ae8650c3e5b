"""Functional collectives through the passes: the comm lane, the schedule, waits, frees and regions.

The graphs call ``torch.ops._c10d_functional`` directly, as AOT autograd leaves them after
Dynamo traced ``dist.all_reduce`` or the functional collectives: tracing needs no process
group (the ops have fake kernels); running them does (tests/runtime/test_collectives_cpu.py,
tests/runtime/test_collectives_gloo.py).
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import capturepass
from capturepass.errors import VerificationError
from capturepass.ir import analysis, collectives, effects, meta
from capturepass.ir.capabilities import REGISTRY
from capturepass.ir.meta import Effect
from capturepass.ir.verify import verify
from capturepass.runtime.program import describe as describe_program
from capturepass.backends.compile import compile_graph
from tests.helpers import aten_graph, dump, nodes_named, run_passes
from tests.passes.cases import before_after, case_before_after

L = capturepass.lane
ops = torch.ops._c10d_functional


def _args(n: int = 4) -> list[torch.Tensor]:
    return [torch.randn(4, 4) for _ in range(n)]


def _order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE]


def test_the_collective_runs_on_the_comm_lane_and_its_wait_after_the_independent_work():
    gm, before, after, ctx = case_before_after("collective", "assign_streams")
    # As traced: the wait right after the collective, the independent branch after both.
    assert _order(gm) == ["mm", "all_reduce", "mm_1", "relu", "mm_2", "wait_tensor", "add"]
    assert before.index("%wait_tensor") < before.index("%mm_1")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=comm s2=aux0; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %w3_1 : f32[4,4] = input  {lane=s0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s0}
  %all_reduce : f32[4,4] = _c10d_functional.all_reduce.default(%mm, 'sum', '0')  {lane=s1}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s2}
  %relu : f32[4,4] = aten.relu.default(%mm_1)  {lane=s2}
  %mm_2 : f32[4,4] = aten.mm.default(%relu, %w3_1)  {lane=s2}
  %wait_tensor : f32[4,4] = _c10d_functional.wait_tensor.default(%all_reduce)  {lane=s1}
  %add : f32[4,4] = aten.add.Tensor(%wait_tensor, %mm_2)  {lane=s0}
  return %add  {lane=s0}
# decision: %all_reduce: collective on group '0' on lane comm; 3 kernel(s) issued before %wait_tensor
""")
    assert ctx.counters["assign_streams"] == {"lanes": 3, "aux_nodes": 5, "collectives": 1, "breaks": 0}


def test_the_wait_is_the_dependency_of_every_reader():
    gm, _, after, _ = case_before_after("collective", "insert_syncs")
    waits = [line.strip() for line in after.splitlines() if "capturepass.wait" in line]
    assert_expected_inline("\n".join(waits), """\
%wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e1, role=fork, by=insert_syncs, why=%mm->%all_reduce}
%wait_default_1 : () = capturepass.wait(1, 2)  {lane=s2, wait=e0, role=fork, by=insert_syncs, why=fork k0}
%wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, by=insert_syncs, why=%mm_2->%add}
%wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=%wait_tensor->%add}""")
    # %mm feeds the collective from s0: it is freed on s0 only once s0 knows the wait is done.
    (release,) = nodes_named(gm, "release")
    assert meta.info(release).why == "read by %all_reduce,%wait_tensor"
    order = list(gm.graph.nodes)
    assert order.index(release) > order.index(nodes_named(gm, "wait_default_3")[0])


def test_max_aux_lanes_bounds_the_compute_lanes_not_the_comm_lane():
    gm = aten_graph(*_traced("collective_only"))
    _, after, _ = before_after(gm, "assign_streams", policy="auto", max_aux_lanes=0)
    assert after.splitlines()[0] == "# graph inference: lanes s0=main s1=comm; cudagraphs=none"
    lanes = {n.name: meta.lane_of(n).index for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE}
    assert lanes == {"mm": 0, "all_reduce": 1, "mm_1": 0, "relu": 0, "mm_2": 0, "wait_tensor": 1, "add": 0}
    # With policy="off" there is one lane, collectives included; the order is rescheduled all the same.
    gm = aten_graph(*_traced("collective_only"))
    _, after, _ = before_after(gm, "assign_streams", policy="off")
    assert after.splitlines()[0] == "# graph inference: lanes s0=main; cudagraphs=none"
    assert _order(gm) == ["mm", "all_reduce", "mm_1", "relu", "mm_2", "wait_tensor", "add"]


def _collective_only(x, w1, w2, w3):
    r = ops.wait_tensor(ops.all_reduce(torch.mm(x, w1), "sum", "0"))
    return r + torch.mm(torch.relu(torch.mm(x, w2)), w3)


def _hinted(x, w1, w2, w3):
    with L("shared"):
        s = torch.mm(torch.relu(torch.mm(x, w2)), w3)
    r = ops.wait_tensor(ops.all_reduce(torch.mm(x, w1), "sum", "0"))
    return r + s


def _hinted_comm(x, w1, w2, w3):
    r = ops.all_reduce(torch.mm(x, w1), "sum", "0")
    with L("comm"):
        z = torch.mm(torch.relu(torch.mm(x, w2)), w3)
    z = z * 2  # read on s0 before the wait: s0 knows s1 past the collective, not past its wait
    return ops.wait_tensor(r) + z


def _two(x, w1, w2, w3):
    a = torch.mm(torch.mm(x, w1), w2)
    r1 = ops.all_reduce(a, "sum", "0")
    r2 = ops.all_reduce(x, "sum", "0")  # ready first, issued second: every rank keeps one order
    r1 = ops.wait_tensor(r1)
    r2 = ops.wait_tensor(r2)
    return r1 + r2 + torch.mm(x, w3)


_FUNCTIONS = {"collective_only": _collective_only, "hinted": _hinted, "hinted_comm": _hinted_comm, "two": _two}


def _traced(name: str):
    return (_FUNCTIONS[name], *_args())


def test_hints_name_their_lanes_and_the_comm_lane_is_extra():
    gm = aten_graph(*_traced("hinted"))
    _, after, _ = before_after(gm, "assign_streams", policy="hints", max_aux_lanes=1)
    assert after.splitlines()[0] == "# graph inference: lanes s0=main s1=comm s2=shared; cudagraphs=none"
    lanes = {n.name: meta.lane_of(n).index for n in gm.graph.nodes if meta.effect_of(n) is Effect.COMPUTE}
    assert lanes == {"mm": 2, "relu": 2, "mm_1": 2, "mm_2": 0, "all_reduce": 1, "wait_tensor": 1, "add": 0}
    # A hint on a collective wins; its wait follows it.
    def hinted_collective(x, w1, w2, w3):
        with L("side"):
            r = ops.all_reduce(torch.mm(x, w1), "sum", "0")
        return ops.wait_tensor(r) + x
    gm = aten_graph(hinted_collective, *_args())
    _, after, _ = before_after(gm, "assign_streams", policy="hints")
    assert after.splitlines()[0] == "# graph inference: lanes s0=main s1=side; cudagraphs=none"
    assert meta.lane_of(nodes_named(gm, "wait_tensor")[0]).index == 1


def test_collectives_keep_their_order_and_start_as_early_as_their_inputs_allow():
    gm = aten_graph(*_traced("two"))
    _, after, _ = before_after(gm, "assign_streams", policy="auto", max_aux_lanes=0)
    assert _order(gm) == ["mm", "mm_1", "all_reduce", "all_reduce_1", "mm_2", "wait_tensor", "wait_tensor_1",
                          "add", "add_1"]
    assert_expected_inline("\n".join(line for line in after.splitlines() if line.startswith("# decision")), """\
# decision: %all_reduce: collective on group '0' on lane comm; 1 kernel(s) issued before %wait_tensor
# decision: %all_reduce_1: collective on group '0' on lane comm; 1 kernel(s) issued before %wait_tensor_1""")


def test_a_compute_hint_on_the_comm_lane_does_not_free_an_input_before_the_wait():
    gm = aten_graph(*_traced("hinted_comm"))
    ctx = run_passes(gm, "partition", policy="hints")
    text = dump(gm)
    assert text.splitlines()[0] == "# graph inference: lanes s0=main s1=comm; cudagraphs=none"
    assert_expected_inline("\n".join(line.strip() for line in text.splitlines()[6:]), """\
segment k0:
%mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s0, owner=g0, segment=k0}
%record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%mm->%all_reduce}
%wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%mm->%all_reduce}
%all_reduce : f32[4,4] = _c10d_functional.all_reduce.default(%mm, 'sum', '0')  {lane=s1, owner=g0, segment=k0, resources=[comm:0@g0/s1]}
%mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s1, hint=comm, owner=g0, segment=k0}
%relu : f32[4,4] = aten.relu.default(%mm_1)  {lane=s1, hint=comm, owner=g0, segment=k0}
%mm_2 : f32[4,4] = aten.mm.default(%relu, %w3_1)  {lane=s1, hint=comm, owner=g0, segment=k0}
%record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%mul}
%wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%mul}
%mul : f32[4,4] = aten.mul.Tensor(%mm_2, 2)  {lane=s0, owner=g0, segment=k0}
%wait_tensor : f32[4,4] = _c10d_functional.wait_tensor.default(%all_reduce)  {lane=s1, owner=g0, segment=k0}
%record_default_2 : () = capturepass.record(2, 1)  {lane=s1, record=e2, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor->%add}
%release_default : () = capturepass.release([%mm_2], 1)  {lane=s1, owner=g0, segment=k0, by=insert_syncs, why=read by %mul}
%wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor->%add}
%add : f32[4,4] = aten.add.Tensor(%wait_tensor, %mul)  {lane=s0, owner=g0, segment=k0}
%release_default_1 : () = capturepass.release([%mm], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %all_reduce,%wait_tensor}
return %add  {lane=s0, owner=g0}
# decision: %all_reduce: collective on group '0' on lane comm; 4 kernel(s) issued before %wait_tensor""")
    assert ctx.counters["insert_syncs"]["releases"] == 2
    # The verifier agrees: a free of %mm where s0 knows s1 only past %mm_2 races the wait.
    (release,) = [n for n in nodes_named(gm, "release") if meta.info(n).lane.index == 0]
    nodes_named(gm, "mul")[0].append(release)
    with pytest.raises(VerificationError, match=r"\[unordered-free\] %release_default.*while %wait_tensor on s1"):
        verify(gm)


def test_the_wait_returns_the_collectives_storage_and_reads_its_inputs():
    gm = aten_graph(*_traced("collective_only"))
    (mm,) = [n for n in gm.graph.nodes if n.name == "mm"]
    (ar,) = nodes_named(gm, "all_reduce")
    (wait,) = nodes_named(gm, "wait_tensor")
    # wait_tensor's schema declares no alias; capturepass knows it returns its argument.
    assert wait.target._schema.returns[0].alias_info is None
    assert analysis.alias_source(wait) is ar and analysis.storage_root(wait) is ar
    assert analysis.aliases_input(wait) is None  # not a view: it has an effect of its own
    assert analysis.pending_reads(wait) == [mm]
    assert set(analysis.reads_of(mm)) == {ar, wait}
    assert collectives.collective_of(wait) is ar and collectives.waits_of(ar) == [wait]
    assert collectives.group_of(ar) == "0" and collectives.group_of(wait) is None


def test_a_write_to_a_collectives_input_is_ordered_after_its_wait():
    def fn(x, w):
        r = ops.wait_tensor(ops.all_reduce(x, "sum", "0"))
        x.add_(1)  # the caller's input, written once the collective is done with it
        return r + torch.mm(x, w)

    gm = aten_graph(fn, *_args(2))
    nodes = list(gm.graph.nodes)
    (write,) = nodes_named(gm, "add_")
    deps = effects.order_deps(nodes)[write]
    assert {(d.earlier.name, d.kind) for d in deps} == {("all_reduce", "war"), ("wait_tensor", "war")}
    ctx = run_passes(gm, "partition", policy="auto")
    assert ctx.counters["assign_streams"]["collectives"] == 1
    # Without the wait's read of %x_1 the reschedule would sink the wait below the write, and
    # the collective would send the written values; the effect edge keeps the write after it.
    assert _order(gm) == ["all_reduce", "wait_tensor", "add_", "mm", "add"]
    assert "why=%wait_tensor->%add_ (war %x_1)" in dump(gm)


def test_the_registry_declares_the_namespace_and_a_declaration_of_one_op_wins():
    gm = aten_graph(*_traced("collective_only"))
    (ar,) = nodes_named(gm, "all_reduce")
    (wait,) = nodes_named(gm, "wait_tensor")
    cap = REGISTRY.query(ar)
    assert (cap.collective, cap.overlap, cap.capturable, cap.resources, cap.source) == (
        True, "safe", True, ("comm:0",), "registry")
    assert cap.reason == "collective on group '0': the owner's communicator"
    assert not REGISTRY.query(wait).collective
    key = REGISTRY.key()
    capturepass.register_capability("_c10d_functional::all_reduce", overlap="serialize")
    try:
        assert not REGISTRY.query(ar).collective
        _, after, _ = before_after(gm, "assign_streams", policy="auto")
        # Serialized, so pinned to main: no comm lane; the wait follows it there.
        assert after.splitlines()[0] == "# graph inference: lanes s0=main s1=aux0; cudagraphs=none"
        assert meta.lane_of(wait).index == 0
    finally:
        REGISTRY.unregister("_c10d_functional::all_reduce")
    assert REGISTRY.key() == key


def test_a_custom_op_declared_collective_gets_the_comm_lane():
    @torch.library.custom_op("cptest_coll::ring", mutates_args=())
    def ring(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    ring.register_fake(lambda x: torch.empty_like(x))
    capturepass.register_capability(ring, collective=True)
    try:
        gm = aten_graph(lambda x, w: torch.ops.cptest_coll.ring(torch.mm(x, w)) + torch.mm(w, w), *_args(2))
        _, after, _ = before_after(gm, "assign_streams", policy="auto")
        assert after.splitlines()[0].startswith("# graph inference: lanes s0=main s1=comm")
        assert "%ring : f32[4,4] = cptest_coll.ring.default(%mm)  {lane=s1}" in after
        assert "# decision: %ring: collective on an unnamed group on lane comm; no wait_tensor in this graph" in after
    finally:
        REGISTRY.unregister(ring)


def test_emit_puts_each_collective_in_an_eager_region_of_its_own():
    from tests.passes.cases import CASES

    gm = CASES["collective"].trace()
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    # The per-lane regions a GPU runs.
    plan = compile_graph(gm, vals, {"policy": "auto", "inner": "inductor", "regions": "lanes"},
                         regions=False, record=False).plan
    regions = [(r.lane, [n.name for n in r.nodes], r.compiler, r.groups) for r in plan.regions]
    assert regions == [
        (0, ["mm"], "inductor", ()),
        (1, ["all_reduce"], "eager", ("0",)),
        (2, ["mm_1", "relu", "mm_2"], "inductor", ()),
        (1, ["wait_tensor"], "eager", ()),
        (0, ["add"], "inductor", ()),
    ]
    # On the host the lanes of a segment merge into one region, the collective aside: it keeps its
    # lane, whose communicator the owner's is.
    gm = CASES["collective"].trace()
    plan = compile_graph(gm, vals, {"policy": "auto", "inner": "inductor"}, regions=False, record=False).plan
    regions = [(r.lane, [n.name for n in r.nodes], r.compiler, r.groups) for r in plan.regions]
    assert regions == [
        (0, ["mm"], "inductor", ()),
        (1, ["all_reduce"], "eager", ("0",)),
        (0, ["mm_1", "relu", "mm_2", "wait_tensor", "add"], "inductor", ()),
    ]
    _, _, _, ctx = case_before_after("collective", "emit")
    code = describe_program(ctx.artifacts["program"])
    assert "region_1 = capturepass_runtime_program_region_1(getitem)" in code
