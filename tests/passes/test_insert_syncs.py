"""Golden tests of ``insert_syncs``: forks, joins, minimal waits and deferred releases.

Each test traces a small function with explicit lane hints, runs the pipeline
up to ``assign_streams``, then ``insert_syncs`` alone (verifying after every
pass), and compares the canonical dump with the expected text. Besides the
dump, each test counts what must be minimal: one wait per real crossing, none
for a dependency that an earlier wait already implies.
"""

from __future__ import annotations

from expecttest import assert_expected_inline

from capturepass.ir import meta
from capturepass.ir.meta import Effect
from tests.helpers import sync_nodes
from tests.passes.cases import case_before_after


def _waits(gm) -> list[tuple[str, str]]:
    """(lane, why) of every wait, in program order."""
    return [(str(meta.lane_of(n)), meta.info(n).why) for n in sync_nodes(gm, Effect.WAIT)]


def test_fork_and_join_of_two_hinted_branches():
    gm, _, after, ctx = case_before_after("fork_join", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%mm->%add}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%mm->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")
    assert _waits(gm) == [("s1", "fork k0"), ("s0", "%mm->%add")]
    assert ctx.counters["insert_syncs"] == {"records": 2, "waits": 2}


def test_two_hinted_branches_share_one_fork_and_join_separately():
    gm, _, after, ctx = case_before_after("two_joins", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s1, hint=a1}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%mm->%add}
  %wait_default_1 : () = capturepass.wait(0, 2)  {lane=s2, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s2, hint=a2}
  %record_default_2 : () = capturepass.record(2, 2)  {lane=s2, record=e2, role=join, by=insert_syncs, why=%mm_1->%add}
  %wait_default_2 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%mm->%add}
  %wait_default_3 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, by=insert_syncs, why=%mm_1->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")
    # One fork record serves both aux lanes; %add needs both results: two joins.
    assert _waits(gm) == [("s1", "fork k0"), ("s2", "fork k0"), ("s0", "%mm->%add"), ("s0", "%mm_1->%add")]
    assert ctx.counters["insert_syncs"] == {"records": 3, "waits": 4}


def test_chain_needs_one_wait_per_crossing():
    gm, _, after, ctx = case_before_after("chain", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=%sin->%cos}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=%sin->%cos}
  %cos : f32[4,4] = aten.cos.default(%sin)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%cos->%exp}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%cos->%exp}
  %exp : f32[4,4] = aten.exp.default(%cos)  {lane=s0}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, by=insert_syncs, why=%exp->%neg}
  %release_default : () = capturepass.release([%sin], 0)  {lane=s0, by=insert_syncs, why=read by %cos}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, by=insert_syncs, why=%exp->%neg}
  %neg : f32[4,4] = aten.neg.default(%exp)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, by=insert_syncs, why=join k0}
  %release_default_1 : () = capturepass.release([%cos], 1)  {lane=s1, by=insert_syncs, why=read by %exp}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=join k0}
  return %neg  {lane=s0}
""")
    # Four crossings (main->aux->main->aux, then the join of aux for the output): four waits.
    # The first crossing also serves as aux's fork.
    assert _waits(gm) == [
        ("s1", "%sin->%cos"),
        ("s0", "%cos->%exp"),
        ("s1", "%exp->%neg"),
        ("s0", "join k0"),
    ]
    assert ctx.counters["insert_syncs"]["waits"] == 4


def test_transitively_implied_dependency_gets_no_wait():
    gm, _, after, ctx = case_before_after("diamond", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=a1 s2=a2; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s1, hint=a1}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%sin->%cos}
  %wait_default_1 : () = capturepass.wait(1, 2)  {lane=s2, wait=e1, role=join, by=insert_syncs, why=%sin->%cos}
  %cos : f32[4,4] = aten.cos.default(%sin)  {lane=s2, hint=a2}
  %record_default_2 : () = capturepass.record(2, 2)  {lane=s2, record=e2, role=join, by=insert_syncs, why=%cos->%add}
  %wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, by=insert_syncs, why=%cos->%add}
  %add : f32[4,4] = aten.add.Tensor(%sin, %cos)  {lane=s0}
  return %add  {lane=s0}
""")
    # %add reads %sin (a1) and %cos (a2); a2 already waited for a1, so one wait covers both,
    # and a2's fork is implied by a1's: three waits, not five.
    assert _waits(gm) == [("s1", "fork k0"), ("s2", "%sin->%cos"), ("s0", "%cos->%add")]


def test_cross_lane_read_of_main_storage_defers_its_release():
    gm, _, after, _ = case_before_after("deferred_release", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %sin : f32[4,4] = aten.sin.default(%x_1)  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=%sin->%cos}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=%sin->%cos}
  %cos : f32[4,4] = aten.cos.default(%sin)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%cos->%add}
  %exp : f32[4,4] = aten.exp.default(%x_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%cos->%add}
  %add : f32[4,4] = aten.add.Tensor(%cos, %exp)  {lane=s0}
  %release_default : () = capturepass.release([%sin], 0)  {lane=s0, by=insert_syncs, why=read by %cos}
  return %add  {lane=s0}
