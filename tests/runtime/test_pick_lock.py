"""The measuring turn: processes that share a GPU time their candidates one at a time.

``CAPTUREPASS_PICK_LOCK`` names a file whose exclusive lock a picker holds while it times its
candidates (``pick.measuring_turn``); the turn is re-entrant within a process, and other threads
wait for it as other processes do. The picker runs with the fakes of ``tests/runtime/pick_fakes.py``.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from capturepass.runtime import files, pick
from tests.runtime.pick_fakes import FakeExecutor, fake_picker


def _locked_elsewhere(path) -> bool:
    """Whether another open file cannot take ``path``'s lock now (flock locks belong to an open
    file, so a second one conflicts within one process too)."""
    fcntl = pytest.importorskip("fcntl")
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _lock_noting_picker(tmp_path, lock, held: list):
    """A picker (one lane fastest) whose every timed round notes in ``held`` whether ``lock`` was
    held then."""
    p, _, picked, _ = fake_picker(tmp_path, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0})
    measure = p.measure_round
    p.measure_round = lambda caps, order: (held.append(_locked_elsewhere(lock)), measure(caps, order))[1]
    return p, picked


def test_candidates_are_timed_under_the_lock_processes_sharing_a_gpu_name(tmp_path, monkeypatch):
    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", str(lock))
    held = []
    p, picked = _lock_noting_picker(tmp_path, lock, held)
    p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    assert held and all(held)  # every round, warm-up included
    assert not _locked_elsewhere(lock)  # let go once the choice is made
    assert picked[0].choice == "one_lane"
    # Without the variable nothing is locked.
    monkeypatch.delenv("CAPTUREPASS_PICK_LOCK")
    held.clear()
    p2, _ = _lock_noting_picker(tmp_path / "b", lock, held)
    p2.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
    assert held and not any(held)


def test_a_capture_inside_a_turn_this_process_holds_does_not_wait_on_itself(tmp_path, monkeypatch):
    # A benchmark times its calls under the lock its workers' pickers share; a call there that
    # captures a new shape (Dynamo sending an earlier shape to a later, dynamic graph) measures
    # its candidates inside that turn. A second flock of the file from the same process would
    # block forever.
    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", str(lock))
    held = []
    p, picked = _lock_noting_picker(tmp_path, lock, held)
    done = threading.Event()

    def timed_calls():
        with pick.measuring_turn():
            p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
            held.append(("after the capture", _locked_elsewhere(lock)))
        done.set()

    t = threading.Thread(target=timed_calls, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "the nested turn waited on the turn its own process holds"
    assert picked[0].choice == "one_lane"
    assert held[-1] == ("after the capture", True)  # the inner turn's end leaves the outer one held
    assert held[:-1] and all(held[:-1])
    assert not _locked_elsewhere(lock)


def test_another_thread_waits_for_the_turn(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", str(tmp_path / "gpu.lock"))
    inside, leave, order = threading.Event(), threading.Event(), []

    def first():
        with pick.measuring_turn():
            inside.set()
            leave.wait(30)
            order.append("first leaves")

    def second():
        inside.wait(30)
        with pick.measuring_turn():
            order.append("second enters")

    threads = [threading.Thread(target=f, daemon=True) for f in (first, second)]
    for t in threads:
        t.start()
    inside.wait(30)
    threads[1].join(0.5)
    assert threads[1].is_alive() and order == []  # the second thread waits while the first holds it
    leave.set()
    for t in threads:
        t.join(30)
    assert order == ["first leaves", "second enters"]


def test_a_lock_that_cannot_be_opened_warns_once_and_still_chooses(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", str(tmp_path / "no" / "such" / "dir" / "gpu.lock"))
    monkeypatch.setattr(files, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        for sub in ("a", "b"):
            p, _, picked, _ = fake_picker(tmp_path / sub, {"model": 100.0, "one_lane": 60.0, "aux1": 80.0})
            p.capture(FakeExecutor(), [torch.randn(4, 8)], real=True)
            assert picked[0].choice == "one_lane"
    warned = [r.getMessage() for r in caplog.records if "CAPTUREPASS_PICK_LOCK" in r.getMessage()]
    assert len(warned) == 1 and "the lock cannot be taken (FileNotFoundError" in warned[0]
