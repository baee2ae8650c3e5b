"""Every region gets the layout it was compiled for, whatever its producer region returned.

Inductor compiles each region separately and specialises on its inputs' strides. Its
re-trace of a region may turn an output into a view with another layout (``cat`` with an
empty operand returns the other operand, here transposed), while the consumer region was
compiled for the fake value's (contiguous) strides and asserted them: transformers' Llama,
Mixtral, Qwen2-MoE and GPT-2 failed so (``AssertionError: expected size 2==2, stride
8==128 at dim=1``), while ``backend="inductor"`` passed. Two things hold now: the graph is
traced with Inductor's decompositions (so fake values carry the layouts Inductor produces,
and a ``view`` recorded for the other layout cannot break a region's re-trace: GPT-2 with a
KV cache and one auxiliary lane did), and each compiled region's outputs leave at the strides
of their fake values whatever Inductor returns (``runtime/layouts.py``).
"""

from __future__ import annotations

import pytest
import torch

import capturepass
from capturepass.runtime.layouts import ExactLayouts

L = capturepass.lane


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def kv_concat(x, cache):
    """The pattern of a KV cache grown by ``cat`` (empty on the first step), across lanes."""
    with L("aux"):
        t = x.view(x.shape[0], 16, 2, 8).transpose(1, 2)
        k = torch.cat([cache, t], -2)
    return (k @ k.transpose(-1, -2)).sum(-1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_transposed_region_output_reaches_its_consumer_at_the_compiled_layout(dynamic):
    compiled = torch.compile(kv_concat, backend="capturepass", dynamic=dynamic, options={"verify": True})
    for batch in (2, 3):
        x, cache = torch.randn(batch, 16, 16), torch.empty(batch, 2, 0, 8)
        torch.testing.assert_close(compiled(x, cache), kv_concat(x, cache))


def test_graph_outputs_have_the_strides_inductor_gives():
    """The graph is decomposed as Inductor decomposes it (``cat`` with an empty operand becomes a
    ``clone`` that keeps the transposed layout), so its outputs leave at the layout
    ``backend="inductor"`` returns, and every region agrees with it."""
    def f(x, cache):
        with L("aux"):
            k = torch.cat([cache, x.view(2, 16, 2, 8).transpose(1, 2)], -2)
        return k, x.sin()

    x, cache = torch.randn(2, 16, 16), torch.empty(2, 2, 0, 8)
    out = torch.compile(f, backend="capturepass", options={"verify": True})(x, cache)
    torch._dynamo.reset()
    ref = torch.compile(f, backend="inductor")(x, cache)
    assert out[0].stride() == ref[0].stride() == (256, 8, 16, 1)
    torch.testing.assert_close(out, f(x, cache))


def _fake(shape, stride, dynamic_dims=()):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    from torch.fx.experimental.symbolic_shapes import StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    real = torch.empty_strided(shape, stride)
    ctx = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic_dims else DimDynamic.STATIC for d in range(len(shape))]
    )
    return mode.from_tensor(real, symbolic_context=ctx)


def test_exact_layouts_copies_only_what_differs():
    x = torch.randn(2, 16, 2, 8)
    transposed = x.transpose(1, 2)  # (2, 2, 16, 8) with strides (256, 8, 16, 1)
    calls = []

    def region(a):
        calls.append(a)
        return (a.transpose(1, 2), a.sin())

    val = torch.empty(2, 2, 16, 8)  # what the consumer was compiled for: contiguous
    exact = ExactLayouts(region, [x], [val, torch.empty(2, 16, 2, 8)], "region 0")
    outs = exact(x)
    assert outs[0].stride() == (256, 128, 8, 1) and torch.equal(outs[0], transposed)
    assert outs[1].stride() == x.stride()  # already right: passed through, not copied
    assert outs[1].data_ptr() != outs[0].data_ptr()


def test_exact_layouts_rebuilds_symbolic_dense_strides_from_runtime_sizes():
    val = _fake((4, 3, 5), (15, 5, 1), dynamic_dims=(0, 2))
    exact = ExactLayouts(lambda a: (a.permute(0, 2, 1).contiguous().permute(0, 2, 1),), [val], [val], "r")
    assert exact._expected[0][1].order == (2, 1, 0)  # symbolic strides, dense in this order
    for batch, last in ((4, 5), (7, 9)):
        a = torch.randn(batch, 3, last)
        (out,) = exact(a)
        assert out.stride() == (3 * last, last, 1) and torch.equal(out, a)


def test_exact_layouts_ignores_strides_of_size_one_dims():
    val = torch.empty(1, 4)  # strides (4, 1)
    exact = ExactLayouts(lambda a: (a,), [val], [val], "r")
    a = torch.empty_strided((1, 4), (99, 1))
    (out,) = exact(a)
    assert out is a


def test_static_layouts_are_checked_once_then_only_where_they_differed():
    calls = {"n": 0}

    def region(a):
        calls["n"] += 1
        return (a.transpose(1, 2), a.sin())

    x = torch.randn(2, 16, 2, 8)
    exact = ExactLayouts(region, [x], [torch.empty(2, 2, 16, 8), torch.empty(2, 16, 2, 8)], "region 0")
    for _ in range(3):
        outs = exact(x)
        assert outs[0].stride() == (256, 128, 8, 1) and outs[1].stride() == x.stride()
    # After the first call only output 0 (which differed) is looked at.
    assert [i for i, _ in exact._expected] == [0]
    same = ExactLayouts(lambda a: (a.sin(),), [x], [torch.empty(2, 16, 2, 8)], "region 1")
    same(x)
    assert same._expected == [] and same(x)[0].stride() == x.stride()
