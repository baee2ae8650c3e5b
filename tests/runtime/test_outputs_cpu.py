"""Replayed outputs as aliases of the capture's memory, copied out only while held; inputs in place.

The alias and the rescue work on any device: here the "static memory" is a host tensor
that a test overwrites as the next replay would. The GPU halves (real replays) are in
``test_outputs_gpu.py``.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from capturepass.runtime import lifetime, outputs
from capturepass.runtime.outputs import OutputAliases
from capturepass.runtime.owner import GraphOwner

pytestmark = pytest.mark.skipif(outputs.UNSUPPORTED is not None, reason=str(outputs.UNSUPPORTED))


@pytest.fixture(params=[True, False], ids=["swap", "move"])
def swap(request):
    """How a held alias is rescued: its storage takes the copy's memory (``_swap_data_ptr_``), or
    the tensors over it are moved to the copy (torch without it, 2.11)."""
    if request.param and not outputs.SWAP:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_")
    return request.param


def _static():
    return torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.arange(5, dtype=torch.float32) + 100


def test_outputs_alias_the_static_memory_with_exact_values_and_views(swap):
    a, b = _static()
    reg = OutputAliases([a, b], swap=swap)
    fresh = torch.ones(2)
    out = reg.wrap((a, [a.t(), {"row": a[1]}], b, fresh, 3))
    whole, (transposed, inner), bb, same, three = out
    assert torch.equal(whole, a) and torch.equal(transposed, a.t()) and torch.equal(inner["row"], a[1])
    assert torch.equal(bb, b)
    assert same is fresh and three == 3  # not static memory: returned as it is
    # No copy: the outputs read the static memory, and views of one buffer share one storage.
    assert whole.data_ptr() == a.data_ptr() and inner["row"].data_ptr() == a[1].data_ptr()
    storages = {t.untyped_storage()._cdata for t in (whole, transposed, inner["row"])}
    assert len(storages) == 1
    assert whole.untyped_storage()._cdata != a.untyped_storage()._cdata  # an alias, not the pool's own storage
    assert transposed.stride() == (1, 4) and inner["row"].storage_offset() == 4
    assert reg.aliased == 4 and reg.rescues == 0 and reg.copies == 0


def test_a_held_output_keeps_its_values_when_the_memory_is_overwritten(swap):
    a, b = _static()
    reg = OutputAliases([a, b], swap=swap)
    held, view = reg.wrap((a, a[2]))
    held_b = reg.wrap(b)  # a second call before a rescue: its own alias
    del held_b
    assert reg.num_live == 1
    assert reg.rescue() == 1  # the next replay is about to write: one storage copied out
    a.fill_(-1.0)  # the replay
    assert torch.equal(held, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(view, torch.tensor([8.0, 9.0, 10.0, 11.0]))
    assert held.data_ptr() != a.data_ptr() and view.data_ptr() == held.data_ptr() + 8 * 4
    assert held.untyped_storage()._cdata == view.untyped_storage()._cdata
    assert reg.rescues == 1
    # The rescued outputs own their memory now: a second rescue does not copy them again.
    assert reg.rescue() == 0 and reg.rescues == 1


def test_a_dropped_output_costs_no_copy(swap):
    a, b = _static()
    reg = OutputAliases([a, b], swap=swap)
    for _ in range(3):
        out = reg.wrap((a, a[0], b))
        assert torch.equal(out[2], b)
        del out
        assert reg.rescue() == 0
    assert reg.rescues == 0 and reg.aliased == 9


def test_only_the_view_still_held_keeps_its_storage_alive(swap):
    a, _ = _static()
    reg = OutputAliases([a], swap=swap)
    whole, row = reg.wrap((a, a[1]))
    del whole  # the row still uses the alias storage
    assert reg.rescue() == 1
    a.zero_()
    assert torch.equal(row, torch.tensor([4.0, 5.0, 6.0, 7.0]))


def test_an_output_fed_back_as_the_next_input_reads_the_values_it_was_returned_with(swap):
    a, _ = _static()
    reg = OutputAliases([a], swap=swap)
    h = reg.wrap(a)
    for step in range(3):
        reg.rescue()  # before the next replay, and before its inputs are copied in
        buf = h.clone()  # the copy of the input into its static buffer
        a.copy_(buf * 2)  # the replay writes the static output
        h = reg.wrap(a)
        assert torch.equal(h, torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2 ** (step + 1))
    assert reg.rescues == 3  # each step held its input until the next replay


def test_an_output_that_requires_grad_is_copied(swap):
    w = torch.ones(3, requires_grad=True)
    static = w * 2
    reg = OutputAliases([static], swap=swap)
    out = reg.wrap(static)
    assert out.requires_grad and out.data_ptr() != static.data_ptr()
    assert reg.copies == 1 and reg.aliased == 0


def test_closing_the_owner_copies_out_what_is_held_before_the_memory_goes(swap):
    a, _ = _static()
    owner = GraphOwner("t", 1, None, captured=True)
    reg = OutputAliases([a], swap=swap)
    owner.before_close.append(reg.close)
    held = reg.wrap(a)
    dropped = reg.wrap(a[0])
    del dropped
    owner.close()
    assert reg.rescues == 1 and owner.before_close == []
    a.fill_(7.0)
    assert torch.equal(held, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert reg.wrap(a) is a  # closed: nothing is static any more


def test_without_the_torch_functions_outputs_are_copied_and_the_reason_logged(monkeypatch, caplog):
    monkeypatch.setattr(outputs, "UNSUPPORTED", "this torch has no _construct_storage_from_data_pointer")
    monkeypatch.setattr(outputs, "_warned", False)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert not outputs.supported()
        assert not outputs.supported()
    said = [r.getMessage() for r in caplog.records if "copied out" in r.getMessage()]
    assert said == ["capturepass: replayed outputs are copied out of the graph's memory: "
                    "this torch has no _construct_storage_from_data_pointer"]


def test_a_view_the_caller_derived_is_found_moved_and_later_outputs_are_copied(caplog):
    """Without ``_swap_data_ptr_`` a held alias is rescued by moving its tensors: a view the caller
    made is not one the registry handed out, so the heap is searched for it once; from then on
    that capture returns copies (its caller keeps derived views across calls)."""
    a, _ = _static()
    reg = OutputAliases([a], swap=False)
    out = reg.wrap(a)
    row, col = out[1], out[:, 2]
    del out
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert reg.rescue() == 1
    assert reg.searches == 1 and reg.copying is not None
    assert [r.getMessage() for r in caplog.records if "derived tensor(s)" in r.getMessage()] == [
        "capturepass: this torch cannot move a held output's memory under its views (no "
        "UntypedStorage._swap_data_ptr_): 2 derived tensor(s) found on the heap and moved; "
        "this capture's outputs are copied out from now on"]
    a.fill_(-1.0)  # the replay
    assert torch.equal(row, torch.tensor([4.0, 5.0, 6.0, 7.0])) and torch.equal(col, torch.tensor([2.0, 6.0, 10.0]))
    assert row.untyped_storage()._cdata == col.untyped_storage()._cdata  # still views of one copy
    again = reg.wrap((a, a[0]))
    assert again[0].data_ptr() != a.data_ptr() and torch.equal(again[0], a)
    assert again[1].data_ptr() == again[0].data_ptr()  # one copy per storage, views kept
    assert reg.copies == 2 and reg.rescue() == 0 and reg.searches == 1


class _NoStorage(torch.Tensor):
    """A tensor subclass that has no storage to show (as some wrapper subclasses raise)."""

    def untyped_storage(self):
        raise RuntimeError("no storage here")


def test_the_heap_search_passes_over_tensors_without_a_storage():
    a, _ = _static()
    reg = OutputAliases([a], swap=False)
    out = reg.wrap(a)
    row = out[1]
    odd = torch.zeros(2).as_subclass(_NoStorage)
    del out
    assert reg.rescue() == 1 and reg.searches == 1
    a.zero_()
    assert torch.equal(row, torch.tensor([4.0, 5.0, 6.0, 7.0])) and odd.shape == (2,)


def test_outputs_made_in_inference_mode_are_moved_in_inference_mode():
    a, _ = _static()
    reg = OutputAliases([a], swap=False)
    with torch.inference_mode():
        held = reg.wrap(a)
    assert held.is_inference()
    assert reg.rescue() == 1 and reg.searches == 0
    a.zero_()
    assert torch.equal(held, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_a_holder_outside_pythons_heap_fails_the_call_rather_than_be_overwritten(monkeypatch):
    """matmul of a 3-d tensor saves its own reshaped view for the backward: a tensor with no
    Python object, which no search finds. Where torch cannot expire the storage either, the
    rescue raises instead of letting the replay overwrite it."""
    monkeypatch.delattr(torch._C, "_set_storage_data_ptr_access_error_msg", raising=False)
    a, _ = _static()
    reg = OutputAliases([a], swap=False)
    out = reg.wrap(a.view(1, 3, 4))
    y = torch.matmul(out, torch.ones(4, 2, requires_grad=True)).sum()
    del out
    with pytest.raises(RuntimeError, match="held outside Python's heap"):
        reg.rescue()
    assert y.requires_grad


# -- inputs in place ---------------------------------------------------------------------------------

class _Releases:
    def __init__(self) -> None:
        self.released: list[tuple] = []

    def release_capture(self, key, cap, why):
        self.released.append((key, cap, why))
        return True


def test_a_capture_on_a_callers_tensor_goes_when_its_storage_dies_not_its_view():
    ex, cap = _Releases(), _Releases()  # any object with a weak reference stands for the capture
    cache = torch.zeros(8, 4)
    view = cache[:2]
    finalizers = lifetime.watch_capture(ex, ("k",), cap, [view.untyped_storage()])
    assert len(finalizers) == 1
    del view
    gc.collect()
    assert ex.released == []  # a view made for one call died; the buffer did not
    del cache
    gc.collect()
    lifetime.drain()
    assert ex.released == [(("k",), cap, "an input it was made on was collected")]


def test_captures_sharing_memory_rescue_each_others_held_outputs(swap):
    """A model's captures share a pool: capture B's output may lie where capture A keeps its
    temporaries, which A's replay writes. Held aliases of every capture of the group are copied
    out before any of them replays; captures that handed nothing out cost nothing."""
    pool = torch.arange(8, dtype=torch.float32)
    temporaries_of_a, output_of_b = pool, pool[4:]  # A's temporaries were freed; B's output took part of them
    group: list[OutputAliases] = []
    a, b = OutputAliases([temporaries_of_a], swap=swap), OutputAliases([output_of_b], swap=swap)
    a.group = b.group = group
    held = b.wrap(output_of_b)
    assert group == [b]  # b handed out an alias since its last rescue
    b.wrap(output_of_b)  # a second call: b is in the group once
    assert group == [b]
    assert outputs.rescue_group(group) == 1 and group == []  # what A's replay does first
    temporaries_of_a.fill_(-1.0)  # A's replay writes its temporaries
    assert torch.equal(held, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert outputs.rescue_group(group) == 0 and a.rescues == 0


def test_warm_up_results_are_copied_out_of_the_pool_keeping_their_views():
    """``copy_out``: results over memory the call made move to one copy per storage (views of one
    result stay views of one copy); the caller's tensors and results over them are left as they are."""
    made = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    arg = torch.ones(4)
    grad = torch.ones(2, requires_grad=True) * 2
    out = outputs.copy_out({"x": made, "views": (made[1], made.t()), "arg": arg, "view": arg[1:], "g": grad, "n": 3},
                           {arg.untyped_storage()._cdata})
    assert out["arg"] is arg and out["view"].data_ptr() == arg[1:].data_ptr() and out["n"] == 3
    x, (row, t) = out["x"], out["views"]
    assert torch.equal(x, made) and torch.equal(row, made[1]) and torch.equal(t, made.t())
    assert x.data_ptr() != made.data_ptr()
    assert {v.untyped_storage()._cdata for v in (x, row, t)} == {x.untyped_storage()._cdata}
    assert row.data_ptr() == x[1].data_ptr() and t.stride() == made.t().stride()
    made.zero_()  # the pool's memory written again: the copies keep the values
    assert torch.equal(row, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert out["g"].requires_grad and out["g"].grad_fn is not None and torch.equal(out["g"], grad)


def test_non_owning_tensors_keep_address_and_layout_and_one_storage_per_storage():
    """``non_owning``: what a capture holds its outputs and buffers over once captured. The memory
    and the layout are the tensor's; tensors that shared a storage share one non-owning storage;
    the original storage gains no owner (its block can go back to the pool); tensors it cannot
    treat alike (a subclass, one that requires grad) are left out."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:3]
    grad = torch.ones(3, requires_grad=True)
    sub = torch.ones(3).as_subclass(_NoStorage)
    uses = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    weak = outputs.non_owning([base, view, grad, sub, torch.empty(0)])
    assert set(weak) == {id(base), id(view)}
    wb, wv = weak[id(base)], weak[id(view)]
    for w, t in ((wb, base), (wv, view)):
        assert (w.data_ptr(), w.shape, w.stride(), w.storage_offset(), w.dtype) == \
            (t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype)
    assert wb.untyped_storage()._cdata == wv.untyped_storage()._cdata != base.untyped_storage()._cdata
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == uses
    base.add_(1.0)  # the same memory: written through the owner, read through the non-owning view
    assert torch.equal(wv, view)