""")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    assert [a.name for a in release.all_input_nodes] == ["sin"]
    assert meta.lane_of(release) == meta.MAIN_LANE
    nodes = list(gm.graph.nodes)
    (join_wait,) = [n for n in sync_nodes(gm, Effect.WAIT) if meta.lane_of(n) == meta.MAIN_LANE]
    assert nodes.index(release) > nodes.index(join_wait)


def test_host_sync_joins_before_the_break_and_forks_after_it():
    gm, _, after, ctx = case_before_after("host_break", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %y_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=join k0}
  %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=join k0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, by=insert_syncs, why=fork k1}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, by=insert_syncs, why=fork k1}
  %sin : f32[4,4] = aten.sin.default(%y_1)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, by=insert_syncs, why=%sin->%mul}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=%sin->%mul}
  %mul : f32[4,4] = aten.mul.Tensor(%sin, %_local_scalar_dense)  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%cos, %mul)  {lane=s0}
  return %add  {lane=s0}
""")
    assert _waits(gm) == [("s1", "fork k0"), ("s0", "join k0"), ("s1", "fork k1"), ("s0", "%sin->%mul")]


def test_storage_read_in_a_later_segment_is_released_after_its_lane_stops():
    """Regression: ``%cos`` is allocated on aux in k0 and last read by ``%mul`` on main in k1.

    Host code frees it right after ``%mul``; aux then allocates ``%sin`` beside
    ``%mul`` (both only follow k1's fork), so without a deferred release the
    allocator may hand ``%cos``'s block to ``%sin`` while ``%mul`` still reads it.
    The lane layout used to look for later aux work in ``%cos``'s own segment
    (k0), found none, and inserted no release.
    """
    gm, _, after, _ = case_before_after("cross_segment_release", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=breakable
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %y_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=join k0}
  %sum_1 : f32[] = aten.sum.default(%x_1)  {lane=s0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=join k0}
  break b0: host sync: aten::_local_scalar_dense reads a tensor value on the host
  %_local_scalar_dense : float = aten._local_scalar_dense.default(%sum_1)  {lane=s0, break='host sync: aten::_local_scalar_dense reads a tensor value on the host', capturable=no}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, by=insert_syncs, why=fork k1}
  %mul : f32[4,4] = aten.mul.Tensor(%cos, 2)  {lane=s0}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, by=insert_syncs, why=fork k1}
  %sin : f32[4,4] = aten.sin.default(%y_1)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, by=insert_syncs, why=%sin->%add}
  %release_default : () = capturepass.release([%cos], 1)  {lane=s1, by=insert_syncs, why=read by %mul}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=%sin->%add}
  %add : f32[4,4] = aten.add.Tensor(%mul, %sin)  {lane=s0}
  return (%add, %_local_scalar_dense)  {lane=s0}
""")
    (release,) = sync_nodes(gm, Effect.RELEASE)
    assert [a.name for a in release.all_input_nodes] == ["cos"]
    assert meta.lane_of(release).index == 1
    nodes = list(gm.graph.nodes)
    sin = next(n for n in nodes if n.name == "sin")
    assert nodes.index(release) > nodes.index(sin)


def test_serialized_op_waits_for_every_lane_and_later_aux_work_waits_for_it():
    gm, _, after, _ = case_before_after("serialized", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %y_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %cos : f32[4,4] = aten.cos.default(%y_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=serialize %opaque}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=serialize %opaque}
  %opaque : f32[4,4] = cptest_passes.opaque.default(%x_1)  {lane=s0, overlap=serialize}
  %record_default_2 : () = capturepass.record(2, 0)  {lane=s0, record=e2, role=fork, by=insert_syncs, why=serialize %opaque}
  %wait_default_2 : () = capturepass.wait(2, 1)  {lane=s1, wait=e2, role=fork, by=insert_syncs, why=serialize %opaque}
  %sin : f32[4,4] = aten.sin.default(%cos)  {lane=s1, hint=aux}
  %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e3, role=join, by=insert_syncs, why=%sin->%add}
  %wait_default_3 : () = capturepass.wait(3, 0)  {lane=s0, wait=e3, role=join, by=insert_syncs, why=%sin->%add}
  %add : f32[4,4] = aten.add.Tensor(%opaque, %sin)  {lane=s0}
  return %add  {lane=s0}
# decision: %opaque: undeclared custom op cptest_passes::opaque: serialized, no other lane runs beside it
""")
    assert _waits(gm) == [
        ("s1", "fork k0"),
        ("s0", "serialize %opaque"),
        ("s1", "serialize %opaque"),
        ("s0", "%sin->%add"),
    ]


