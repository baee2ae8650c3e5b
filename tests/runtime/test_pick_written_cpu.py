"""The measured choice on a graph that writes its inputs, over host graphs (as on a GPU).

A static KV cache's layer bumps a length counter in place and writes where it points. The
measured choice warms up, captures and replays each schedule candidate after the call has moved
the counter: each must start from what the call read, or a shape first called at the cache's
last slot writes past its end (on a GPU a device-side assert, which ends the process).
"""

from __future__ import annotations

import logging

import torch

from tests.helpers import SlotCache


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
