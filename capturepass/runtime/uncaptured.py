"""Measured lane choice of uncaptured calls on CUDA: the cost model's lanes, or one stream.

Without a CUDA graph every lane switch, event record and event wait of a call is a host call
(a few microseconds each through torch), paid again at every call. A decode-shaped call is
host-paced: its GPU waits for the host's launches, and lanes only add to the host's work (on an
H100, a Qwen2-MoE decoder's three lanes cost its uncaptured call 1.36x Inductor's time, one
stream 1.04x). A call the GPU paces (a long prefill) can gain what the lanes overlap. Which of
the two a shape is, only a measurement tells, and the calls themselves are the measurement:

- the first call of a shape runs on one stream, the second on the lanes (each pays its first
  use of a stream: cuBLAS's workspace, the driver's lazy set-up), untimed;
- the next calls alternate between the two, each timed from a synchronised device to its
  results on the device (:data:`SAMPLES` calls each): the slower of the host and the GPU, as
  a steady stream of calls sees it;
- then the shape runs the faster from then on, by the captured choice's rule (``pick.choose``:
  one stream within ``pick.TIE`` of the lanes wins, no events, no side streams, less memory). The choice is logged and recorded
  (:class:`~capturepass.runtime.choices.PickRecord` with ``uncaptured`` set; the graph's
  decisions and its dump folder's ``schedules.json``, which ``capturepass show`` reads).

Nothing runs twice: each timed call is a real call whose results go back to the caller, so a
graph that writes its inputs (a KV cache) is measured as safely as it is run. The measuring
calls wait for the device, before and after (a pipeline bubble each, paid only by the first
calls of a shape). The choice is this process's: a measurement costs a few calls, and cached
choices of other processes would not know this process's host speed. Shapes seen once run one
stream (never slower than Inductor's own code on one stream). Choices and shapes being measured
are each kept for :data:`MAX_SHAPES` shapes, the oldest dropped; after :data:`MAX_MEASURED`
choices (a server's shapes, dropped and coming back) an owner measures no more, and shapes
without a choice run the schedule most of its choices were (logged once).

Option ``pick="model"`` keeps the cost model's lanes on every uncaptured call, as do calls that
ask for the lanes (``Executor.uncaptured``, instrumented calls: traces and measurements of the
lanes themselves) and graphs that post collectives (ranks choosing on their own clocks could
run different schedules; a timed call's synchronisation would wait on the other ranks).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from capturepass.runtime.choices import PickRecord, device_name, round_us
from capturepass.runtime.pick import choose

log = logging.getLogger("capturepass")

# Timed calls per schedule and shape. A synchronised call of a host-paced graph moves by a few
# percent from call to call; lanes that cost the host its time move it by tens of percent.
SAMPLES = 3
# Shapes whose choice is kept, and shapes being measured, each (the oldest dropped first): a
# server's prefill lengths are many; a shape dropped is measured again if it comes back.
MAX_SHAPES = 64
# Choices an owner makes at most: past them, measuring's synchronisations would be a cost per
# shape for as long as the process serves new shapes.
MAX_MEASURED = 256

MODEL = "model"
ONE_STREAM = "one_stream"


class _Trial:
    """One shape being measured: its calls so far and each schedule's timed calls (seconds)."""

    __slots__ = ("calls", "times")

    def __init__(self) -> None:
        self.calls = 0
        self.times: dict[str, list[float]] = {MODEL: [], ONE_STREAM: []}

    def next(self) -> tuple[str, bool]:
        """The schedule of the next call and whether it is timed."""
        n = self.calls
        self.calls += 1
        if n < 2:
            return (ONE_STREAM if n == 0 else MODEL), False
        return (MODEL if n % 2 == 0 else ONE_STREAM), True