def test_auto_policy_branches():
    _, _, after, _ = case_before_after("auto_branches", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux0; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w1_1 : f32[4,4] = input  {lane=s0}
  %w2_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w1_1)  {lane=s0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm_1 : f32[4,4] = aten.mm.default(%x_1, %w2_1)  {lane=s1}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%mm_1->%add}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%mm_1->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, %mm_1)  {lane=s0}
  return %add  {lane=s0}
""")


def test_single_lane_graph_is_unchanged():
    _, before, after, ctx = case_before_after("single_lane", "insert_syncs")
    assert after == before
    assert "insert_syncs" not in ctx.counters


def test_policy_off_inserts_nothing():
    _, before, after, ctx = case_before_after("fork_join", "insert_syncs", policy="off")
    assert after == before
    assert "capturepass." not in after
    assert "insert_syncs" not in ctx.counters


def test_a_write_waits_for_an_earlier_read_on_another_lane():
    """Storage effects are dependencies: ``x.add_(1)`` on main overwrites what ``%mm`` reads on aux.
    With data edges alone nothing ordered them and the write could land before the read."""
    gm, _, after, ctx = case_before_after("write_after_read", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none; writes inputs %x_1
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %mm : f32[4,4] = aten.mm.default(%x_1, %w_1)  {lane=s1, hint=aux}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%mm->%add_ (war %x_1)}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%mm->%add_ (war %x_1)}
  %add_ : f32[4,4] = aten.add_.Tensor(%x_1, 1)  {lane=s0, writes=%x_1}
  return %mm  {lane=s0}
""")
    assert ctx.counters["insert_syncs"] == {"records": 2, "waits": 2}


def test_a_read_waits_for_an_earlier_write_through_a_view():
    gm, _, after, ctx = case_before_after("read_after_write", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none; writes inputs %x_1
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %w_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %cos : f32[4,4] = aten.cos.default(%w_1)  {lane=s1, hint=aux}
  %select : f32[4] = aten.select.int(%x_1, 0, 0)  {lane=s0}
  %mul_ : f32[4] = aten.mul_.Tensor(%select, 2)  {lane=s0, writes=%x_1}
  %record_default_1 : () = capturepass.record(1, 0)  {lane=s0, record=e1, role=fork, by=insert_syncs, why=%mul_->%mm (raw %x_1)}
  %wait_default_1 : () = capturepass.wait(1, 1)  {lane=s1, wait=e1, role=fork, by=insert_syncs, why=%mul_->%mm (raw %x_1)}
  %mm : f32[4,4] = aten.mm.default(%x_1, %cos)  {lane=s1, hint=aux}
  %record_default_2 : () = capturepass.record(2, 1)  {lane=s1, record=e2, role=join, by=insert_syncs, why=%mm->%add}
  %wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, by=insert_syncs, why=%mm->%add}
  %add : f32[4,4] = aten.add.Tensor(%mm, 1)  {lane=s0}
  return %add  {lane=s0}
""")
    assert ctx.counters["insert_syncs"] == {"records": 3, "waits": 3}


def test_random_draws_keep_program_order_across_lanes():
    gm, _, after, ctx = case_before_after("random_order", "insert_syncs")
    assert_expected_inline(after, """\
# graph inference: lanes s0=main s1=aux; cudagraphs=none
owner g0:
  %x_1 : f32[4,4] = input  {lane=s0}
  %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, by=insert_syncs, why=fork k0}
  %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, by=insert_syncs, why=fork k0}
  %rand_like : f32[4,4] = aten.rand_like.default(%x_1, pin_memory=False)  {lane=s1, hint=aux, writes=rng}
  %record_default_1 : () = capturepass.record(1, 1)  {lane=s1, record=e1, role=join, by=insert_syncs, why=%rand_like->%rand_like_1 (raw rng)}
  %mul : f32[4,4] = aten.mul.Tensor(%rand_like, %x_1)  {lane=s1, hint=aux}
  %record_default_2 : () = capturepass.record(2, 1)  {lane=s1, record=e2, role=join, by=insert_syncs, why=join k0}
  %wait_default_1 : () = capturepass.wait(1, 0)  {lane=s0, wait=e1, role=join, by=insert_syncs, why=%rand_like->%rand_like_1 (raw rng)}
  %rand_like_1 : f32[4,4] = aten.rand_like.default(%x_1, pin_memory=False)  {lane=s0, writes=rng}
  %cos : f32[4,4] = aten.cos.default(%x_1)  {lane=s0}
  %add : f32[4,4] = aten.add.Tensor(%rand_like_1, %cos)  {lane=s0}
  %wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, by=insert_syncs, why=join k0}
  return (%mul, %add)  {lane=s0}
""")
    assert ctx.counters["insert_syncs"] == {"records": 3, "waits": 3}
