"""Fakes of the picker's executor and timer, for the measured choice's tests on the CPU.

Nothing is captured on the CPU: :class:`FakeExecutor`'s captures are records of which program
was captured, and :class:`FakeTimer` gives each candidate's replay a fixed time, so that every
count a test reads is exact.
"""

from __future__ import annotations

import dataclasses

from capturepass.runtime.pick import Picker, ScheduleCache


@dataclasses.dataclass
class Cand:
    name: str
    lanes: int
    estimate_us: float
    program: object = dataclasses.field(default_factory=object)


class FakeOwner:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class FakeCap:
    """A capture that keeps its outputs when measuring asks (as one of several segments does)."""

    outputs_dropped = False

    def __init__(self, program, failure=None, name="model"):
        self.program, self.owner, self.failure, self.name = program, FakeOwner(), failure, name

    def capture_warmed(self, args):
        if self.failure is not None:
            raise self.failure

    def drop_outputs(self):
        return False


class FakeExecutor:
    def __init__(self, workspaces=None):
        self.static_positions = ()
        self.captured = []
        self.names = []  # the candidate name each capture's owner bears (None: the cost model's)
        # The cuBLAS workspaces each candidate's capture allocates, bytes (by name; absent: unknown).
        self.workspaces = workspaces or {}

    def _warm_program(self, program, args, real, candidate, lane_map=None):
        self.captured.append((program, real))
        self.names.append(candidate)
        cap = FakeCap(program, name=candidate or "model")
        cap.workspace_bytes = self.workspaces.get(cap.name)
        return cap, ("warm-up of", program)

    def _capture_program(self, program, args, real, candidate, lane_map=None):
        cap, out = self._warm_program(program, args, real, candidate)
        cap.capture_warmed(args)
        return cap, out


class FakeTimer:
    """Each candidate's replay takes a fixed time (microseconds, by candidate name)."""

    def __init__(self, us, written=None):
        self.us, self.written, self.replays = us, written, 0

    def __call__(self, caps, order):
        self.replays += len(order)
        if self.written is not None:
            self.written.add_(1.0)  # a replay writes a static input in place
        return [self.us[caps[i].name] / 1e6 for i in order]


def fake_picker(tmp_path, us, budget_ms=2.0, device="FakeGPU sm90", graph="g0", cands=None, written=None, **kw):
    cands = cands or [Cand("model", 3, 20.0), Cand("one_lane", 1, 34.0), Cand("aux1", 2, 22.0)]
    timer = FakeTimer(us, written)
    picked = []
    p = Picker("inference", cands, graph, budget_ms, ScheduleCache(tmp_path / "cache"), picked.append,
               measure_round=timer, device_name=lambda d: device, per_sample=1, **kw)
    return p, timer, picked, cands
