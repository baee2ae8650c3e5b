"""Tests of the canonical dump and its JSON form.

Golden tests compare dumps across runs, so the text must not depend on
anything but the graph: events, leases and segments are renumbered in print
order, anything that looks like a pointer is scrubbed, and two traces of the
same function print the same text. The graph owner prints as its own id (the
one runtime owner names start with), or renumbered too with
``PrintSettings(canonical_owners=True)``, which the golden tests use.
"""

from __future__ import annotations

import json
import re

import torch
import torch.fx as fx
from expecttest import assert_expected_inline

import capturepass
from capturepass.ir import meta, printer
from capturepass.ir.meta import Effect, EventId, LaneId
from tests.helpers import aten_graph, dump, run_passes, sync_nodes
from tests.passes.cases import CASES, build

L = capturepass.lane


def out_of_order(x):
    """insert_syncs makes the event after ``%cos`` first, but the one after ``%sin`` prints first."""
    a = x.sin()
    b = x.cos()
    with L("a1"):
        c = b.exp()
    with L("a2"):
        d = a.neg()
    return c + d


def _partitioned(fn, *inputs, **kwargs) -> fx.GraphModule:
    gm = aten_graph(fn, *inputs, **kwargs)
    run_passes(gm, upto="partition", policy="hints")
    return gm


def test_two_traces_print_the_same_text():
    for name in ("host_break", "two_joins", "retention"):
        first, _ = build(name, "partition")
        second, _ = build(name, "partition")
        assert meta.graph_info(first).owner != meta.graph_info(second).owner
        assert dump(first) == dump(second)
        canonical = printer.PrintSettings(canonical_owners=True)
        assert printer.dumps_json(first, canonical) == printer.dumps_json(second, canonical)
        assert dump(first, cost=True, provenance=True) == dump(second, cost=True, provenance=True)


def test_events_are_numbered_in_print_order():
    gm = _partitioned(out_of_order, torch.randn(4, 4))
    records = sync_nodes(gm, Effect.RECORD)
    assert [meta.info(n).event.index for n in records] == [1, 0, 2, 3]  # the order insert_syncs made them
    text = dump(gm)
    assert re.findall(r"record=(e\d+)", text) == ["e0", "e1", "e2", "e3"]
    assert re.findall(r"lease=(l\d+)", text)[0] == "l0"
    assert_expected_inline(text, """\
# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0, owner=g0}
  segment k0:
    %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s0, owner=g0, segment=k0}
    %record_default_1 : () = capturepass.record(1, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sin->%neg}
    %cos : f32[4,4] = aten.cos.default(%x_1)  {lane=s0, owner=g0, segment=k0}
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e1, role=fork, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%cos->%exp}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e1, role=fork, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%cos->%exp}
    %exp : f32[4,4] = aten.exp.default(%cos)  {lane=s1, hint=a1, owner=g0, segment=k0}
    %record_default_2 : () = capturepass.record(2, 1)  {lane=s1, record=e2, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%exp->%add}
    %wait_default_1 : () = capturepass.wait(1, 2)  {lane=s2, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sin->%neg}
    %neg : f32[4,4] = aten.neg.default(%sin)  {lane=s2, hint=a2, owner=g0, segment=k0}
    %record_default_3 : () = capturepass.record(3, 2)  {lane=s2, record=e3, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%neg->%add}
    %wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%exp->%add}
    %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%neg->%add}
    %add : f32[4,4] = aten.add.Tensor(%exp, %neg)  {lane=s0, owner=g0, segment=k0}
    %release_default_1 : () = capturepass.release([%sin], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %neg}
    %release_default : () = capturepass.release([%cos], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %exp}
  return %add  {lane=s0, owner=g0}
""")


def test_json_uses_the_same_ids():
    gm = _partitioned(out_of_order, torch.randn(4, 4))
    owner = f"g{meta.graph_info(gm).owner.index}"
    for settings, want in ((None, owner), (printer.PrintSettings(canonical_owners=True), "g0")):
        data = json.loads(printer.dumps_json(gm, settings))
        by_name = {n["name"]: n for n in data["nodes"]}
        matched = 0
        for line in printer.dump(gm, settings=settings).splitlines():
            m = re.match(r"\s*%(\w+) .*record=(e\d+), role=\w+, lease=(l\d+), owner=(g\d+), segment=(k\d+)", line)
            if m:
                node = by_name[m.group(1)]
                assert (node["event"], node["lease"], node["owner"], node["segment"]) == m.groups()[1:]
                matched += 1
        assert matched == 4
        assert data["owner"] == want and data["segments"] == ["k0"]
        assert data["lanes"] == ["main", "a1", "a2"]


