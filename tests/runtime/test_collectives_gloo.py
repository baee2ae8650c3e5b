"""The parallel MoE blocks on two CPU processes joined by gloo: uncaptured, equal to the references.

One run (a module fixture) spawns two processes (``capturepass.testing.parallel.check_blocks``;
a file in a temporary directory is the rendezvous: no network) that each compile three models
with ``torch.compile(backend="capturepass")`` and the eager inner compiler:

- ``tp``: the tensor-parallel block (shared expert column- then row-parallel, summed by an
  all-reduce; routed experts 4 per rank of 8, summed by their own all-reduce), with
  ``max_aux_lanes=0`` so that its dump shows the comm lane alone beside main;
- ``ep``: the expert-parallel block (the shared expert replicated, the routed experts 4 per
  rank of 8, dispatched and combined by two fixed-capacity ``all_to_all_single``), default
  options;
- ``draft``: a second tensor-parallel model instance of another block, written with in-place
  ``dist.all_reduce``: a second owner beside ``tp``.

Each model is called with 8 tokens, 8 new ones (the same compiled graph) and 5 (a recompile).
Every output must equal, to the last bit, the ranks' computation redone in one process in their
op order from the same weights (the eager inner compiler runs the ATen kernels eager runs, with
one thread; gloo's sum of two floats is the same in either order; an all-to-all only moves
rows), and the full single-process block within torch's float32 tolerance (rtol 1.3e-6,
atol 1e-5): the full block computes the shared expert's down projection as one 64-term dot
product where tensor parallelism sums two 32-term halves, so the last bits differ (the run
measures about 1.4e-6 at outputs of order one).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from expecttest import assert_expected_inline

from capturepass.testing import parallel

_REASON = parallel.gloo_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

TOKENS = (8, 8, 5)
MODELS = ("draft", "ep", "tp")
COLLECTIVES_PER_CALL = 2  # two all-reduces (tp, draft), two all-to-alls (ep)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("gloo")
    parallel.spawn_ranks(parallel.check_blocks, 2, str(out), {"inner": "eager"}, {"tp": {"max_aux_lanes": 0}},
                        TOKENS, True, timeout=240)
    return out


def _report(run: pathlib.Path, rank: int) -> dict:
    return json.loads((run / f"rank{rank}.json").read_text())


def _graph_dumps(root: pathlib.Path) -> list[str]:
    """The final dump text (after ``verify``) of each graph under ``root``, in compile order."""
    return [p.read_text() for p in sorted(root.glob("*/009_verify.txt"))]


_canonical = parallel.canonical_dump
_schedule = parallel.schedule_lines


def _owner_number(key: str) -> int:
    """The number of an owner (``"g11.m0/s1"``: 11): owners are numbered as they are made."""
    return int(re.match(r"g(\d+)\.", key)[1])


def test_every_call_equals_the_references(run):
    for rank in range(2):
        errors = _report(run, rank)["errors"]
        assert sorted(errors) == list(MODELS)
        for model, calls in errors.items():
            assert len(calls) == len(TOKENS)
            # Checked in the workers too (assert_close with atol=rtol=0, and the float32 tolerance).
            assert all(c["same_order"] == 0.0 for c in calls), (rank, model, calls)
            assert all(c["full"] <= 1e-5 for c in calls), (rank, model, calls)


def test_each_owner_posts_on_its_own_process_group(run):
    reports = [_report(run, r) for r in range(2)]
    for report in reports:
        # Two owners per model (its graphs for 8 and for 5 tokens), each with its own group on the
        # comm lane (s1) standing for the traced world group '0'.
        owners = {model: sorted(report["communicators"][model], key=_owner_number) for model in MODELS}
        assert all(len(keys) == 2 and all(re.fullmatch(r"g\d+\.m0/s1", k) for k in keys) for keys in owners.values())
        assert all(list(ch) == ["0"] for model in MODELS for ch in report["communicators"][model].values())
        names = {model: [ch["0"] for ch in report["communicators"][model].values()] for model in MODELS}
        flat = [n for model in MODELS for n in names[model]]
        assert len(set(flat)) == 6 and "0" not in flat
        assert set(report["ranks"]) == set(flat) and all(r == [0, 1] for r in report["ranks"].values())
        if report["world_posted"] is not None:
            # The collectives went to the owners' groups: the group the graphs were traced with
            # posted nothing, and each owner's group exactly its graph's collectives.
            assert report["world_posted"] == 0
            for model in MODELS:
                first, second = (report["communicators"][model][k]["0"] for k in owners[model])
                assert report["posted"][first] == 2 * COLLECTIVES_PER_CALL  # 8 tokens, twice
                assert report["posted"][second] == COLLECTIVES_PER_CALL  # 5 tokens, once
    # Released by capturepass.release before the world went: none left.
    assert all(report["released"] == [] for report in reports)
    # Every rank makes its groups in the same order: the same names on both.
    assert reports[0]["communicators"] == reports[1]["communicators"]


def test_both_ranks_schedule_alike(run):
    # Every rank runs the same program (its own experts aside: a slice's bounds) and schedules it
    # the same way.
    for model in MODELS:
        dumps = [[_schedule(text) for text in _graph_dumps(run / f"rank{r}" / model)] for r in range(2)]
        assert len(dumps[0]) == 2 and dumps[0] == dumps[1]


def test_tensor_parallel_dump(run):
    """The shared expert's all-reduce starts on the comm lane (s1) as soon as the shared expert
    is done; the routed experts compute on main meanwhile (11 kernels); the waits are on s1 and
    the add reads both results through them (one join). Both collectives use the owner's
    communicator for the traced group '0' on s1."""
    tp = _canonical(_graph_dumps(run / "rank0" / "tp")[0])
    assert_expected_inline(tp, """\
