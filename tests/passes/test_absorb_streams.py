"""Tests of ``absorb_streams``, the Dynamo-stage pass: stream regions become lane hints.

The graphs are built by hand the way Dynamo records a ``torch.cuda.stream``
region: ``meta["custom"]["stream"]`` on every node inside it, explicit
``torch.ops.streams.*`` calls, and ``get_external_object_by_index`` fetches of
the stream and event objects. After the pass the stream key is gone, each
annotated node carries a ``capturepass`` lane hint, and the stream ops and
unused object fetches are removed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from expecttest import assert_expected_inline

from capturepass.ir import meta
from capturepass.passes.absorb_streams import AbsorbStreams
from tests.helpers import context, dump, run_passes

aten = torch.ops.aten
streams = getattr(torch.ops, "streams", None)


def _has_stream_ops() -> bool:
    try:
        import torch._dynamo.variables.streams  # noqa: F401  (registers torch.ops.streams.*)
    except ImportError:
        return False
    return streams is not None and hasattr(streams, "record_event")


needs_stream_ops = pytest.mark.skipif(not _has_stream_ops(), reason="torch.ops.streams is not available")


def _graph(with_stream_ops: bool, custom: dict | None) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    if with_stream_ops:
        from torch._dynamo.graph_bytecode_inputs import get_external_object_by_index

        g.call_function(get_external_object_by_index, (1,))
    b = g.create_node("call_function", aten.mul.Tensor, (x, 2), name="mul")
    if custom is not None:
        b.meta["custom"] = dict(custom)
    if with_stream_ops:
        g.call_function(streams.record_event.default, (2, 1))
        g.call_function(streams.wait_event.default, (2, 0))
    c = g.create_node("call_function", aten.add.Tensor, (b, x), name="add")
    g.output(c)
    return fx.GraphModule(torch.nn.Module(), g)


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


@needs_stream_ops
def test_stream_region_becomes_a_lane_hint_and_stream_ops_go():
    gm = _graph(with_stream_ops=True, custom={"stream": 0})
    ctx = context(policy="hints")
    AbsorbStreams().run(gm, ctx)
    assert _node(gm, "mul").meta["custom"] == {"capturepass": {"lane": "stream0"}}
    assert_expected_inline(gm.code.strip(), """\
def forward(self, x):
    mul = torch.ops.aten.mul.Tensor(x, 2)
    add = torch.ops.aten.add.Tensor(mul, x);  mul = x = None
    return add""")
    assert not any(n.op == "call_function" and str(n.target).startswith("streams.") for n in gm.graph.nodes)
    assert ctx.counters["absorb_streams"] == {"absorbed_nodes": 1, "removed_stream_ops": 2}


def test_stream_key_without_stream_ops():
    gm = _graph(with_stream_ops=False, custom={"stream": 3})
    AbsorbStreams().run(gm, context(policy="hints"))
    assert _node(gm, "mul").meta["custom"] == {"capturepass": {"lane": "stream3"}}


def test_a_capturepass_hint_wins_over_the_stream():
    gm = _graph(with_stream_ops=False, custom={"stream": 1, "capturepass": {"lane": "mine"}, "other": 7})
    ctx = context(policy="hints")
    AbsorbStreams().run(gm, ctx)
    assert _node(gm, "mul").meta["custom"] == {"capturepass": {"lane": "mine"}, "other": 7}
    assert "absorb_streams" not in ctx.counters


def test_graph_without_streams_is_unchanged():
    gm = _graph(with_stream_ops=False, custom={"other": 7})
    code = gm.code
    metas = [copy.deepcopy({k: v for k, v in n.meta.items()}) for n in gm.graph.nodes]
    ctx = context(policy="hints")
    AbsorbStreams().run(gm, ctx)
    assert gm.code == code
    assert [dict(n.meta) for n in gm.graph.nodes] == metas
    assert "absorb_streams" not in ctx.counters


@pytest.mark.parametrize("policy, lane", [("hints", "s1"), ("off", "s0")])
def test_absorbed_hint_reaches_the_lanes_unless_policy_is_off(policy, lane):
    gm = _graph(with_stream_ops=False, custom={"stream": 0})
    AbsorbStreams().run(gm, context(policy=policy))
    run_passes(gm, upto="assign_streams", policy=policy)
    assert str(meta.lane_of(_node(gm, "mul"))) == lane
    assert ("s1=stream0" in dump(gm)) == (policy == "hints")
