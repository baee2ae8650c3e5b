"""Where the copies that undo capturepass's own writes go: beside their tensor, or on the host."""

from __future__ import annotations

import torch

from capturepass.runtime import aside

MIB = 2**20


def test_the_host_takes_no_limit():
    assert aside.spare_bytes(torch.device("cpu")) is None
    assert aside.on_host([torch.zeros(MIB)]) == {}


def test_copies_past_the_share_of_what_a_device_can_spare_go_to_the_host(monkeypatch):
    a, b = torch.zeros(MIB // 4), torch.zeros(MIB // 4)  # 1 MiB each
    monkeypatch.setattr(aside, "spare_bytes", lambda device: 4 * MIB)
    assert aside.on_host([a, b]) == {}  # 2 MiB of 4: within ASIDE_SHARE
    monkeypatch.setattr(aside, "spare_bytes", lambda device: 4 * MIB - 1)
    host = aside.on_host([a, b])
    assert host == {torch.device("cpu"): (2 * MIB, 4 * MIB - 1)}
    assert aside.describe(host) == "2.0 MiB (cpu has 4.0 MiB to spare)"


def test_a_copy_on_the_host_is_a_copy():
    t = torch.arange(6.0)
    for host in (False, True):
        c = aside.copy_aside(t, host)
        assert torch.equal(c, t) and c.device.type == "cpu"
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_a_driver_that_does_not_say_sets_no_limit(monkeypatch, caplog):
    import logging

    def refuses(device):
        raise RuntimeError("CUDA driver error: not supported")

    monkeypatch.setattr(torch.cuda, "mem_get_info", refuses)
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        assert aside.spare_bytes(torch.device("cuda", 7)) is None
    assert "cannot read the free memory of cuda:7 (CUDA driver error: not supported)" in caplog.text


def test_scratch_runs_on_what_the_call_read_on_copies_or_on_the_callers_own(monkeypatch):
    counter, cache = torch.tensor(3), torch.arange(8.0)
    before = {0: torch.tensor(2)}
    run, undo = aside.scratch({0: counter, 1: cache}, before, "a run")
    assert run[0].item() == 2 and run[0] is not before[0]
    assert torch.equal(run[1], cache) and run[1].data_ptr() != cache.data_ptr() and undo == []
    monkeypatch.setattr(aside, "spare_bytes", lambda device: 0)
    run, undo = aside.scratch({0: counter, 1: cache}, before, "a run")
    assert run[0].item() == 2 and run[1] is cache  # the small one from before; the cache itself
    ((t, copy),) = undo
    assert t is cache and torch.equal(copy, cache) and copy.data_ptr() != cache.data_ptr()


def test_put_back_restores_each_tensor_and_lets_go_of_the_copies():
    a, b = torch.arange(4.0), torch.ones(3)
    saved = aside.kept([a, b], "a test")
    a.zero_()
    b.mul_(5)
    aside.put_back(saved)
    assert torch.equal(a, torch.arange(4.0)) and torch.equal(b, torch.ones(3))
    assert saved == []