# after verify
# graph inference: lanes s0=main s1=comm; cudagraphs=none
owner g0:
  %arg0_1 : f32[32,32] = input  {lane=s0, owner=g0}
  %arg1_1 : f32[8,32] = input  {lane=s0, owner=g0}
  %arg2_1 : f32[32,32] = input  {lane=s0, owner=g0}
  %arg3_1 : f32[32,32] = input  {lane=s0, owner=g0}
  %arg4_1 : f32[8,32] = input  {lane=s0, owner=g0}
  %arg5_1 : f32[4,32,32] = input  {lane=s0, owner=g0}
  %arg6_1 : f32[4,16,32] = input  {lane=s0, owner=g0}
  segment k0:
    %t : f32[32,32] = aten.t.default(%arg0_1)  {lane=s0, owner=g0, segment=k0}
    %mm : f32[8,32] = aten.mm.default(%arg1_1, %t)  {lane=s0, owner=g0, segment=k0}
    %silu : f32[8,32] = aten.silu.default(%mm)  {lane=s0, owner=g0, segment=k0}
    %t_1 : f32[32,32] = aten.t.default(%arg2_1)  {lane=s0, owner=g0, segment=k0}
    %mm_1 : f32[8,32] = aten.mm.default(%arg1_1, %t_1)  {lane=s0, owner=g0, segment=k0}
    %mul : f32[8,32] = aten.mul.Tensor(%silu, %mm_1)  {lane=s0, owner=g0, segment=k0}
    %t_2 : f32[32,32] = aten.t.default(%arg3_1)  {lane=s0, owner=g0, segment=k0}
    %mm_2 : f32[8,32] = aten.mm.default(%mul, %t_2)  {lane=s0, owner=g0, segment=k0}
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%all_reduce}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%all_reduce}
    %all_reduce : f32[8,32] = _c10d_functional.all_reduce.default(%mm_2, 'sum', '0')  {lane=s1, owner=g0, segment=k0, resources=[comm:0@g0/s1]}
    %t_3 : f32[32,8] = aten.t.default(%arg4_1)  {lane=s0, owner=g0, segment=k0}
    %mm_3 : f32[8,8] = aten.mm.default(%arg1_1, %t_3)  {lane=s0, owner=g0, segment=k0}
    %topk : (f32[8,2], i64[8,2]) = aten.topk.default(%mm_3, 2)  {lane=s0, owner=g0, segment=k0}
    %getitem : f32[8,2] = getitem(%topk, 0)  {lane=s0, owner=g0, segment=k0}
    %getitem_1 : i64[8,2] = getitem(%topk, 1)  {lane=s0, owner=g0, segment=k0}
    %_softmax : f32[8,2] = aten._softmax.default(%getitem, -1, False)  {lane=s0, owner=g0, segment=k0}
    %zeros : f32[8,8] = aten.zeros.default([8, 8], dtype=torch.float32, device=device(type='cpu'), pin_memory=False)  {lane=s0, owner=g0, segment=k0}
    %scatter : f32[8,8] = aten.scatter.src(%zeros, 1, %getitem_1, %_softmax)  {lane=s0, owner=g0, segment=k0}
    %slice_1 : f32[8,4] = aten.slice.Tensor(%scatter, 1, 0, 4)  {lane=s0, owner=g0, segment=k0}
    %unsqueeze : f32[1,8,32] = aten.unsqueeze.default(%arg1_1, 0)  {lane=s0, owner=g0, segment=k0}
    %expand : f32[4,8,32] = aten.expand.default(%unsqueeze, [4, 8, 32])  {lane=s0, owner=g0, segment=k0}
    %bmm : f32[4,8,32] = aten.bmm.default(%expand, %arg5_1)  {lane=s0, owner=g0, segment=k0}
    %split : (f32[4,8,16], f32[4,8,16]) = aten.split.Tensor(%bmm, 16, -1)  {lane=s0, owner=g0, segment=k0}
    %getitem_2 : f32[4,8,16] = getitem(%split, 0)  {lane=s0, owner=g0, segment=k0}
    %getitem_3 : f32[4,8,16] = getitem(%split, 1)  {lane=s0, owner=g0, segment=k0}
    %silu_1 : f32[4,8,16] = aten.silu.default(%getitem_2)  {lane=s0, owner=g0, segment=k0}
    %mul_1 : f32[4,8,16] = aten.mul.Tensor(%silu_1, %getitem_3)  {lane=s0, owner=g0, segment=k0}
    %bmm_1 : f32[4,8,32] = aten.bmm.default(%mul_1, %arg6_1)  {lane=s0, owner=g0, segment=k0}
    %t_4 : f32[4,8] = aten.t.default(%slice_1)  {lane=s0, owner=g0, segment=k0}
    %unsqueeze_1 : f32[4,8,1] = aten.unsqueeze.default(%t_4, -1)  {lane=s0, owner=g0, segment=k0}
    %mul_2 : f32[4,8,32] = aten.mul.Tensor(%bmm_1, %unsqueeze_1)  {lane=s0, owner=g0, segment=k0}
    %sum_1 : f32[8,32] = aten.sum.dim_IntList(%mul_2, [0])  {lane=s0, owner=g0, segment=k0}
    %record_default_1 : () = capturepass.record(1, 0)  {lane=s0, record=e1, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sum_1->%all_reduce_1}
    %wait_default_1 : () = capturepass.wait(1, 1)  {lane=s1, wait=e1, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sum_1->%all_reduce_1}
    %all_reduce_1 : f32[8,32] = _c10d_functional.all_reduce.default(%sum_1, 'sum', '0')  {lane=s1, owner=g0, segment=k0, resources=[comm:0@g0/s1]}
    %wait_tensor : f32[8,32] = _c10d_functional.wait_tensor.default(%all_reduce)  {lane=s1, owner=g0, segment=k0}
    %wait_tensor_1 : f32[8,32] = _c10d_functional.wait_tensor.default(%all_reduce_1)  {lane=s1, owner=g0, segment=k0}
    %record_default_2 : () = capturepass.record(2, 1)  {lane=s1, record=e2, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor_1->%add}
    %wait_default_2 : () = capturepass.wait(2, 0)  {lane=s0, wait=e2, role=join, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor_1->%add}
    %add : f32[8,32] = aten.add.Tensor(%wait_tensor, %wait_tensor_1)  {lane=s0, owner=g0, segment=k0}
    %release_default_1 : () = capturepass.release([%sum_1], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %all_reduce_1,%wait_tensor_1}
    %release_default : () = capturepass.release([%mm_2], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %all_reduce,%wait_tensor}
  return (%add,)  {lane=s0, owner=g0}
