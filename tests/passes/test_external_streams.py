"""External streams: declared by option, joined at every segment boundary, known to the verifier.

The GPU half (a real copy stream joined under capture and at replay) is in
``tests/runtime/test_cuda_runtime.py``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import capturepass
from capturepass.errors import OptionError, VerificationError
from capturepass.ir import meta, ops, verify
from capturepass.ir.meta import Effect
from capturepass.ir.options import Options
from capturepass.testing.mutate import apply, mutants
from tests.helpers import aten_graph, dump, run_passes


def _fn(x, w):
    a = x @ w
    with capturepass.lane("aux"):
        b = (x * 2) @ w
    s = (a + b).sum()
    k = s.item()  # a host sync: a break between two segments
    return (a * k).relu()


def _graph(external):
    gm = aten_graph(_fn, torch.randn(4, 4), torch.randn(4, 4), cudagraphs="breakable")
    meta.update_graph(gm, external=external)
    return gm


def test_joins_at_every_segment_boundary():
    gm = _graph((("comm", "after"), ("offload", "before")))
    run_passes(gm, upto="partition", policy="hints", cudagraphs="breakable")
    assert_expected_inline(dump(gm), """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable; external x0=comm(after) x1=offload(before)
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0, owner=g0}
  %w_1 : f32[4,4] = input  {lane=s0, owner=g0}
  segment k0:
    %join_external_default : () = capturepass.join_external(1, 0, True)  {lane=s0, external=offload, role=in, owner=g0, segment=k0, by=insert_syncs, why=start of k0}
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %mm : f32[4,4] = aten.mm.default(%x_1, %w_1)  {lane=s0, owner=g0, segment=k0}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %mul : f32[4,4] = aten.mul.Tensor(%x_1, 2)  {lane=s1, hint=aux, owner=g0, segment=k0}
    %mm_1 : f32[4,4] = aten.mm.default(%mul, %w_1)  {lane=s1, hint=aux, owner=g0, segment=k0}
    %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm_1->%add}
    %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%mm_1->%add}
    %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0, owner=g0, segment=k0}
    %sum_1 : f32[] = aten.sum.default(%add)  {lane=s0, owner=g0, segment=k0}
    %join_external_default_1 : () = capturepass.join_external(0, 0, False)  {lane=s0, external=comm, role=out, owner=g0, segment=k0, by=insert_syncs, why=end of k0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, owner=g0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  segment k1:
    %join_external_default_2 : () = capturepass.join_external(1, 0, True)  {lane=s0, external=offload, role=in, owner=g0, segment=k1, by=insert_syncs, why=start of k1}
    %mul_1 : f32[4,4] = aten.mul.Tensor(%mm, %_local_scalar_dense)  {lane=s0, owner=g0, segment=k1}
    %relu : f32[4,4] = aten.relu.default(%mul_1)  {lane=s0, owner=g0, segment=k1}
    %join_external_default_3 : () = capturepass.join_external(0, 0, False)  {lane=s0, external=comm, role=out, owner=g0, segment=k1, by=insert_syncs, why=end of k1}
  return %relu  {lane=s0, owner=g0}
""")


def _break(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


@pytest.mark.parametrize(
    "mutation, message",
    [
        ("drop_in", r"starts a segment without joining external stream 'offload' \(before\) into s0"),
        ("drop_out", r"ends a segment without joining external stream 'comm' \(after\) out of s0"),
        ("moved_in", r"%record_default .*starts a segment without joining external stream 'offload' \(before\)"),
        ("late_in", r"joins external stream 'offload' into s0 after the segment's work began"),
        ("early_out", r"joins s0 out to external stream 'comm', but lane s1 \(aux\) has not joined s0"),
        ("work_after_out", r"%mul .*runs on s1 after the segment joined s0 out to external stream\(s\) comm"),
        ("undeclared", r"joins external stream 'comm', which the graph does not declare \(declared: offload\)"),
    ],
)
def test_verifier_rejects_broken_joins(mutation, message):
    gm = _graph((("comm", "after"), ("offload", "before")))
    run_passes(gm, upto="partition", policy="hints", cudagraphs="breakable")
    graph = gm.graph
    joins = [n for n in graph.nodes if meta.effect_of(n) is Effect.EXTERNAL]
    first_in, first_out = joins[0], joins[1]
    if mutation == "drop_in":
        graph.erase_node(first_in)
    elif mutation == "drop_out":
        graph.erase_node(first_out)
    elif mutation == "moved_in":
        _break(gm, "mm").append(first_in)
    elif mutation == "late_in":  # a second join of the stream, after the segment's first kernel
        ops.insert_join_external(graph, _break(gm, "mm").next, 1, "offload", True, "test", "late")
    elif mutation == "early_out":
        _break(gm, "mm_1").append(first_out)
    elif mutation == "work_after_out":
        _break(gm, "mul").prepend(first_out)
    elif mutation == "undeclared":
        meta.update_graph(gm, external=(("offload", "before"),))
    with pytest.raises(VerificationError, match=message) as info:
        verify.verify(gm)
    assert info.value.rule == "external-join"


def test_every_removed_join_is_rejected():
    gm = _graph((("comm", "both"),))
    run_passes(gm, upto="verify", policy="hints", cudagraphs="breakable")
    removed = [m for m in mutants(gm) if m.kind == "external"]
    assert len(removed) == 4  # in and out, two segments
    for m in removed:
        with pytest.raises(VerificationError) as info:
            verify.verify(apply(gm, m))
        assert info.value.rule == "external-join"


def test_end_to_end_on_the_host_counts_every_join():
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def f(x, w):
        a = x @ w
        with capturepass.lane("aux"):
            b = (x * 2) @ w
        return (a + b).relu()

    compiled = torch.compile(f, backend="capturepass", options={
        "inner": "eager", "cudagraphs": "breakable", "external_streams": {"offload": "before", "comm": "both"}})
    for _ in range(3):
        torch.testing.assert_close(compiled(x, w), f(x, w))
    executor = capturepass.backends.compile.last_compiled()[-1].executor
    counters = executor.owners[-1].lanes("eager").counters
    assert counters["external_in:offload"] == 3 and counters["external_in:comm"] == 3
    assert counters["external_out:comm"] == 3 and counters["external_out:offload"] == 0


@pytest.mark.parametrize(
    "value, message",
    [
        ({"offload": "sometimes"}, r"stream 'offload' has relation 'sometimes'; valid relations are 'before', 'after', 'both'"),
        ({"not a name": "before"}, r"stream name 'not a name' must be an identifier"),
        (42, r"option 'external_streams' must map stream names to one of"),
        ([("a", "before"), ("a", "after")], r"names a stream twice"),
    ],
)
def test_option_is_validated(value, message):
    with pytest.raises(OptionError, match=message):
        Options.from_mapping({"external_streams": value})


def test_option_is_normalized_and_part_of_the_key():
    a = Options.from_mapping({"external_streams": {"offload": "before", "comm": "after"}})
    assert a.external_streams == (("comm", "after"), ("offload", "before"))
    assert a.key() != Options.from_mapping({}).key()


def test_binding_errors():
    from capturepass.errors import ResourceError
    from capturepass.runtime import external

    with pytest.raises(ResourceError, match="is declared .* but not bound: call capturepass.external_stream"):
        external.bound_stream("nobody")
    with pytest.raises(ResourceError, match="must be a torch.cuda.Stream, got int"):
        capturepass.external_stream("offload", 3)
