"""Unusual programs through torch.compile: each works like eager (or raises a CapturePassError).

Never a wrong result: outputs, output aliasing and input mutations are compared with eager.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from backends.e2e_util import (
    HappensBefore,
    assert_cross_lane_reads_ordered,
    assert_main_joins,
    compile_eager,
    compute_nodes,
    lanes_used,
    new_compiles,
)

import capturepass
from capturepass.ir import meta


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _IntsOnly(nn.Module):
    def forward(self, a, b):
        return a * b + 3


def test_model_without_tensors():
    with new_compiles() as graphs:
        out = compile_eager(_IntsOnly())(3, 4)
    assert out == 15 and type(out) is int
    assert graphs == []  # Dynamo has no graph to hand over


class _Identity(nn.Module):
    def forward(self, x):
        return x


def test_model_returning_its_input_unchanged():
    x = torch.randn(3, 2)
    with new_compiles() as graphs:
        out = compile_eager(_Identity())(x)
    assert out is x
    assert graphs == []


class _ViewOnly(nn.Module):
    def forward(self, x):
        return x.view(-1)


def test_graph_of_a_single_view_aliases_like_eager():
    x = torch.randn(3, 2)
    with new_compiles() as graphs:
        out = compile_eager(_ViewOnly())(x)
    torch.testing.assert_close(out, x.view(-1))
    assert _storage(out) == _storage(x)
    out[0] = 100.0  # writes through, as eager's view would
    assert x[0, 0].item() == 100.0
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    assert meta.graph_info(gm).lanes == ("main",)
    assert not [n for n in gm.graph.nodes if meta.effect_of(n).value in ("record", "wait")]


class _AliasingOutputs(nn.Module):
    """One output is a view of the input, another a view of a computed output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.a(x)) + torch.tanh(self.b(x))
        return x[1:], x.t(), y, y.view(-1)


def test_outputs_that_alias_the_input_or_each_other():
    torch.manual_seed(0)
    model = _AliasingOutputs()
    x = torch.randn(3, 4)
    with torch.no_grad(), new_compiles() as graphs:
        got = compile_eager(model)(x)
        expected = model(x)
    torch.testing.assert_close(got, expected)
    assert _storage(got[0]) == _storage(x) and got[0].storage_offset() == 4
    assert _storage(got[1]) == _storage(x) and got[1].stride() == (1, 4)
    assert _storage(got[3]) == _storage(got[2])
    assert _storage(got[2]) != _storage(x)
    got[2][0, 0] = -7.0
    assert got[3][0].item() == -7.0
    assert [g.name for g in graphs] == ["inference"]
    assert_cross_lane_reads_ordered(graphs[0].graph)
    assert_main_joins(graphs[0].graph)


@torch.library.custom_op("capturepass_e2e_test::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y


@scale_add.register_fake
def _(x, y):
    return torch.empty_like(x)


def _with_custom_op(x, y):
    return scale_add(torch.relu(x), torch.cos(y)) + torch.sigmoid(x) * torch.exp(y)


def test_undeclared_custom_op_is_serialized():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with new_compiles() as graphs:
        torch.testing.assert_close(compile_eager(_with_custom_op)(x, y), _with_custom_op(x, y))
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    (op,) = [n for n in compute_nodes(gm) if "scale_add" in str(n.target)]
    cap = meta.info(op).capability
    assert cap.overlap == "serialize" and cap.source == "default"
    assert "capturepass_e2e_test::scale_add" in cap.reason
    assert meta.lane_of(op).index == 0
    assert len(lanes_used(gm)) >= 2, "the graph has independent branches beside the op"
    # Serialized: every other node runs entirely before or entirely after it.
    hb = HappensBefore(gm)
    for node in compute_nodes(gm):
        if node is not op and meta.lane_of(node).index != 0:
            assert hb(node, op) or hb(op, node), f"%{node.name} may run beside %{op.name}"
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)


def _mutates_input(x, y):
    x.add_(1)
    return torch.sin(y) * torch.cos(x) + torch.tanh(y)


def test_in_place_mutation_of_an_input():
    x, y = torch.randn(6), torch.randn(6)
    x_ref, y_ref = x.clone(), y.clone()
    with new_compiles() as graphs:
        got = compile_eager(_mutates_input)(x, y)
    expected = _mutates_input(x_ref, y_ref)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x, x_ref)  # the mutation reached the caller's tensor
    torch.testing.assert_close(y, y_ref)
    assert [g.name for g in graphs] == ["inference"]
    gm = graphs[0].graph
    (copy,) = [n for n in compute_nodes(gm) if n.target is torch.ops.aten.copy_.default]
    # The write-back runs after every read of the old value, and is joined before the output.
    hb = HappensBefore(gm)
    for node in compute_nodes(gm):
        if node is not copy and copy.args[0] in node.all_input_nodes:
            assert hb(node, copy), f"%{node.name} reads the input the write-back overwrites"
    assert_cross_lane_reads_ordered(gm)
    assert_main_joins(gm)


class _MutatesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(4))
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        self.steps.add_(1)
        return torch.relu(self.a(x)) + self.steps * torch.tanh(x)


def test_in_place_mutation_of_a_buffer_across_calls():
    torch.manual_seed(0)
    model = _MutatesBuffer()
    ref = _MutatesBuffer()
    ref.load_state_dict(model.state_dict())
    compiled = compile_eager(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(compiled(x), ref(x))
    torch.testing.assert_close(model.steps, torch.full((4,), 3.0))


def _break_inside_a_hint(x):
    with capturepass.lane("aux"):
        y = torch.sin(x)
        torch._dynamo.graph_break()
        z = torch.cos(y)
    return z + torch.tanh(x)


def test_graph_break_inside_a_hint_block():
    # Dynamo cannot resume inside the hint's context manager; whatever it compiles, the result is eager's.
    x = torch.randn(4, 4)
    torch.testing.assert_close(compile_eager(_break_inside_a_hint)(x), _break_inside_a_hint(x))