# decision: %all_reduce: collective on group '0' (ranks 0,1) on lane comm; 11 kernel(s) issued before %wait_tensor
# decision: %all_reduce_1: collective on group '0' (ranks 0,1) on lane comm; 0 kernel(s) issued before %wait_tensor_1
""")


def test_expert_parallel_dump(run):
    """The dispatch all-to-all starts on the comm lane (s1) once the router's buffer is ready;
    the shared expert computes on the auxiliary lanes (s2, s3) between it and its wait (5
    kernels); the routed experts on main read the received rows through the wait; the combine
    all-to-all follows, with nothing left to overlap it. Both use the owner's communicator for
    the traced group '0' on s1."""
    ep = _canonical(_graph_dumps(run / "rank0" / "ep")[0])
    assert_expected_inline(ep, """\
# after verify
# graph inference: lanes s0=main s1=comm s2=aux0 s3=aux1; cudagraphs=none
owner g0:
  %arg0_1 : f32[8,32] = input  {lane=s0, owner=g0}
  %arg1_1 : f32[64,32] = input  {lane=s0, owner=g0}
  %arg2_1 : f32[64,32] = input  {lane=s0, owner=g0}
  %arg3_1 : f32[32,64] = input  {lane=s0, owner=g0}
  %arg4_1 : f32[8,32] = input  {lane=s0, owner=g0}
  %arg5_1 : f32[4,32,32] = input  {lane=s0, owner=g0}
  %arg6_1 : f32[4,16,32] = input  {lane=s0, owner=g0}
  segment k0:
    %record_default_1 : () = capturepass.record(1, 0)  {lane=s0, record=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %t_3 : f32[32,8] = aten.t.default(%arg4_1)  {lane=s0, owner=g0, segment=k0}
    %mm_3 : f32[8,8] = aten.mm.default(%arg0_1, %t_3)  {lane=s0, owner=g0, segment=k0}
    %topk : (f32[8,2], i64[8,2]) = aten.topk.default(%mm_3, 2)  {lane=s0, owner=g0, segment=k0}
    %getitem : f32[8,2] = getitem(%topk, 0)  {lane=s0, owner=g0, segment=k0}
    %getitem_1 : i64[8,2] = getitem(%topk, 1)  {lane=s0, owner=g0, segment=k0}
    %_softmax : f32[8,2] = aten._softmax.default(%getitem, -1, False)  {lane=s0, owner=g0, segment=k0}
    %zeros : f32[8,8] = aten.zeros.default([8, 8], dtype=torch.float32, device=device(type='cpu'), pin_memory=False)  {lane=s0, owner=g0, segment=k0}
    %scatter : f32[8,8] = aten.scatter.src(%zeros, 1, %getitem_1, %_softmax)  {lane=s0, owner=g0, segment=k0}
    %cat : f32[8,40] = aten.cat.default([%arg0_1, %scatter], -1)  {lane=s0, owner=g0, segment=k0}
    %repeat : f32[16,40] = aten.repeat.default(%cat, [2, 1])  {lane=s0, owner=g0, segment=k0}
    %record_default : () = capturepass.record(0, 0)  {lane=s0, record=e1, role=fork, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%repeat->%all_to_all_single}
    %wait_default : () = capturepass.wait(0, 1)  {lane=s1, wait=e1, role=fork, lease=l1, owner=g0, segment=k0, by=insert_syncs, why=%repeat->%all_to_all_single}
    %all_to_all_single : f32[16,40] = _c10d_functional.all_to_all_single.default(%repeat, [8, 8], [8, 8], '0')  {lane=s1, owner=g0, segment=k0, resources=[comm:0@g0/s1]}
    %wait_default_1 : () = capturepass.wait(1, 2)  {lane=s2, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %t : f32[32,64] = aten.t.default(%arg1_1)  {lane=s2, owner=g0, segment=k0}
    %mm : f32[8,64] = aten.mm.default(%arg0_1, %t)  {lane=s2, owner=g0, segment=k0}
    %silu : f32[8,64] = aten.silu.default(%mm)  {lane=s2, owner=g0, segment=k0}
    %wait_default_2 : () = capturepass.wait(1, 3)  {lane=s3, wait=e0, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=fork k0}
    %t_1 : f32[32,64] = aten.t.default(%arg2_1)  {lane=s3, owner=g0, segment=k0}
    %mm_1 : f32[8,64] = aten.mm.default(%arg0_1, %t_1)  {lane=s3, owner=g0, segment=k0}
    %record_default_2 : () = capturepass.record(2, 3)  {lane=s3, record=e2, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%mm_1->%mul}
    %wait_default_3 : () = capturepass.wait(2, 2)  {lane=s2, wait=e2, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%mm_1->%mul}
    %mul : f32[8,64] = aten.mul.Tensor(%silu, %mm_1)  {lane=s2, owner=g0, segment=k0}
    %t_2 : f32[64,32] = aten.t.default(%arg3_1)  {lane=s2, owner=g0, segment=k0}
    %mm_2 : f32[8,32] = aten.mm.default(%mul, %t_2)  {lane=s2, owner=g0, segment=k0}
    %record_default_6 : () = capturepass.record(6, 2)  {lane=s2, record=e3, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%add}
    %wait_tensor : f32[16,40] = _c10d_functional.wait_tensor.default(%all_to_all_single)  {lane=s1, owner=g0, segment=k0}
    %record_default_3 : () = capturepass.record(3, 1)  {lane=s1, record=e4, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor->%slice_1}
    %wait_default_4 : () = capturepass.wait(3, 0)  {lane=s0, wait=e4, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor->%slice_1}
    %slice_1 : f32[16,32] = aten.slice.Tensor(%wait_tensor, 1, 0, 32)  {lane=s0, owner=g0, segment=k0}
    %release_default : () = capturepass.release([%repeat], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %all_to_all_single,%wait_tensor}
    %slice_2 : f32[16,4] = aten.slice.Tensor(%wait_tensor, 1, 32, 36)  {lane=s0, owner=g0, segment=k0}
    %unsqueeze : f32[1,16,32] = aten.unsqueeze.default(%slice_1, 0)  {lane=s0, owner=g0, segment=k0}
    %expand : f32[4,16,32] = aten.expand.default(%unsqueeze, [4, 16, 32])  {lane=s0, owner=g0, segment=k0}
    %bmm : f32[4,16,32] = aten.bmm.default(%expand, %arg5_1)  {lane=s0, owner=g0, segment=k0}
    %split : (f32[4,16,16], f32[4,16,16]) = aten.split.Tensor(%bmm, 16, -1)  {lane=s0, owner=g0, segment=k0}
    %getitem_2 : f32[4,16,16] = getitem(%split, 0)  {lane=s0, owner=g0, segment=k0}
    %getitem_3 : f32[4,16,16] = getitem(%split, 1)  {lane=s0, owner=g0, segment=k0}
    %silu_1 : f32[4,16,16] = aten.silu.default(%getitem_2)  {lane=s0, owner=g0, segment=k0}
    %mul_1 : f32[4,16,16] = aten.mul.Tensor(%silu_1, %getitem_3)  {lane=s0, owner=g0, segment=k0}
    %bmm_1 : f32[4,16,32] = aten.bmm.default(%mul_1, %arg6_1)  {lane=s0, owner=g0, segment=k0}
    %t_4 : f32[4,16] = aten.t.default(%slice_2)  {lane=s0, owner=g0, segment=k0}
    %unsqueeze_1 : f32[4,16,1] = aten.unsqueeze.default(%t_4, -1)  {lane=s0, owner=g0, segment=k0}
    %mul_2 : f32[4,16,32] = aten.mul.Tensor(%bmm_1, %unsqueeze_1)  {lane=s0, owner=g0, segment=k0}
    %sum_1 : f32[16,32] = aten.sum.dim_IntList(%mul_2, [0])  {lane=s0, owner=g0, segment=k0}
    %record_default_4 : () = capturepass.record(4, 0)  {lane=s0, record=e5, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sum_1->%all_to_all_single_1}
    %wait_default_5 : () = capturepass.wait(4, 1)  {lane=s1, wait=e5, role=fork, lease=l0, owner=g0, segment=k0, by=insert_syncs, why=%sum_1->%all_to_all_single_1}
    %all_to_all_single_1 : f32[16,32] = _c10d_functional.all_to_all_single.default(%sum_1, [8, 8], [8, 8], '0')  {lane=s1, owner=g0, segment=k0, resources=[comm:0@g0/s1]}
    %release_default_1 : () = capturepass.release([%all_to_all_single], 1)  {lane=s1, owner=g0, segment=k0, by=insert_syncs, why=read by %bmm,%expand,%mul_2,%slice_1,%slice_2,%t_4,%unsqueeze,%unsqueeze_1}
    %wait_tensor_1 : f32[16,32] = _c10d_functional.wait_tensor.default(%all_to_all_single_1)  {lane=s1, owner=g0, segment=k0}
    %record_default_5 : () = capturepass.record(5, 1)  {lane=s1, record=e6, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor_1->%view}
    %wait_default_6 : () = capturepass.wait(5, 0)  {lane=s0, wait=e6, role=join, lease=l3, owner=g0, segment=k0, by=insert_syncs, why=%wait_tensor_1->%view}
    %view : f32[2,8,32] = aten.view.default(%wait_tensor_1, [2, 8, 32])  {lane=s0, owner=g0, segment=k0}
    %release_default_2 : () = capturepass.release([%sum_1], 0)  {lane=s0, owner=g0, segment=k0, by=insert_syncs, why=read by %all_to_all_single_1,%wait_tensor_1}
    %sum_2 : f32[8,32] = aten.sum.dim_IntList(%view, [0])  {lane=s0, owner=g0, segment=k0}
    %wait_default_7 : () = capturepass.wait(6, 0)  {lane=s0, wait=e3, role=join, lease=l2, owner=g0, segment=k0, by=insert_syncs, why=%mm_2->%add}
    %add : f32[8,32] = aten.add.Tensor(%mm_2, %sum_2)  {lane=s0, owner=g0, segment=k0}
  return (%add,)  {lane=s0, owner=g0}
# decision: %all_to_all_single: collective on group '0' (ranks 0,1) on lane comm; 5 kernel(s) issued before %wait_tensor
# decision: %all_to_all_single_1: collective on group '0' (ranks 0,1) on lane comm; 0 kernel(s) issued before %wait_tensor_1
""")


def test_in_place_all_reduce_is_traced_to_the_functional_op(run):
    draft = _graph_dumps(run / "rank0" / "draft")[0]
    assert "= aten.copy.default(%mm_2, %wait_tensor)" in draft
    assert "# decision: %all_reduce: collective on group '0' (ranks 0,1) on lane comm" in draft