def test_dumps_name_each_graph_by_its_own_owner():
    """Two compiled graphs: two owner names, each the graph's own id (canonical: both ``g0``)."""
    first, _ = build("two_joins", "partition")
    second, _ = build("two_joins", "partition")
    names = []
    for gm in (first, second):
        owner = f"g{meta.graph_info(gm).owner.index}"
        text = printer.dump(gm)
        assert f"owner {owner}:" in text
        assert set(re.findall(r"owner=(g\d+)", text)) == {owner}
        assert json.loads(printer.dumps_json(gm))["owner"] == owner
        names.append(owner)
    assert names[0] != names[1]
    assert printer.dump(first) != printer.dump(second)
    assert dump(first) == dump(second)  # canonical: the golden tests' form


def test_owner_segment_and_break_ids_start_at_zero():
    gm, _ = build("host_break", "partition")
    assert meta.graph_info(gm).owner.index >= 1000
    text = dump(gm)
    assert "owner g0:" in text
    assert re.findall(r"^\s*segment (k\d+):", text, re.M) == ["k0", "k1"]
    assert re.findall(r"^\s*break (b\d+):", text, re.M) == ["b0"]
    assert set(re.findall(r"owner=(g\d+)", text)) == {"g0"}


class _Opaque:
    """A callable without a ``__name__``, whose repr carries its address."""

    def __call__(self, x, y):
        return x


def test_pointers_are_scrubbed():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.create_node("call_function", torch.ops.aten.add.Tensor, (x, x), name="y")
    g.output(y)
    gm = fx.GraphModule(torch.nn.Module(), g)
    # FX cannot generate code for these; the dump must still print them without addresses.
    blob = object()
    y.target = _Opaque()
    y.args = (x, blob)
    meta.set_graph_info(gm, meta.GraphInfo())
    meta.update(y, "test", why=f"made at {hex(id(blob))}")
    meta.add_decision(gm, f"kept {blob!r}")
    assert hex(id(blob)) in repr(blob)
    text = dump(gm)
    assert "0x?" in text
    assert not re.search(r"0x[0-9a-fA-F]+", text), text
    data = printer.dumps_json(gm)
    assert not re.search(r"0x[0-9a-fA-F]+", data), data
    assert_expected_inline(re.sub(r"<[\w.]*\._Opaque", "<_Opaque", text), """\
# graph graph: lanes s0=main; cudagraphs=none
owner g0:
  %x : () = input
  %y : () = <_Opaque object at 0x?>(%x, <object object at 0x?>)  {why=made at 0x?}
  return %y
# decision: kept <object object at 0x?>
""")


def test_settings_toggle_types_provenance_cost_and_capability():
    gm, _ = build("host_break", "assign_streams")
    item = next(n for n in gm.graph.nodes if n.name == "_local_scalar_dense")
    gi = meta.graph_info(gm)

    def line(**settings):
        return printer.format_node(item, gi, printer._Canon(), printer.PrintSettings(**settings))

    assert_expected_inline(line(), """%_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}""")
    assert_expected_inline(
        line(shapes=False, provenance=True, cost=True, capability=False), """%_local_scalar_dense = aten._local_scalar_dense.default(%sum_1)  {lane=s0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', cost=0fl/4B, changed=annotate_capabilities,assign_streams}"""
    )


def test_types():
    assert printer.format_type(torch.empty(2, 3, dtype=torch.float16)) == "f16[2,3]"
    assert printer.format_type((torch.empty(1), torch.empty(0, dtype=torch.int64))) == "(f32[1], i64[0])"
    assert printer.format_type(3) == "int"
    assert printer.format_type(2.5) == "float"
    assert printer.format_type(True) == "bool"
    assert printer.format_type(None) == "()"


def test_title_and_lanes_header():
    gm, _ = build("diamond", "assign_streams")
    text = printer.dump(gm, title="after assign_streams")
    assert text.splitlines()[:2] == [
        "# after assign_streams",
        "# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none",
    ]


def test_every_case_dumps_without_raw_ids():
    for name in CASES:
        gm, _ = build(name, "partition")
        text = dump(gm)
        owner = meta.graph_info(gm).owner
        assert f"g{owner.index}" not in text
        assert "LaneId(" not in text and "EventId(" not in text and "LeaseId(" not in text


def test_renumbering_ignores_raw_event_values():
    gm, _ = build("fork_join", "partition")
    before = dump(gm)
    for node in sync_nodes(gm, Effect.RECORD) + sync_nodes(gm, Effect.WAIT):
        meta.update(node, "test", event=EventId(meta.info(node).event.index + 40))
    assert dump(gm) == before
    meta.update(sync_nodes(gm, Effect.RECORD)[0], "test", lane=LaneId(0))
    assert dump(gm) == before  # it was on s0 already