class UncapturedChoice:
    """Chooses, per shape, whether the uncaptured calls of one owner run the cost model's lanes
    or one stream, by timing the calls themselves.

    Args:
        what: the graph's title (for messages).
        programs: the owner's program bound to its lanes (``"model"``) and to one stream
            (``"one_stream"``): callables of the call's arguments.
        lanes: the cost model's lane count (the record's).
        device: the CUDA device the calls run on.
        on_choice: called with each shape's :class:`PickRecord` (the graph's decisions and dump).
        shape_of: the shape text of a call's arguments, for the record and the log.
        sync: waits for the device (tests pass a fake).
        clock: the host clock in seconds (tests pass a fake).
    """

    def __init__(self, what: str, programs: dict[str, Any], lanes: int, device: torch.device,
                 on_choice: Callable[[PickRecord], None] | None = None,
                 shape_of: Callable[[Any], str] = str,
                 sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.what = what
        self.programs = programs
        self.lanes = lanes
        self.device = device
        self.on_choice = on_choice
        self.shape_of = shape_of
        self.sync = sync if sync is not None else (lambda: torch.cuda.synchronize(device))
        self.clock = clock
        #: shape key -> the bound program its calls run.
        self.chosen: dict[Hashable, Any] = {}
        self._trials: dict[Hashable, _Trial] = {}
        self.records: list[PickRecord] = []
        self._settled: str | None = None

    def call(self, key: Hashable, args: Any, run: Callable[[Any], Any]) -> Any:
        """Runs a call of the shape ``key`` (``run(program)`` runs a bound program on the call's
        arguments ``args`` and returns its results), measuring while the shape is undecided."""
        program = self.chosen.get(key)
        if program is not None:
            return run(program)
        trial = self._trials.get(key)
        if trial is None:
            if len(self.records) >= MAX_MEASURED:
                program = self.programs[self._settled or self._settle()]
                self._keep(key, program)
                return run(program)
            if len(self._trials) >= MAX_SHAPES:
                del self._trials[next(iter(self._trials))]
            trial = self._trials[key] = _Trial()
        name, timed = trial.next()
        if not timed:
            return run(self.programs[name])
        self.sync()
        start = self.clock()
        out = run(self.programs[name])
        self.sync()
        trial.times[name].append(self.clock() - start)
        if all(len(t) >= SAMPLES for t in trial.times.values()):
            if self._trials.pop(key, None) is trial:  # another thread's call may have decided it
                self._decide(key, args, trial)
        return out

    def _settle(self) -> str:
        """Fixes the schedule of shapes without a choice once the owner measures no more: the one
        most of its choices were (one stream on a tie); logged."""
        lanes = sum(r.choice == MODEL for r in self.records)
        settled = self._settled = MODEL if 2 * lanes > len(self.records) else ONE_STREAM
        log.info("capturepass: %s: %d shapes of its uncaptured calls measured; new shapes run %s from now on "
                 "(what %d of them chose), unmeasured", self.what, len(self.records), settled,
                 lanes if settled == MODEL else len(self.records) - lanes)
        return settled

    def _keep(self, key: Hashable, program: Any) -> None:
        """Runs ``program`` for the shape ``key`` from now on (the oldest shape kept dropped past
        :data:`MAX_SHAPES`): its calls take the executor's short path."""
        if len(self.chosen) >= MAX_SHAPES:
            del self.chosen[next(iter(self.chosen))]
        self.chosen[key] = program

    def _decide(self, key: Hashable, args: Any, trial: _Trial) -> None:
        medians = {n: statistics.median(t) * 1e6 for n, t in trial.times.items()}
        fastest = {n: min(t) * 1e6 for n, t in trial.times.items()}
        names = (MODEL, ONE_STREAM)
        choice = names[choose([medians[n] for n in names], [self.lanes, 1])]
        self._keep(key, self.programs[choice])
        record = PickRecord(
            graph=self.what, shape=self.shape_of(args), device=device_name(self.device), choice=choice,
            cached=False, budget_ms=0.0, rounds=SAMPLES, replays=trial.calls,
            candidates=[
                {"name": n, "lanes": self.lanes if n == MODEL else 1, "estimate_us": None,
                 "measured_us": round_us(medians[n]), "fastest_us": round_us(fastest[n]), "workspace_mib": None}
                for n in names
            ],
            uncaptured=True,
        )
        self.records.append(record)
        log.info("capturepass: %s: %s", self.what, record.text())
        if self.on_choice is not None:
            self.on_choice(record)
