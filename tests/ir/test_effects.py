"""Unit tests of the storage-effect model (``capturepass.ir.effects``) on traced ATen graphs."""

from __future__ import annotations

import torch

from capturepass.ir import analysis, effects
from tests.helpers import aten_graph, nodes_named


def _node(gm, name):
    (node,) = [n for n in gm.graph.nodes if n.name == name]
    return node


def test_in_place_ops_write_their_self_argument_and_views_read_the_base():
    def fn(x, w):
        a = x[0] @ w
        x[1].add_(a)
        return x.sum()

    gm = aten_graph(fn, torch.randn(4, 4), torch.randn(4, 4))
    add_ = _node(gm, "add_")
    x = _node(gm, "x_1")
    assert [n.name for n in effects.written_args(add_)] == ["select_1"]
    assert effects.accesses(add_).writes == (x,)
    assert x in effects.accesses(_node(gm, "mm")).reads  # through the views %select, %unsqueeze
    # add_ returns the tensor it wrote: its value lives in x's storage.
    assert analysis.storage_root(add_) is x and analysis.alias_source(add_).name == "select_1"
    assert effects.mutated_inputs(gm) == frozenset({0})


def test_order_deps_are_war_and_raw_on_the_written_storage_only():
    def fn(x, y):
        a = x.sin()        # read x
        x.mul_(2)          # write x after the read: war
        b = x.cos()        # read x after the write: raw
        x.copy_(y)         # write x: war on %cos; after %mul_ (copy_'s destination counts as read)
        return a + b + y   # y is never written: no dependency on it

    gm = aten_graph(fn, torch.randn(4, 4), torch.randn(4, 4))
    deps = effects.order_deps(gm.graph.nodes)
    seen = {n.name: sorted((d.earlier.name, d.kind) for d in ds) for n, ds in deps.items()}
    assert seen == {
        "mul_": [("sin", "war")],
        "cos": [("mul_", "raw")],
        "copy_": [("cos", "war"), ("mul_", "raw")],
    }
    (dep,) = deps[_node(gm, "mul_")]
    assert dep.why(_node(gm, "mul_")) == "%sin->%mul_ (war %x_1)"


def test_random_ops_read_and_write_the_hidden_rng_state():
    def fn(x):
        return torch.rand_like(x) + torch.randn_like(x) + x

    gm = aten_graph(fn, torch.randn(4, 4))
    rand, randn = nodes_named(gm, "rand_like")[0], nodes_named(gm, "randn_like")[0]
    assert effects.is_random(rand) and effects.is_random(randn)
    assert effects.RNG in effects.accesses(rand).writes
    assert [(d.earlier.name, d.kind) for d in effects.order_deps(gm.graph.nodes)[randn]] == [("rand_like", "raw")]
    assert effects.mutated_inputs(gm) == frozenset()


def test_functional_graphs_without_writes_add_nothing():
    def fn(x, w):
        return (x @ w).relu().t()

    gm = aten_graph(fn, torch.randn(4, 4), torch.randn(4, 4))
    assert not effects.has_effects(gm.graph)
    assert effects.order_deps(gm.graph.nodes) == {}


def test_functionalized_input_update_is_one_write_back_copy():
    def fn(x):
        x.add_(1)
        return x * 2

    gm = aten_graph(torch.func.functionalize(fn, remove="mutations"), torch.randn(4, 4))
    (copy,) = nodes_named(gm, "copy_")
    assert effects.accesses(copy).writes == (_node(gm, "x_1"),)
    assert effects.mutated_inputs(gm) == frozenset({0})



def test_fake_value_unwraps_a_functional_tensor():
    """torch 2.11's AOT autograd can leave an opaque custom op's output as a FunctionalTensor; a
    region reading it as an input must see the fake tensor inside (Inductor raised "Attempting
    to use FunctionalTensor on its own" on a region after transformers' grouped_mm_fallback)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 3)
    with FunctionalTensorMode():
        wrapped = FunctionalTensor.to_functional(fake)
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 3))
    node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    node.meta["val"] = wrapped
    got = analysis.fake_value(node)
    assert type(got) is FakeTensor and got.shape == (4, 3) and got.stride() == (3, 1)
    node.meta["val"] = fake
    assert analysis.fake_value(node) is fake
