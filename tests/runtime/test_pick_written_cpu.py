"""The measured choice on a graph that writes its inputs, over host graphs (as on a GPU).

A static KV cache's layer bumps a length counter in place and writes where it points. The
measured choice warms up, captures and replays each schedule candidate after the call has moved
the counter: each must start from what the call read, or a shape first called at the cache's
last slot writes past its end (on a GPU a device-side assert, which ends the process).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import RunningSum, SlotCache


def test_candidates_warm_up_and_replay_from_what_the_call_read(monkeypatch, caplog):
    """Measured as on a GPU, over host graphs: a shape first called at the cache's last slot. The
    call (the cost model's warm-up) moves the counter to the end; the other candidates' warm-ups,
    their captures and every timed replay start from what the call read, not one step past the
    end (on a GPU an out-of-bounds write is a device-side assert). Results and state as eager's."""
    import copy

    from capturepass.testing.host_graphs import measure_on_host
    from tests.helpers import capture_on_host

    capture_on_host(monkeypatch.setattr)
    measure_on_host(monkeypatch.setattr)
    torch.manual_seed(0)
    model = SlotCache()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="capturepass", dynamic=False,
                             options={"inner": "eager", "cudagraphs": "monolithic", "verify": True})
    with caplog.at_level(logging.INFO, logger="capturepass"), torch.no_grad():
        for rows in (3, 1):  # slots 0..2, then a new shape at slot 3, the last
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), eager(x))
            assert model.n.item() == eager.n.item() and torch.equal(model.cache, eager.cache)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "failed" in m], [m for m in messages if "failed" in m]
    measured = [m for m in messages if ": schedule candidate " in m and " measured " in m]
    assert len(measured) == 6, measured  # three candidates at each shape


def _storages_of(nbytes: int) -> int:
    """Distinct storages of ``nbytes`` bytes that Python tensors alive now are views of."""
    import gc

    found = set()
    for o in gc.get_objects():
        try:
            # Plain tensors only: fake and functional ones (Dynamo's, Inductor's) have no memory.
            if type(o) not in (torch.Tensor, torch.nn.Parameter) or o.layout != torch.strided or o.is_meta:
                continue
            storage = o.untyped_storage()
        except ReferenceError:  # a weak proxy whose referent is gone
            continue
        except NotImplementedError:  # a plain tensor over no memory of its own: vmap's, an earlier test's
            continue
        if storage.nbytes() == nbytes:
            found.add(storage.data_ptr())
    return len(found)


def test_measuring_holds_one_copy_of_a_written_cache_at_a_time(monkeypatch):
    """The candidates other than the cost model's warm up on copies of the inputs the graph
    writes (the call already wrote the caller's). A warm-up kept its copy of each until its
    capture, and every candidate warms up before any is captured: a copy of a whole KV cache per
    candidate, held at once. Each capture now sees the caller's cache alone (a cache is larger than
    ``replay.BEFORE_CALL_BYTES``; what is not is kept as the call read it); the timed replays
    hold one copy more (the cache as the call left it, put back after them), which is gone
    again when the chosen candidate is captured once more."""
    from capturepass.runtime import pick, replay
    from capturepass.testing.host_graphs import measure_on_host
    from tests.helpers import capture_on_host

    capture_on_host(monkeypatch.setattr)
    measure_on_host(monkeypatch.setattr)
    torch.manual_seed(0)
    # A cache past the size whose values before the call are kept (counters, positions): data.
    d = 64
    model = SlotCache(slots=2 * replay.BEFORE_CALL_BYTES // (4 * d), d=d)
    nbytes = model.cache.untyped_storage().nbytes()
    seen: dict[str, list[int]] = {"capture": [], "timing": []}
    capture_warmed, time_rounds = replay.Capture._capture_warmed, pick.time_rounds

    def counting_capture(self, args):
        seen["capture"].append(_storages_of(nbytes))
        return capture_warmed(self, args)

    def counting_rounds(*a, **k):
        seen["timing"].append(_storages_of(nbytes))
        return time_rounds(*a, **k)

    monkeypatch.setattr(replay.Capture, "_capture_warmed", counting_capture)
    monkeypatch.setattr(pick, "time_rounds", counting_rounds)
    # The cost model's lanes chosen, as where a GPU measures them fastest: captured first, their
    # capture is let go of for the others' and made once more after the timing.
    monkeypatch.setattr(pick, "choose", lambda medians, *a, **k: 0)
    compiled = torch.compile(model, backend="capturepass", dynamic=False,
                             options={"inner": "eager", "cudagraphs": "monolithic", "verify": True})
    with torch.no_grad():
        compiled(torch.randn(3, d))
    # Three candidates, then the chosen one captured again.
    assert seen == {"capture": [1, 1, 1, 1], "timing": [2]}, seen


@pytest.mark.parametrize("spare", (None, 0), ids=("copies-beside", "copies-on-the-host"))
def test_the_timed_replays_are_undone_from_copies_beside_or_on_the_host(spare, monkeypatch, caplog):
    """Timed replays write the caller's buffer at its own address (larger than
    ``replay.BEFORE_CALL_BYTES``, it is not put back before each): measuring puts back what the
    call left, from copies on the buffer's device or, where that device cannot spare their size
    (``aside.spare_bytes``: a GPU's free memory; none here), on the host. The other candidates'
    warm-ups then run on the caller's buffer itself, put back from the host after each."""
    import copy

    from capturepass.runtime import aside, replay
    from capturepass.testing.host_graphs import measure_on_host
    from tests.helpers import capture_on_host

    capture_on_host(monkeypatch.setattr)
    measure_on_host(monkeypatch.setattr)
    monkeypatch.setattr(aside, "spare_bytes", lambda device: spare)
    torch.manual_seed(0)
    model = RunningSum(rows=2 * replay.BEFORE_CALL_BYTES // (4 * 64))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="capturepass", dynamic=False,
                             options={"inner": "eager", "cudagraphs": "monolithic", "verify": True})
    with caplog.at_level(logging.INFO, logger="capturepass"), torch.no_grad():
        for rows in (3, 3, 2):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(compiled(x), eager(x))
            torch.testing.assert_close(model.acc, eager.acc)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if ": chose schedule " in m]) == 2, messages
    on_host = [m for m in messages if "timed replays: the inputs the graph writes are kept on the host" in m]
    assert len(on_host) == (0 if spare is None else 2), on_host
    warm_ups = [m for m in messages if "its warm-up runs on the caller's inputs the graph writes" in m]
    # Per shape (two candidates: the cost model's and one lane's own): one lane's warm-up, and the
    # chosen one's again where its capture was not the last one made (one lane's own program is
    # captured last and kept as it is). Which one the host's timing chooses varies with its load.
    chosen = [m.split(": chose schedule ")[1].split(" ")[0] for m in messages if ": chose schedule " in m]
    assert len(warm_ups) == (0 if spare is None else sum(1 + (c != "one_lane") for c in chosen)), (chosen, warm_ups)
