"""Golden tests of ``read_hints``: lane hints become typed metadata and the transport tag goes.

The first ATen-stage pass gives every node its record. Hints show up as
``hint=`` in the dump; ``meta["custom"]`` must be gone from every node so that
no capturepass tag reaches an inner compiler. With ``policy="off"`` the hints
are dropped and the drop is recorded as a decision.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import capturepass
from capturepass.errors import HintError
from capturepass.ir import meta
from capturepass.ir.meta import Effect
from tests.helpers import aten_graph, dump, run_passes
from tests.passes.cases import before_after, case_before_after


def test_hints_become_typed_metadata_and_tags_are_stripped():
    gm, _, after, ctx = case_before_after("two_joins", "read_hints")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input
  %w1_1 : f32[4,4] = input
  %w2_1 : f32[4,4] = input
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {hint=a1}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {hint=a2}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)
  return %add
""")
    assert all("custom" not in n.meta for n in gm.graph.nodes)
    assert all(meta.has_info(n) for n in gm.graph.nodes)
    assert ctx.counters["read_hints"]["hinted_nodes"] == 2


def test_effects_are_derived_from_node_kinds():
    gm, _, _, _ = case_before_after("fork_join", "read_hints")
    effects = {n.name: meta.info(n).effect for n in gm.graph.nodes}
    assert effects == {
        "x_1": Effect.INPUT,
        "w1_1": Effect.INPUT,
        "w2_1": Effect.INPUT,
        "mm": Effect.COMPUTE,
        "mm_1": Effect.COMPUTE,
        "add": Effect.COMPUTE,
        "output": Effect.OUTPUT,
    }


def test_innermost_hint_wins():
    def nested(x):
        with capturepass.lane("outer"):
            a = x.sin()
            with capturepass.lane("inner"):
                b = a.cos()
        return a + b

    gm = aten_graph(nested, torch.randn(4, 4))
    run_passes(gm, upto="read_hints", policy="hints")
    assert_expected_inline(dump(gm), """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input
  %sin : f32[4,4] = aten.sin.default(%x_1)  {hint=outer}
  %cos : f32[4,4] = aten.cos.default(%sin)  {hint=inner}
  %add : f32[4,4] = aten.add.Tensor(%sin, %cos)
  return %add
""")


def test_graph_without_hints_is_unchanged():
    _, before, after, ctx = case_before_after("single_lane", "read_hints")
    assert after == before
    assert "read_hints" not in ctx.counters


def test_policy_off_drops_hints_and_says_so():
    gm, _, after, ctx = case_before_after("two_joins", "read_hints", policy="off")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input
  %w1_1 : f32[4,4] = input
  %w2_1 : f32[4,4] = input
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)
  return %add
# decision: policy=off: ignored the lane hints of 2 node(s)
""")
    assert all(meta.info(n).hint is None for n in gm.graph.nodes)
    assert all("custom" not in n.meta for n in gm.graph.nodes)
    assert "read_hints" not in ctx.counters


def test_other_custom_metadata_survives():
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 4))
    sin = next(n for n in gm.graph.nodes if n.name == "sin")
    sin.meta["custom"] = {"capturepass": {"lane": "aux"}, "stream": 3, "user_key": 1}
    before_after(gm, "read_hints", policy="hints")
    assert sin.meta["custom"] == {"user_key": 1}
    assert meta.info(sin).hint == "aux"


@pytest.mark.parametrize(
    "tag, message",
    [
        ({"lane": "main"}, "names the main lane"),
        ({"lane": ""}, "malformed capturepass hint"),
        ("aux", "malformed capturepass hint"),
    ],
)
def test_bad_hint_tags_are_refused(tag, message):
    gm = aten_graph(lambda x: x.sin(), torch.randn(4, 4))
    sin = next(n for n in gm.graph.nodes if n.name == "sin")
    sin.meta["custom"] = {"capturepass": tag}
    with pytest.raises(HintError, match=message) as info:
        run_passes(gm, upto="read_hints", policy="hints")
    assert "%sin" in str(info.value)
