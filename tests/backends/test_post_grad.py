"""The pass route's rewrite of Inductor's post-grad graph (``capturepass.backends.post_grad``), on
the host: which ``addmm`` are split off their bias, and what the pass writes with them."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import capturepass
from capturepass.backends import post_grad
from capturepass.ir import meta
from tests.helpers import written_lanes

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _inductor_options_back():
    yield
    post_grad.restore_options()


def _traced(f, *shapes):
    args = tuple(torch.randn(*s) for s in shapes)
    return make_fx(f, tracing_mode="fake")(*args), args


def _split(gm):
    copy = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(gm.graph, value_map))
    return copy, post_grad.split_bias_adds(copy, value_map), value_map


def _beside(x, w1, w2, w3):
    # the bias and the product's operands come from two independent paths
    return torch.addmm(torch.relu(x @ w1), torch.sigmoid(x @ w2), w3)


def test_a_bias_from_another_path_is_split_off_its_product():
    gm, args = _traced(_beside, (8, 16), (16, 16), (16, 16), (16, 16))
    (source,) = gm.graph.find_nodes(op="call_function", target=aten.addmm.default)
    copy, splits, value_map = _split(gm)
    (split,) = splits
    assert split.source is source and value_map[source] is split.add
    assert split.mm.target is aten.mm.default and split.add.target is aten.add.Tensor
    assert split.add.args == (value_map[source.args[0]], split.mm)
    assert split.mm.args == (value_map[source.args[1]], value_map[source.args[2]])
    assert copy.find_nodes(op="call_function", target=aten.addmm.default) == []
    assert tuple(split.mm.meta["val"].shape) == (8, 16) and tuple(split.add.meta["val"].shape) == (8, 16)
    torch.testing.assert_close(fx.GraphModule(torch.nn.Module(), copy)(*args), gm(*args))


def test_an_addmm_reading_an_earlier_split_is_split_too():
    """A chain of two such ``addmm`` (the second's operand reads the first's result): the
    second's walk passes through the nodes the first split made."""

    def chain(x, w1, w2, w3, w4, w5):
        return torch.addmm(torch.tanh(x @ w4), torch.relu(_beside(x, w1, w2, w3)), w5)

    gm, args = _traced(chain, (8, 16), (16, 16), (16, 16), (16, 16), (16, 16), (16, 16))
    copy, splits, _ = _split(gm)
    assert len(splits) == 2
    torch.testing.assert_close(fx.GraphModule(torch.nn.Module(), copy)(*args), gm(*args))


def test_a_symbolic_graph_is_split_without_a_guard():
    """A piece compiled for a range of sizes (vLLM's) has symbolic shapes: the split compares
    them without adding a guard to the compile it runs in."""
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 16))
    gm = make_fx(_beside, tracing_mode="symbolic")(*args)
    shape_env = gm.graph.find_nodes(op="placeholder")[0].meta["val"].fake_mode.shape_env
    before = list(shape_env.guards)
    _, splits, _ = _split(gm)
    assert len(splits) == 1 and list(shape_env.guards) == before
    assert isinstance(splits[0].mm.meta["val"].shape[0], torch.SymInt)


@pytest.mark.parametrize("f, shapes", [
    # a residual stream: the product's operand depends on the bias
    (lambda x, w1, w2: (lambda h: torch.addmm(h, torch.relu(h), w2))(x @ w1), [(8, 16), (16, 16), (16, 16)]),
    # a broadcast bias
    (lambda x, b, w1, w2: torch.addmm(torch.relu(b), torch.sigmoid(x @ w1), w2), [(8, 16), (16,), (16, 16), (16, 16)]),
    # a graph input
    (lambda x, y, w1, w2: torch.addmm(y, torch.sigmoid(x @ w1), w2), [(8, 16), (8, 16), (16, 16), (16, 16)]),
    # scaled
    (lambda x, w1, w2, w3: torch.addmm(torch.relu(x @ w1), torch.sigmoid(x @ w2), w3, beta=0.5),
     [(8, 16), (16, 16), (16, 16), (16, 16)]),
], ids=["residual", "broadcast", "input", "scaled"])
def test_an_addmm_the_split_cannot_help_stays_fused(f, shapes):
    gm, _ = _traced(f, *shapes)
    assert len(gm.graph.find_nodes(op="call_function", target=aten.addmm.default)) == 1
    copy, splits, _ = _split(gm)
    assert splits == []
    assert len(copy.find_nodes(op="call_function", target=aten.addmm.default)) == 1


@pytest.mark.parametrize("lanes, pays", [
    ((0, 0, 0), False),  # product, bias and sum on one lane: only a kernel more
    ((1, 0, 0), True),  # the product beside the bias
    ((0, 1, 0), True),  # the product runs before its lane waits for the bias
    ((1, 1, 0), False),  # the product after (or before) the bias on their lane: nothing beside
])
def test_a_split_pays_only_with_the_product_beside_its_bias(lanes, pays):
    gm, _ = _traced(_beside, (8, 16), (16, 16), (16, 16), (16, 16))
    _, (split,), _ = _split(gm)
    for node, lane in zip((split.mm, split.add.args[0], split.add), lanes):
        meta.create(node, "test", lane=meta.LaneId(lane))
    assert post_grad.split_pays(split) is pays


def test_the_pass_runs_a_split_product_beside_its_bias(monkeypatch, caplog):
    """The product, no longer fused with the sum, runs on one lane while its bias is computed on
    another; the sum waits for both, and the log names the ``addmm`` split."""
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments", "verify": true}')
    gm, args = _traced(lambda x, w1, w2, w3, w4: _beside(x, w1, w2, w3) @ w4, (8, 16), (16, 16), (16, 16), (16, 16),
                       (16, 16))
    want = gm(*args)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        capturepass.post_grad_pass(gm.graph)
    (said,) = [r.getMessage() for r in caplog.records if "sync points written" in r.getMessage()]
    assert said.endswith("; 1 addmm split off a bias from another path (%addmm)"), said
    gm.recompile()
    assert gm.graph.find_nodes(op="call_function", target=aten.addmm.default) == []
    lanes = written_lanes(gm.graph)
    (add,) = gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)
    product = add.args[1]
    assert product.target is aten.mm.default and lanes[product] != lanes[add]
    torch.testing.assert_close(gm(*args), want)


def test_a_split_the_schedule_keeps_on_its_bias_lane_is_planned_again_fused(monkeypatch, caplog):
    """Where the product runs on its bias's lane the split only costs a kernel: the pass plans
    the graph again with the ``addmm`` as Inductor fused it."""
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments", "verify": true}')

    def f(x, w1, w2, w3, w4):
        h = x @ w1
        return torch.addmm(torch.relu(h), torch.sigmoid(h), w2) + torch.tanh(x @ w3) @ w4

    gm, args = _traced(f, (8, 16), (16, 16), (16, 16), (16, 16), (16, 16))
    want = gm(*args)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        capturepass.post_grad_pass(gm.graph)
    gm.recompile()
    said = [r.getMessage() for r in caplog.records]
    assert any("1 of 1 addmm split off their bias run on the bias's lane; planned again with them fused" in m
               for m in said)
    assert any("2 lanes" in m and "sync points written" in m for m in said)
    assert len(gm.graph.find_nodes(op="call_function", target=aten.addmm.default)) == 1
    torch.testing.assert_close(gm(*args), want)
