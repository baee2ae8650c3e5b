"""Measured lane choice: the schedule candidates of a shape, timed as captured graphs.

The cost model that assigns lanes prices kernels by a roofline and every cross-lane
edge by a constant; on a real GPU a schedule it prefers can be slower than one lane
(a branch too short to pay for its fork and join, kernels that contend for the same
multiprocessors). So when a CUDA graph is captured for a new shape (option
``pick="measure"``, the default), :class:`Picker` captures every schedule candidate
the backend derived (``capturepass.backends.candidates``: the cost model's and one lane,
each compiled; fewer lanes, short lanes merged back and every lane on one stream, as lane
maps of the cost model's program, whose owner puts merged lanes on one stream) into its
own owner, replays each a few times
interleaved (a sample is a lead-in replay, then a few replays back to back between CUDA
events: the steady pace of one graph replayed again and again, as a served model runs it;
warm-up rounds first, then as many timed rounds as ``pick_budget_ms`` allows, at least one), keeps
the one with the lowest median (one lane within :data:`TIE` of the fastest wins the tie: no
side streams, no events, less memory), and closes the
others' owners.

Measuring holds the memory of about one capture, not one per candidate: a warm-up
keeps only what its capture reads (``Capture._warm``), a capture lets its outputs and input
buffers go back to the model's pool once captured (``Capture._let_go``), and before each
candidate is captured the one captured before it drops its outputs (``Capture.drop_outputs``,
for a capture that cannot let go), where the new capture takes them. The replays then write
memory the other candidates' replays write too, which is harmless while they run one at a
time and nothing reads their results; each candidate's input buffers are filled with the
call's inputs again before its timed replays. The last candidate captured keeps its outputs
(one lane's own program goes last); any other chosen candidate is captured once more,
anew, after the others are closed (warmed up on copies of the inputs the graph writes):
at a model's first shape its pool is then a new one, without what the warm-ups left there
(Triton's tuning buffer).

Only the captured segments are timed: breaks run eagerly around them, identical in
every candidate, and may have effects that must not repeat. Replays write the
static inputs the graph updates in place (a KV cache, a counter buffer) at their
own addresses; those are saved before the timed replays and restored after (on the host where
their GPU cannot spare twice their size: ``runtime.aside``), so
measuring leaves no visible effect. A replay of such a graph reads what it writes (a
cache's length counter picks where the next step writes): replayed again and again from
what the previous replay left, it would walk a static cache's counter past its end. So each
timed replay of a graph that writes its inputs starts from the values the call read of
the small ones (counters, positions: ``replay.BEFORE_CALL_BYTES``), put back before it
(``replay_round``). Candidates other than the cost model's warm up
on copies of the inputs the graph writes as the call read them (a chosen candidate captured
again too); the cost model's warm-up is the call itself (or, for ``capture_sizes``, on
copies too), as without measuring.

The choice is kept in a JSON file per key (device name, a hash of the graph before
lane assignment with the options that change its schedule, the shapes), under
``pick_cache_dir`` (or ``CAPTUREPASS_CACHE_DIR``, or ``capturepass/schedules`` under
torch's cache directory): another process that compiles the same graph captures
only the chosen candidate (``capturepass.runtime.choices``: the records and the cache), unless
the timings were unsteady (:func:`unsteady_timing`: other work shared the GPU, and the choice
holds for this process only). Each choice is also added to the graph's summary (every shape's choice, keyed by the graph's hash
before its schedule: ``ScheduleCache.add_shape``), which the graph's next compile reads before
compiling anything (``backends.dynamo``), and each shape where the cost model's lanes and one
lane were both measured leaves a lane sample of the device (``runtime.calibration``). A cache file that cannot be read or written is reported
once (a warning), and the candidates are measured anyway. A candidate that fails to
compile or to capture is left out (logged); timing that fails keeps the cost model's
schedule (a warning); the cost model's own capture failing is the executor's to handle,
as without measuring (the op becomes a break, and the rebuilt graph's candidates are
derived again).

Each choice is logged (one INFO line per candidate and one for the choice), added
to the graph record's decisions, and written to the graph's dump folder
(``choices.PICKS_FILE``), which ``capturepass show`` reads: every candidate's estimate (the
cost model's makespan) against its measured median, and the cuBLAS workspaces its capture
allocated. Each stream that runs a matrix product in a capture holds a workspace of its own
(two streams cannot share one while their kernels may run at once; PyTorch sizes it by
``CUBLAS_WORKSPACE_CONFIG``, 32 MiB on an H100 or H200): at a decode shape these are most of
what a schedule with side lanes holds beyond one lane's. Where torch can set the size at run
time (torch 2.13 has it, 2.11 not), a capture on several streams divides it among them
(``capture.split_cublas_workspace``), and the candidates are timed with the workspaces they
replay with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from capturepass.ir.options import PICK_LOCK_ENV
from capturepass.runtime import aside, files
from capturepass.runtime.choices import (PickRecord, ScheduleCache, device_name, round_us, shape_text,
                                         workspace_mib, workspace_text)
from capturepass.runtime.replay import before_call

log = logging.getLogger("capturepass")

# The first rounds let each candidate reach a steady state (instruction and L2 caches, clocks);
# the last of them prices a round for the budget.
WARMUP_ROUNDS = 2
# Timed rounds at most: medians of more samples than this do not change the choice.
MAX_ROUNDS = 25
# Replays per sample (``replay_round``): untimed lead-in replays, then timed replays back to back.
LEAD_IN = 1
REPEATS = 4
# A one-lane candidate within this fraction of the fastest median wins. The candidates are timed
# on one input; where a graph's work depends on its input's values (an MoE's routing) a
# schedule's time moves by a few percent from one input to the next (on an H200, a Qwen2-MoE
# decode graph's three lanes timed 1.1% faster than one lane on the call's tokens and 2.7% slower
# on the next call's), so a smaller gain is not one to pay side streams, events and memory for.
# Between schedules with side lanes it does not apply: on an H100 the same graph's three lanes
# timed 1.8-2.6% faster than its two-lane candidate in five processes, and held that gain on the
# bench's calls, while the two-lane choice cost the whole call 2.4%.
TIE = 0.02
# A candidate whose median is more than this fraction above its fastest sample was timed beside
# other work on the GPU for at least half its rounds (another process's kernels, Inductor's tuning
# or a capture of a neighbour): replays of one captured graph on one input do not vary so on their
# own. Such a choice holds for this process but is not cached, and its times calibrate nothing, so
# that a quiet process later measures the shape again. Fewer rounds than UNSTEADY_ROUNDS cannot
# tell a disturbance from a candidate's pace.
UNSTEADY = 0.10
UNSTEADY_ROUNDS = 3

# Before the timed replays of a graph that writes its inputs, the GPU spins this many cycles (about
# 0.5 ms on an H200) while the host launches the sample's restores and replays: each replay is
# then timed from when the GPU reaches it, not from when the host got to launching it.
LEAD_IN_CYCLES = 1_000_000

MeasureRound = Callable[[Sequence[Any], Sequence[int]], list[float]]


class CudaClock:
    """Times replays with CUDA events on the current stream (:func:`replay_round`'s clock)."""

    def lead(self) -> None:
        """Keeps the stream busy while the host launches what follows."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(LEAD_IN_CYCLES)

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream())
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def wait(self, mark: Any) -> None:
        mark.synchronize()


class CandidateLike(Protocol):
    """What the picker needs of a schedule candidate (``backends.candidates.Candidate``)."""

    name: str
    lanes: int
    estimate_us: float
    # The stream of each lane when it runs another candidate's program with lanes merged
    # (``None`` or absent: a program of its own).
    lane_map: tuple[int, ...] | None

    @property
    def program(self) -> Any:
        """The candidate's program, compiled on first use."""


# -- timing and choice -------------------------------------------------------------------------------


def _own(cand: Any) -> bool:
    """Whether a candidate runs one lane's own code: a program of its own with one lane, or a
    program compiled with lanes after fusion run without side streams (``own_one_lane``)."""
    return bool(getattr(cand, "own_one_lane", False)) or (cand.lanes == 1 and getattr(cand, "lane_map", None) is None)


def time_rounds(
    n: int, measure_round: Callable[[Sequence[int]], list[float]], budget_s: float,
    warmup: int = WARMUP_ROUNDS, max_rounds: int = MAX_ROUNDS, per_sample: int = 1,
) -> tuple[list[list[float]], int]:
    """Times ``n`` candidates in interleaved rounds within a budget; returns the timed samples
    per candidate (seconds per replay) and the number of replays run (warm-up included).

    Each round takes one sample of every candidate, in an order rotated from round to round so
    that no candidate always follows the same one. ``warmup`` rounds run first (not counted in
    the samples); the last of them prices a round, and as many timed rounds follow as fit in
    what remains of ``budget_s`` (at least one, at most ``max_rounds``).

    Args:
        n: how many candidates.
        measure_round: samples the candidates at the given indices once each, in that order;
            returns their times per replay in seconds, in that order.
        budget_s: the replay time the warm-up and timed rounds may take together.
        warmup: untimed rounds first.
        max_rounds: timed rounds at most.
        per_sample: replays one sample runs (``REPEATS + LEAD_IN`` for :func:`replay_round`).
    """
    spent, last = 0.0, [0.0] * n
    replays = 0
    for _ in range(warmup):
        last = list(measure_round(list(range(n))))
        spent += sum(last) * per_sample
        replays += n * per_sample
    round_s = sum(last) * per_sample
    rounds = max_rounds if round_s <= 0 else int(max(0.0, budget_s - spent) // round_s)
    rounds = max(1, min(max_rounds, rounds))
    samples: list[list[float]] = [[] for _ in range(n)]
    for r in range(rounds):
        order = [(i + r) % n for i in range(n)]
        for i, t in zip(order, measure_round(order)):
            samples[i].append(t)
        replays += n * per_sample
    return samples, replays


def unsteady_timing(median: float | None, fastest: float | None, rounds: int) -> bool:
    """Whether a candidate's samples show other work on the GPU: at least :data:`UNSTEADY_ROUNDS`
    timed rounds and a median more than :data:`UNSTEADY` above the fastest sample."""
    if median is None or fastest is None or rounds < UNSTEADY_ROUNDS or fastest <= 0:
        return False
    return median > fastest * (1.0 + UNSTEADY)


def choose(medians: Sequence[float | None], lanes: Sequence[int], tie: float = TIE,
           mapped: Sequence[bool] = ()) -> int:
    """The index of the chosen candidate: the fastest median, except that a one-lane candidate
    within ``tie`` (a fraction) of it wins (then a program of its own over a lane map of
    another's (``mapped``: its buffers are reused across lanes, so it holds less memory), then
    the faster, then the first). Between candidates with several lanes the faster wins: both
    pay for streams and events, and the measured gain is the only evidence either has.

    Raises:
        ValueError: no candidate has a median.
    """
    valid = [i for i, m in enumerate(medians) if m is not None]
    if not valid:
        raise ValueError("no candidate was measured")
    best = min(medians[i] for i in valid)  # type: ignore[type-var]
    close = [i for i in valid if medians[i] <= best * (1.0 + tie) and lanes[i] <= 1]  # type: ignore[operator]
    if close:
        return min(close, key=lambda i: (bool(mapped[i]) if i < len(mapped) else False, medians[i], i))
    return min(valid, key=lambda i: (medians[i], lanes[i], i))


def replay_round(caps: Sequence[Any], order: Sequence[int], repeats: int = REPEATS,
                 lead_in: int = LEAD_IN, clock: Any = None) -> list[float]:
    """Replays the captured segments of each capture in ``order`` on the current stream and
    returns each one's time per replay in seconds (one synchronize per round).

    Each capture first replays ``lead_in`` times untimed, then ``repeats`` times back to back
    between two CUDA events. An event records when the stream reaches it: had the timed replays
    started on an idle stream, the host's launch of the first would be counted, and the capture
    replayed just before (another candidate, with other buffers) would set the cache state it
    starts from. The lead-in keeps the stream busy while the timed replays are launched, so
    each sample is the steady pace of replays one after another, as a served model runs them.
    A capture whose ``timing_args`` are set first copies them into its input buffers, untimed.

    A capture whose ``timing_restore`` is set (a graph that writes its inputs) never replays
    from what an earlier replay left: a replay reads what it wrote before (a cache's length
    counter picks where the next step writes), and replays one after another would walk it
    past its end (on a GPU an index out of bounds is a device-side assert, which ends the
    process). Before each of its ``repeats`` replays the written inputs get the values the call
    read (``(position, value)`` pairs), untimed; each replay is timed alone, the stream kept
    busy by a spin (:data:`LEAD_IN_CYCLES`) while the host launches them.

    Args:
        clock: what times the replays (``lead``, ``mark``, ``seconds``, ``wait``): CUDA events
            on the current stream by default (:class:`CudaClock`).
    """
    clock = CudaClock() if clock is None else clock
    marks: list[tuple[list[tuple[Any, Any]], int]] = []
    for i in order:
        cap = caps[i]
        if getattr(cap, "timing_args", None) is not None:
            # Its input buffers are blocks of the model's pool: another candidate's replays
            # may have written them as temporaries (``Capture._let_go``).
            cap.copy_in(cap.timing_args)
        restore = getattr(cap, "timing_restore", None)
        if restore:
            clock.lead()
            pairs = []
            for _ in range(repeats):
                restore_written(cap, restore)
                start = clock.mark()
                replay_segments(cap)
                pairs.append((start, clock.mark()))
            marks.append((pairs, repeats))
            continue
        for _ in range(lead_in):
            replay_segments(cap)
        start = clock.mark()
        for _ in range(repeats):
            replay_segments(cap)
        marks.append(([(start, clock.mark())], repeats))
    clock.wait(marks[-1][0][-1][1])
    return [sum(clock.seconds(a, b) for a, b in pairs) / n for pairs, n in marks]


def restore_written(cap: Any, restore: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Puts back the values the call read into the inputs ``cap``'s graphs write: its input
    buffer where it has one, else the caller's tensor it captured in place (``timing_args``)."""
    for i, value in restore:
        dst = cap.inputs.get(i)
        (cap.timing_args[i] if dst is None else dst).copy_(value)


def replay_segments(cap: Any) -> None:
    """Replays the captured segments of one capture (not its breaks, nor its input copies)."""
    graphs = cap.owner.graphs
    for p, piece in enumerate(cap.program.pieces):
        if p in cap.seg_out and p not in cap.uncaptured:
            graphs[piece.segment].replay()


# -- the record of one choice ------------------------------------------------------------------------


# The turns this process holds, by lock path: a path's re-entrant lock (one thread at a time) and
# how deep its holder is. A second ``flock`` on another descriptor of the same file conflicts with
# the first even within one process, so a capture that measures its candidates inside a turn the
# process already holds (a benchmark timing its calls under the same lock, a new shape captured
# there) would wait on itself forever.
_turns: dict[str, tuple[threading.RLock, list[int]]] = {}
_turns_guard = threading.Lock()


@contextlib.contextmanager
def measuring_turn():
    """Holds an exclusive lock on the file ``CAPTUREPASS_PICK_LOCK`` names (when set) while the
    candidates are timed.

    Kernels of another process running on the same GPU share its multiprocessors and memory
    bandwidth with the replays being timed, and a schedule timed beside them can lose to one
    timed alone. Processes that compile on one GPU at once (several models served by one
    device, a benchmark's workers) set the same path and time their candidates one process at
    a time. Where the lock cannot be taken (no ``fcntl``, a path that cannot be opened), the
    candidates are timed without it, with a warning the first time for that path.

    The turn is re-entrant: within one that this thread already holds (a caller timing its own
    calls under it, whose call captures a new shape), it is held on, not taken again. Other
    threads of the process wait for it as other processes do.
    """
    path = os.environ.get(PICK_LOCK_ENV)
    if not path:
        yield
        return
    with _turns_guard:
        mutex, depth = _turns.setdefault(path, (threading.RLock(), [0]))
    with mutex, contextlib.ExitStack() as stack:
        depth[0] += 1
        stack.callback(depth.__setitem__, 0, depth[0] - 1)
        if depth[0] == 1:
            try:
                import fcntl

                f = stack.enter_context(open(path, "a"))
                fcntl.flock(f, fcntl.LOCK_EX)
                stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
            except (ImportError, OSError) as e:  # no fcntl, a path that cannot be opened, a file system without locks
                files.warn_once(f"lock:{path}", "capturepass: %s=%s: the lock cannot be taken (%s: %s); timing the "
                                "schedule candidates without it", PICK_LOCK_ENV, path, type(e).__name__, e)
        yield


# -- the picker --------------------------------------------------------------------------------------


class Picker:
    """Chooses among the schedule candidates of one graph, per capture shape.

    Args:
        graph: the graph's kind (for messages).
        candidates: the candidates, the cost model's first (its program compiled).
        graph_key: a stable hash of the graph before lane assignment and of the options
            that change its schedule (the cache key's graph part).
        budget_ms: the replay time measuring one shape may take.
        cache: where choices are kept (``None``: nowhere).
        on_pick: called with each shape's :class:`PickRecord` (the backend adds it to the
            graph record and the dump folder).
        measure_round: replays captures and times them (:func:`replay_round`; tests pass a
            fake with the same signature).
        per_sample: the replays one sample of ``measure_round`` runs (the budget's price of a
            round and the record's count).
        device_name: names the device for the cache key (:func:`device_name`; tests pass a fake).
        calibration: where the one-lane candidate's measured time goes as a sample of the
            device's cost model (``runtime.calibration``; ``None``: nowhere).
        rooflines: the graph's nominal kernel rooflines (``calibration.rooflines``), the
            sample's estimate side.
        hint_key: the hash of the graph before its schedule, under which each measured choice is
            added to the graph's summary (:meth:`ScheduleCache.add_shape`), which the next compile
            of the graph reads before compiling anything (``backends.dynamo``); ``None``: not kept so.

    Attributes:
        renew: given the program a rebuild made (a capture failed on an op, now a break), the
            picker of that program's candidates, or ``None`` (set by the backend).
        records: the choices made so far, one per shape.
    """

    def __init__(
        self, graph: str, candidates: Sequence[CandidateLike], graph_key: str, budget_ms: float,
        cache: ScheduleCache | None = None, on_pick: Callable[[PickRecord], None] | None = None,
        measure_round: MeasureRound = replay_round,
        device_name: Callable[[torch.device | None], str] = device_name,
        calibration: Any = None,
        rooflines: Sequence[tuple[float, int]] = (),
        hint_key: str | None = None,
        per_sample: int = REPEATS + LEAD_IN,
    ) -> None:
        self.graph = graph
        self.per_sample = per_sample
        self.candidates = list(candidates)
        self.graph_key = graph_key
        self.budget_ms = float(budget_ms)
        self.cache = cache
        self.on_pick = on_pick
        self.measure_round = measure_round
        self.device_name = device_name
        self.calibration = calibration
        self.rooflines = list(rooflines)
        self.hint_key = hint_key
        self.records: list[PickRecord] = []
        self.renew: Callable[[Any], Picker | None] | None = None

    def for_program(self, program: Any) -> "Picker | None":
        """The picker of ``program``: this one while it is the cost model's program of these
        candidates; after a rebuild (a capture failed on an op, now a break) one of the rebuilt
        graph's candidates, or ``None`` when there is none (logged)."""
        if program is self.candidates[0].program:
            return self
        renewed = self.renew(program) if self.renew is not None else None
        if renewed is None:
            log.info("capturepass: %s graph was rebuilt with a break and has no schedule candidates to measure; "
                     "new shapes run the cost model's schedule", self.graph)
        else:
            log.info("capturepass: %s graph was rebuilt with a break; its schedule candidates were derived again",
                     self.graph)
        return renewed

    def capture(
        self, executor: Any, args: Sequence[Any], real: bool, protect: Sequence[torch.Tensor] = (),
        device: torch.device | None = None,
    ) -> tuple[Any, Any]:
        """Captures the chosen candidate for the shapes of ``args``; returns ``(capture, outputs)``.

        The choice comes from the cache, or from capturing and timing every candidate.

        Args:
            executor: captures a program without keeping it (``_capture_program(program, args,
                real, candidate)`` returns a capture whose ``owner`` it closes to release it, and the
                warm-up's outputs; ``candidate`` is ``None`` for the cost model's, else the
                candidate's name, which its owner's name bears), or only warms it up
                (``_warm_program``, same arguments: the capture's ``capture_warmed(args)``
                captures it, ``drop_outputs()`` lets go of its outputs and says whether it did,
                ``outputs_dropped`` tells); its ``static_positions`` are the parameters, which the
                record's shape leaves out.
            args: the call's arguments.
            real: the cost model's warm-up is the call (its outputs are the call's results).
            protect: tensors the timed replays write in place at the caller's addresses; restored.
            device: the CUDA device (the cache key's device part).

        Raises:
            CaptureFailure: the cost model's candidate failed to capture (the executor makes the
                op a break, as without measuring).
        """
        dev = self.device_name(device)
        # The key holds every argument (the parameters' shapes too); the record, the dump and
        # the log show the call's own (a decoder has hundreds of parameters).
        key = ScheduleCache.key(dev, self.graph_key, shape_text(args))
        shape = shape_text(args, executor.static_positions)
        names = [c.name for c in self.candidates]
        entry = self.cache.get(key) if self.cache is not None else None
        if entry is not None and entry["choice"] not in names:
            log.info("capturepass: %s graph: the cached schedule %r is not a candidate here; measuring again",
                     self.graph, entry["choice"])
            entry = None
        if entry is not None:
            return self._cached(executor, args, real, protect, entry, shape, dev, key)
        return self._measure(executor, args, real, protect, shape, dev, key)

    def _cached(self, executor: Any, args: Sequence[Any], real: bool, protect: Sequence[torch.Tensor],
                entry: dict[str, Any], shape: str, dev: str, key: str) -> tuple[Any, Any]:
        from capturepass.runtime.replay import CaptureFailure

        index = [c.name for c in self.candidates].index(entry["choice"])
        cand = self.candidates[index]
        try:
            program = cand.program
        except Exception as e:  # noqa: BLE001 - the inner compiler failed on it here: measure the others
            log.warning("capturepass: %s graph: the cached schedule %s failed to compile (%s: %s); measuring again",
                        self.graph, cand.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return self._measure(executor, args, real, protect, shape, dev, key)
        # Should its capture fail, its warm-up was the call: the others then warm up and replay
        # from what the written inputs held before it.
        before = before_call(getattr(executor, "written", ()), args) if real else {}
        try:
            cap, out = executor._capture_program(program, args, real, None if index == 0 else cand.name,
                                                 lane_map=getattr(cand, "lane_map", None))
        except CaptureFailure as first:
            if index == 0:
                raise  # the cost model's program: the executor makes the op a break
            log.info("capturepass: %s graph: the cached schedule %s failed to capture (%s); measuring again",
                     self.graph, cand.name, first)
            # Its warm-up was the call (when real): the others warm up on copies, and the call's
            # results are that warm-up's.
            try:
                cap, _ = self._measure(executor, args, False, protect, shape, dev, key, before or None)
            except CaptureFailure as failure:
                failure.outputs = first.outputs
                raise
            return cap, first.outputs
        earlier = {c.get("name"): c for c in entry["record"].get("candidates", []) if isinstance(c, dict)}

        def number(name: str, field: str) -> float | None:
            # What the earlier process measured of each candidate (absent from an older record).
            value = earlier.get(name, {}).get(field)
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        cands = [{"name": c.name, "lanes": c.lanes, "estimate_us": round_us(c.estimate_us),
                  "measured_us": number(c.name, "measured_us"), "fastest_us": number(c.name, "fastest_us"),
                  "workspace_mib": number(c.name, "workspace_mib"), "note": None} for c in self.candidates]
        record = PickRecord(self.graph, shape, dev, cand.name, True, self.budget_ms, 0, 0, cands,
                            entry["record"].get("scale") if isinstance(entry["record"].get("scale"), float) else None)
        log.info("capturepass: %s graph, shape %s: schedule %s (%d lane(s)) from the schedule cache; nothing measured",
                 self.graph, shape, cand.name, cand.lanes)
        self._summarize(dev, args, cand.name)
        self._done(record)
        return cap, out

    def _measure(self, executor: Any, args: Sequence[Any], real: bool, protect: Sequence[torch.Tensor],
                 shape: str, dev: str, key: str,
                 before: dict[int, torch.Tensor] | None = None) -> tuple[Any, Any]:
        from capturepass.runtime.replay import CaptureFailure

        caps: list[Any] = []
        kept: list[int] = []
        notes: dict[int, str] = {}
        # What the inputs the graph writes hold before the call (the cost model's warm-up may be
        # the call): the other warm-ups copy it, and every timed replay starts from it
        # (``replay_round``); given where the call already ran.
        if before is None:
            before = before_call(getattr(executor, "written", ()), args)
        prior = {"before": before} if before else {}
        # Every candidate warms up before any is captured: while no graph lives in the model's
        # pool, the warm-ups allocate there (``CaptureMemory.warms_up_in_pool``), where the
        # captures then reuse their blocks. The cost model's first: its warm-up is the call, and
        # its failure to capture is the executor's.
        cap, out = executor._warm_program(self.candidates[0].program, args, real, None, **({} if real else prior))
        caps.append(cap)
        kept.append(0)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        failed: Exception | None = None
        try:
            for i, cand in enumerate(self.candidates[1:], start=1):
                try:
                    program = cand.program
                except Exception as e:  # noqa: BLE001 - a candidate the inner compiler fails on is left out
                    notes[i] = f"compile failed: {type(e).__name__}"
                    log.warning("capturepass: %s graph: schedule candidate %s failed to compile (%s: %s); "
                                "not measured", self.graph, cand.name, type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "")
                    continue
                c = executor._warm_program(program, args, False, cand.name,
                                           lane_map=getattr(cand, "lane_map", None), **prior)[0]
                caps.append(c)
                kept.append(i)
            caps[0].capture_warmed(args)  # a CaptureFailure here is the executor's (its outputs: the call's)
            # The candidates are only timed: before the next one is captured, the one before it
            # lets go of its outputs (``Capture.drop_outputs``), so that measuring holds one set;
            # the last one captured keeps its own. One lane's own program goes last: where it is
            # chosen (most dense models), the call needs no second capture.
            rest = sorted(zip(caps[1:], kept[1:]), key=lambda ci: self._own_one_lane(ci[1]))
            captured = [(caps[0], 0)]
            for c, i in rest:
                captured[-1][0].drop_outputs()
                try:
                    c.capture_warmed(args)
                except CaptureFailure as e:
                    notes[i] = f"capture failed: {type(e.error).__name__}"
                    log.info("capturepass: %s graph: schedule candidate %s failed to capture (%s); not measured",
                             self.graph, self.candidates[i].name, e)
                    c.owner.close()
                    continue
                captured.append((c, i))
            caps[:] = [c for c, _ in captured]
            kept[:] = [i for _, i in captured]
            saved = aside.kept(protect, f"{self.graph} graph's timed replays")
            for c in caps:
                c.timing_args = args
                c.timing_restore = list(before.items()) or None
            try:
                with measuring_turn():
                    samples, replays = time_rounds(
                        len(caps), lambda order: self.measure_round(caps, order), self.budget_ms / 1e3,
                        per_sample=self.per_sample)
            except Exception as e:  # noqa: BLE001 - the call must not fail for want of a measurement
                failed = e
        except BaseException:
            for c in caps:
                c.owner.close()
            raise
        finally:
            for c in caps:
                c.timing_args = c.timing_restore = None
            aside.put_back(saved)  # not held while the chosen candidate is captured again
        if failed is not None:
            log.warning("capturepass: %s graph, shape %s: timing the schedule candidates failed (%s: %s); keeping "
                        "the cost model's schedule (not cached)", self.graph, shape, type(failed).__name__, failed)
            for c in caps[1:]:
                c.owner.close()
            return self._recaptured_for_call(executor, args, caps[0], 0, prior, out), out
        medians: list[float | None] = [None] * len(self.candidates)
        fastest: list[float | None] = [None] * len(self.candidates)
        for j, i in enumerate(kept):
            medians[i] = statistics.median(samples[j]) * 1e6
            fastest[i] = min(samples[j]) * 1e6
        rounds = len(samples[0])
        unsteady = [c.name for i, c in enumerate(self.candidates) if unsteady_timing(medians[i], fastest[i], rounds)]
        lanes = [c.lanes for c in self.candidates]
        chosen = choose(medians, lanes, mapped=[not _own(c) and getattr(c, "lane_map", None) is not None
                                                for c in self.candidates])
        for j, i in enumerate(kept):
            if i != chosen:
                caps[j].owner.close()
        held = {i: workspace_mib(caps[j]) for j, i in enumerate(kept)}
        cands = [{"name": c.name, "lanes": c.lanes, "estimate_us": round_us(c.estimate_us),
                  "measured_us": round_us(medians[i]), "fastest_us": round_us(fastest[i]),
                  "workspace_mib": held.get(i), "note": notes.get(i)}
                 for i, c in enumerate(self.candidates)]
        # One lane's own program (a lane map onto one stream runs the lanes' program).
        one = next((i for i, c in enumerate(self.candidates) if _own(c) and medians[i] is not None), None)
        scale = None
        if one is not None and self.candidates[one].estimate_us > 0:
            scale = round(medians[one] / self.candidates[one].estimate_us, 4)  # type: ignore[operator]
        record = PickRecord(self.graph, shape, dev, self.candidates[chosen].name, False, self.budget_ms, rounds,
                            replays, cands, scale, unsteady)
        for c in cands:
            log.info("capturepass: %s graph, shape %s: schedule candidate %s (%d lane(s)): estimate %s us, %s%s",
                     self.graph, shape, c["name"], c["lanes"], c["estimate_us"],
                     f"measured {c['measured_us']} us" if c["measured_us"] is not None else f"not measured ({c['note']})",
                     workspace_text(c.get("workspace_mib")))
        log.info("capturepass: %s graph, shape %s: chose schedule %s (%d lane(s)), measured %s us over %d round(s)",
                 self.graph, shape, record.choice, self.candidates[chosen].lanes, round_us(medians[chosen]), rounds)
        if unsteady:
            log.warning("capturepass: %s graph, shape %s: the timings were unsteady (%s): other work shared the GPU "
                        "with the timed replays; the choice holds for this process only, is not cached and "
                        "calibrates nothing", self.graph, shape, record.unsteady_text())
        elif self.cache is not None:
            self.cache.put(key, record)
            self._summarize(dev, args, record.choice)
        if not unsteady and self.calibration is not None and one is not None and self.rooflines:
            # One lane's replay is the graph's kernels back to back: a measurement of what the
            # cost model estimates node by node, for the unmeasured schedules compiled from now on.
            try:
                model = self.calibration.add(dev, key, self.rooflines, medians[one] * 1e-6)  # type: ignore[operator]
            except Exception as e:  # noqa: BLE001 - the call must not fail for want of a calibration
                model = None
                log.warning("capturepass: %s graph: calibrating the cost model failed (%s: %s); later compiles keep "
                            "the model they had", self.graph, type(e).__name__, e)
            if model is not None:
                log.info("capturepass: %s graph, shape %s: %s; the unmeasured schedules compiled from now on on "
                         "this device (uncaptured or breakable graphs) use it", self.graph, shape, model.describe())
            self._lane_sample(dev, key, shape, one, medians)
        self._done(record)
        return self._recaptured_for_call(executor, args, caps[kept.index(chosen)], chosen, prior, out), out

    def _own_one_lane(self, index: int) -> bool:
        """Whether candidate ``index`` is one lane's own program (not a lane map of another's)."""
        return _own(self.candidates[index])

    def _recaptured_for_call(self, executor: Any, args: Sequence[Any], cap: Any, index: int,
                             prior: dict[str, Any], out: Any) -> Any:
        """:meth:`_recaptured`; a failure to capture the cost model's program again carries the
        call's results (``out``: its warm-up was the call), which the executor returns."""
        from capturepass.runtime.replay import CaptureFailure

        try:
            return self._recaptured(executor, args, cap, index, prior)
        except CaptureFailure as failure:
            failure.outputs = out
            raise

    def _recaptured(self, executor: Any, args: Sequence[Any], cap: Any, index: int,
                    prior: dict[str, Any]) -> Any:
        """``cap``, the chosen candidate's capture, or a new capture of it where measuring dropped
        its outputs (``Capture.drop_outputs``)."""
        if not cap.outputs_dropped:
            return cap
        cap.owner.close()
        return self._capture_again(executor, args, index, prior)

    def _capture_again(self, executor: Any, args: Sequence[Any], index: int, prior: dict[str, Any]) -> Any:
        """A new capture of candidate ``index``, warmed up on copies of the inputs the graph writes
        as they were before the call (``prior``: ``{"before": values}``; the call was the cost
        model's warm-up). A candidate other than the cost model's that fails to capture leaves the
        cost model's schedule (logged); the cost model's failure is the executor's, as without
        measuring."""
        from capturepass.runtime.replay import CaptureFailure

        cand = self.candidates[index]
        try:
            cap = executor._capture_program(cand.program, args, False, None if index == 0 else cand.name,
                                            lane_map=getattr(cand, "lane_map", None), **prior)[0]
        except CaptureFailure as e:
            if index == 0:
                raise
            log.warning("capturepass: %s graph: the chosen schedule %s failed to capture again (%s); running the "
                        "cost model's schedule", self.graph, cand.name, e)
            return self._capture_again(executor, args, 0, prior)
        return cap

    def _lane_sample(self, dev: str, key: str, shape: str, one: int, medians: Sequence[float | None]) -> None:
        """The cost model's lanes against one lane's own program, estimated and measured: a sample
        of the device's lane factor (``runtime.calibration``)."""
        model, single = self.candidates[0], self.candidates[one]
        if one == 0 or medians[0] is None or medians[one] is None or not single.estimate_us > 0:
            return
        estimated = model.estimate_us / single.estimate_us
        measured = medians[0] / medians[one]  # type: ignore[operator]
        try:
            factor = self.calibration.add_lanes(dev, key, estimated, measured)
        except Exception as e:  # noqa: BLE001 - the call must not fail for want of a calibration
            log.warning("capturepass: %s graph: keeping the lane sample failed (%s: %s)", self.graph,
                        type(e).__name__, e)
            return
        if factor is not None:
            log.info("capturepass: %s graph, shape %s: lanes over one lane estimated %.3f, measured %.3f; this "
                     "device's lane factor (measured over estimated, median) is now %.3f", self.graph, shape,
                     estimated, measured, factor)

    def _summarize(self, dev: str, args: Sequence[Any], choice: str) -> None:
        """Adds the choice of the shapes of ``args`` to the graph's summary (``hint_key``), if kept."""
        if self.hint_key is None or self.cache is None:
            return
        self.cache.add_shape(ScheduleCache.graph_summary_key(dev, self.hint_key), shape_text(args), choice)

    def _done(self, record: PickRecord) -> None:
        self.records.append(record)
        if self.on_pick is not None:
            self.on_pick(record)
