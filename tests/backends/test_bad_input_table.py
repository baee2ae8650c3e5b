"""The bad-input table of RELIABILITY.md: the cases not covered by the other backend tests.

Each case gives a clear error (a ``CapturePassError``) or a logged graph break, never a wrong
result: outputs are compared with eager, and where a graph was compiled, the interleaving
simulator runs it in adversarial interleavings against serial execution.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from backends.e2e_util import compile_eager, new_compiles, unwrap

import capturepass
from capturepass.ir.capabilities import REGISTRY
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from capturepass.testing.simulate import explore

L = capturepass.lane


def _simulated_clean(record, inputs) -> None:
    """The compiled graph equals serial execution in every simulated interleaving."""
    report = explore(record.graph, inputs, range(12), replay=True)
    assert report.ok, report.describe()


def _compile_and_compare(fn, *inputs, **options):
    torch._dynamo.reset()
    with new_compiles() as graphs:
        got = compile_eager(fn, **options)(*[x.clone() for x in inputs])
    torch.testing.assert_close(got, fn(*[x.clone() for x in inputs]), rtol=0, atol=0)
    return graphs


# -- host synchronisations in capture regions ------------------------------------------------


def _item_in_hint(x):
    with L("aux"):
        s = x.sum().item()
        y = x.sin() * s
    return y + x.cos()


def test_item_inside_a_hint_is_a_logged_graph_break_that_runs_eagerly(caplog):
    # Dynamo cannot resume inside the hint's context manager: the frame runs eagerly, logged.
    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING):
        graphs = _compile_and_compare(_item_in_hint, x, policy="hints")
    assert graphs == []
    assert "Graph break" in caplog.text and "item" in caplog.text


def test_item_with_captured_scalars_stays_on_the_device():
    # With captured scalars, the scalar feeds tensor math only: the decomposition keeps it on
    # the device (no host sync, no break), and the read of the aux lane's sum is ordered.
    # tests/backends/test_dynamo_backend.py::test_host_sync_splits_the_graph_into_two_segments
    # covers a scalar the host needs (a break on the main lane, two segments).
    x = torch.randn(4, 4)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        graphs = _compile_and_compare(_item_in_hint, x, policy="hints", cudagraphs="breakable")
    (record,) = graphs
    gm = record.graph
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    assert meta.graph_info(gm).lanes == ("main", "aux")
    assert len(meta.graph_info(gm).segments) == 1
    _simulated_clean(record, [x])


def _tolist(x):
    y = x.sin()
    first = x[0].tolist()
    return y * first[0] + y.cos()


def test_tolist_is_a_graph_break():
    x = torch.randn(4, 4)
    graphs = _compile_and_compare(_tolist, x)
    assert len(graphs) == 2  # before and after the break
    for record in graphs:
        assert not [n for n in record.graph.graph.nodes if meta.info(n).brk is not None]


def _prints(x):
    y = x.sin()
    print("value:", y)
    return y.cos() + x


def test_printing_a_tensor_is_a_graph_break_and_prints(capsys):
    x = torch.randn(4, 4)
    graphs = _compile_and_compare(_prints, x)
    assert capsys.readouterr().out.count("value:") == 2  # compiled call and eager call
    assert len(graphs) == 2  # before and after the print


# -- aliasing and views ----------------------------------------------------------------------


def _views_across_lanes(x, w):
    t = x.t()  # a view made on main ...
    with L("aux"):
        a = torch.mm(t, w)  # ... read on aux
        v = a.view(-1)  # a view of an aux result ...
    return v * 2, a[1:]  # ... read on main, and returned as a view


def test_views_crossing_lanes():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    (record,) = _compile_and_compare(_views_across_lanes, x, w, policy="hints")
    assert meta.graph_info(record.graph).lanes == ("main", "aux")
    _simulated_clean(record, [x, w])


def _mutate_input_read_on_aux(x, y):
    with L("aux"):
        a = x.sin() * y
    x.mul_(2)
    return a + x


def test_in_place_mutation_of_an_input_read_on_another_lane():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    x_eager = x.clone()
    expected = _mutate_input_read_on_aux(x_eager, y.clone())
    torch._dynamo.reset()
    with new_compiles() as graphs:
        got = compile_eager(_mutate_input_read_on_aux, policy="hints")(x, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(x, x_eager, rtol=0, atol=0)
    (record,) = graphs
    _simulated_clean(record, [x_eager.clone() / 2, y])


# -- shapes and dtypes ------------------------------------------------------------------------


def _branches(x):
    with L("aux"):
        a = x.sin().sum(0)
    return a + x.cos().sum(0)


def test_dynamic_shapes_never_recompile_per_size():
    torch._dynamo.reset()
    compiled = compile_eager(_branches, policy="hints", dynamic=True)
    with new_compiles() as graphs:
        for rows in (2, 3, 5, 9):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(compiled(x), _branches(x), rtol=0, atol=0)
    assert len(graphs) == 1


def test_non_contiguous_and_empty_inputs():
    for x in (torch.randn(4, 6).t(), torch.randn(0, 4), torch.randn(8, 4)[::2]):
        (record,) = _compile_and_compare(_branches, x, policy="hints")
        _simulated_clean(record, [x])


def _ints(x, m):
    with L("aux"):
        a = (x * 3) // 2
    return a + m.to(x.dtype), m & (x > 0)


def test_integer_and_bool_tensors():
    x, m = torch.randint(-9, 9, (4, 4)), torch.rand(4, 4) > 0.5
    (record,) = _compile_and_compare(_ints, x, m, policy="hints")
    _simulated_clean(record, [x, m])


@pytest.mark.gpu
def test_cpu_and_cuda_tensors_mixed():
    def fn(x, c):
        with L("aux"):
            a = x.sin()
        return a + c.to(x.device).cos()

    x, c = torch.randn(4, 4, device="cuda"), torch.randn(4, 4)
    got = compile_eager(fn, policy="hints")(x, c)
    torch.testing.assert_close(got, fn(x, c))


# -- random numbers ---------------------------------------------------------------------------


def _rng(x):
    with L("a"):
        a = torch.rand_like(x) + x.sin()
    b = torch.rand_like(x) * x.cos()
    return a, b


def test_rng_with_the_eager_inner_compiler_equals_eager_with_the_same_seed():
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    expected = _rng(x)
    torch._dynamo.reset()
    compiled = compile_eager(_rng, policy="hints")
    for _ in range(2):
        torch.manual_seed(0)
        got = compiled(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rng_with_inductor_is_deterministic_per_seed_and_uniform():
    def draw(x):
        with L("a"):
            a = torch.rand_like(x)
        return a, torch.rand_like(x) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(draw, backend="capturepass", options={"policy": "hints"})
    x = torch.empty(128, 128)
    torch.manual_seed(1)
    first = compiled(x)
    torch.manual_seed(1)
    again = compiled(x)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    for sample in first:
        assert 0.0 <= sample.min() and sample.max() < 1.0
        assert abs(sample.mean().item() - 0.5) < 0.02
    assert not torch.equal(first[0], first[1])  # two draws, not one reused


# -- unsupported ops, hints, capabilities -----------------------------------------------------


def _nonzero(x):
    with L("a"):
        idx = torch.nonzero(x > 0)
    return idx, x.sin()


def test_data_dependent_output_shape_is_a_graph_break():
    x = torch.randn(4, 4)
    _compile_and_compare(_nonzero, x, policy="hints")


@torch.library.custom_op("cptest_table::uncapturable", mutates_args=())
def uncapturable(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@uncapturable.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("cptest_table::planned", mutates_args=())
def planned(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@planned.register_fake
def _(x):
    return torch.empty_like(x)


def _with_op(op):
    def fn(x):
        with L("aux"):
            a = x.cos()
        return op(x.sin()) + a

    return fn


def test_an_op_declared_not_capturable_is_a_break_on_main():
    capturepass.register_capability(uncapturable, capturable=False)
    try:
        x = torch.randn(4, 4)
        (record,) = _compile_and_compare(_with_op(uncapturable), x, policy="hints", cudagraphs="breakable")
    finally:
        REGISTRY.unregister(uncapturable)
    (brk,) = [n for n in record.graph.graph.nodes if meta.info(n).brk is not None]
    assert "uncapturable" in str(brk.target) and meta.lane_of(brk).index == 0
    _simulated_clean(record, [x])


def test_a_capability_callable_that_raises_is_a_clear_error():
    def plan(call):
        raise KeyError("no plan for this shape")

    capturepass.register_capability(planned, overlap=plan)
    try:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            compile_eager(_with_op(planned), policy="hints")(torch.randn(4, 4))
    finally:
        REGISTRY.unregister(planned)
    err = unwrap(info.value)
    assert isinstance(err, capturepass.CapabilityError), repr(err)
    assert "cptest_table::planned" in str(err) and "KeyError" in str(err) and "no plan" in str(err)


def test_a_capability_callable_returning_nonsense_is_a_clear_error():
    capturepass.register_capability(planned, overlap=lambda call: "fast")
    try:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            compile_eager(_with_op(planned), policy="hints")(torch.randn(4, 4))
    finally:
        REGISTRY.unregister(planned)
    err = unwrap(info.value)
    assert isinstance(err, capturepass.CapabilityError), repr(err)
    assert "must return a Capability or a mapping" in str(err)


def _alternating(x):
    a = x.sin()
    with L("a"):
        b = a.cos() + x
    with L("b"):
        c = b.exp() * a
    with L("a"):
        d = c.tanh() - b
    with L("b"):
        e = d.sigmoid() + c
    return e + a


def test_alternating_hints_that_form_a_cross_lane_chain():
    x = torch.randn(4, 4)
    (record,) = _compile_and_compare(_alternating, x, policy="hints", max_aux_lanes=2)
    gm = record.graph
    assert meta.graph_info(gm).lanes == ("main", "a", "b")
    waits = [n for n in gm.graph.nodes if meta.effect_of(n) is Effect.WAIT]
    assert len(waits) <= 8  # every edge of the chain crosses lanes, plus forks and the join
    _simulated_clean(record, [x])


@capturepass.lane("deco")
def _decorated_with_break(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_graph_break_inside_a_decorated_hint():
    x = torch.randn(4, 4)
    _compile_and_compare(lambda x: _decorated_with_break(x) + x, x, policy="hints")


def test_empty_aten_graph_through_the_pipeline():
    from capturepass.runtime.executor import Executor
    from tests.helpers import aten_graph, run_passes

    gm = aten_graph(lambda x: (x,), torch.randn(3))
    ctx = run_passes(gm, upto="emit", policy="auto")
    executor = Executor(ctx.artifacts["program"])
    x = torch.randn(3)
    try:
        (out,) = executor([x])
    finally:
        executor.close()
    assert out is x


# -- the runtime ------------------------------------------------------------------------------


def test_calling_a_closed_executor_is_a_clear_error():
    x = torch.randn(4, 4)
    torch._dynamo.reset()
    compiled = compile_eager(_branches, policy="hints")
    with new_compiles() as graphs:
        compiled(x)
    (record,) = graphs
    executor = record.executor
    executor.close()
    with pytest.raises(capturepass.CapturePassError, match="closed"):
        executor([x])
    with pytest.raises(capturepass.CapturePassError, match="closed"):
        compiled(x)


def test_several_threads_calling_one_compiled_model():
    torch._dynamo.reset()
    compiled = compile_eager(_alternating, policy="hints", max_aux_lanes=2)
    compiled(torch.randn(4, 4))  # compile once, before the threads start
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(20):
                x = torch.randn(4, 4, generator=gen)
                torch.testing.assert_close(compiled(x), _alternating(x), rtol=0, atol=0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
