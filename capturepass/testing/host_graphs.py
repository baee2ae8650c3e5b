"""CUDA graphs stood in for on a machine without CUDA, so that a capture's replays run on the host.

A CUDA graph records the kernels of a segment once and replays them on the same memory: its
inputs are read where the capture found them (static input buffers, staged buffers, the
caller's parameters) and its outputs are written where the capture allocated them, the same
tensors every replay. Nothing of that can be captured without CUDA, but its effect on memory
can be reproduced: :class:`HostGraph` keeps the values the segment read at capture (the same
tensor objects) and, at each replay, runs the segment's code again on them and writes what it
computed into the tensors the capture returned. Everything around the launch is capturepass's
real replay path (:class:`capturepass.runtime.replay.Capture`): the copies into the input
buffers and back to written inputs, staged buffers of breaks, outputs handed out as aliases of
the graph's memory and rescued when still held, inputs read in place.

Only the graph is a stand-in. Its "capture" runs the segment (to make its outputs) and then
puts back the memory of everything the segment read, so that, as with a CUDA capture, which
runs no kernel, its writes in place happen at the warm-up and the replays only. It runs on the
values the warm-up read: an input the warm-up wrote in place (a cache's length counter) holds
its value from before the warm-up while the segment runs, as a capture that ran its kernels
right after the warm-up would otherwise compute from a state one step ahead (an index one past
a cache's end), where a CUDA capture computes nothing. :func:`replay_on_host` makes the executors built from then on
capture this way::

    from capturepass.testing.host_graphs import replay_on_host

    undo = replay_on_host()
    compiled = torch.compile(model, backend="capturepass", options={"cudagraphs": "monolithic"})
    ...
    undo()

:func:`measure_on_host` adds the measured lane choice a GPU makes at each capture shape: the
schedule candidates captured on host graphs and timed by the wall clock (:class:`HostClock`)
through the picker's real replay rounds (``capturepass.runtime.pick.replay_round``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from capturepass.runtime import executor as executor_module
from capturepass.runtime import outputs
from capturepass.runtime.replay import Capture


class HostGraph:
    """Stands in for one segment's CUDA graph on the host.

    Args:
        capture: the capture the segment belongs to; its ``seg_out`` (the dictionary, whose
            entries the capture replaces when it lets its outputs go) holds the graph's outputs.
            The capture itself is not held, as a CUDA graph does not hold it.
        piece: the segment's piece index.
        bound: the program bound to the capture's lanes.
        env: the values the segment reads, as they are when its capture begins.
        run: whether :meth:`replay` runs the segment (``False``: a launch that does nothing, to
            time the path around it).

    Attributes:
        replays: how many times it replayed.
    """

    def __init__(self, capture: Capture, piece: int, bound: Any, env: dict[fx.Node, Any], run: bool = True) -> None:
        self.outputs = capture.seg_out
        self.piece = piece
        self.bound = bound
        reads = {n: env[n] for n in bound.program.pieces[piece].live_in}
        # A CUDA graph holds addresses, not tensors: an input read in place dies with its
        # caller's tensor (the executor then releases the capture), whatever the graph read.
        weak = outputs.non_owning(v for v in reads.values() if isinstance(v, torch.Tensor))
        self.reads = {n: weak.get(id(v), v) for n, v in reads.items()}
        self.run = run
        self.replays = 0

    def replay(self) -> None:
        """Runs the segment on the memory it was captured on; writes its results where the
        capture's outputs live."""
        self.replays += 1
        if not self.run:
            return
        env = dict(self.reads)
        self.bound.run_piece(self.piece, env)
        piece = self.bound.program.pieces[self.piece]
        written: set[int] = set()
        with torch.no_grad():
            for node, static in zip(piece.live_out, self.outputs[self.piece]):
                value = env[node]
                if not isinstance(static, torch.Tensor):
                    continue
                into, out = static.untyped_storage(), value.untyped_storage()
                if into._cdata in written or into.data_ptr() == out.data_ptr():
                    continue  # written already (a view of another output), or in place
                written.add(into._cdata)
                if into.nbytes() == out.nbytes() and static.storage_offset() == value.storage_offset():
                    # The whole allocation, as a graph writes it: outputs that are views of one
                    # another (an expand, an overlapping as_strided) cannot take a copy_ each.
                    into.copy_(out)
                else:
                    static.copy_(value)


class HostGraphCapture(Capture):
    """:class:`Capture` with :class:`HostGraph` for its graphs: the real warm-up, capture
    bookkeeping and replay path, on the host. :attr:`run_segments` ``False`` makes every replay's
    launch do nothing (timing the path around it)."""

    run_segments = True
    # The memory of each input the graph writes, as it was before the warm-up (storage id ->
    # a copy), from the warm-up until the capture.
    _before_warm_up: dict[int, Any] | None = None

    def _warm(self, args: Any, real: bool, before: Any = None) -> Any:
        kept: dict[int, Any] = {}
        for i in self.written:
            a = args[i] if i < len(args) else None
            if isinstance(a, torch.Tensor) and a.layout == torch.strided and a.untyped_storage().nbytes():
                storage = a.untyped_storage().clone()
                if before is not None and i in before:
                    # The call already ran (the measured choice's other candidates): the capture
                    # runs on what it read, as the warm-up on copies did.
                    view = torch.empty(0, dtype=a.dtype, device=a.device)
                    view.set_(storage, a.storage_offset(), a.size(), a.stride()).copy_(before[i])
                kept[a.untyped_storage()._cdata] = storage
        self._before_warm_up = kept
        return super()._warm(args, real, before)

    def _capture_warmed(self, args: Any) -> None:
        try:
            super()._capture_warmed(args)
        finally:
            self._before_warm_up = None

    @contextlib.contextmanager
    def _capturing(self, device: torch.device | None) -> Iterator[None]:
        yield

    def _capture_stream(self) -> Any:
        return None

    def _segment_graph(self, p: int, bound: Any, env: dict[fx.Node, Any], stream: Any) -> tuple[Any, Any]:
        reads = [env[n] for n in bound.program.pieces[p].live_in]
        return (HostGraph(self, p, bound, env, run=self.run_segments),
                _without_effects(reads, self._before_warm_up or {}))


@contextlib.contextmanager
def _without_effects(reads: list[Any], before_warm_up: dict[int, Any]) -> Iterator[None]:
    """Runs the block on the values the warm-up read (the memory of each tensor of ``reads`` that
    ``before_warm_up`` holds is put back to it first), then puts back the memory of every tensor
    of ``reads`` as it was before the block: a CUDA capture runs no kernel, so what the segment
    writes in place (an input, a buffer, a cache) is written by the warm-up and the replays only;
    here the block runs it, and its writes are undone."""
    saved: dict[int, tuple[Any, Any]] = {}
    for v in reads:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided:
            storage = v.untyped_storage()
            if storage._cdata not in saved and storage.nbytes():
                saved[storage._cdata] = (storage, storage.clone())
    for key, (storage, _) in saved.items():
        if key in before_warm_up:
            storage.copy_(before_warm_up[key])
    try:
        yield
    finally:
        for storage, now in saved.values():
            storage.copy_(now)


def replay_on_host(run_segments: bool = True, capture_class: type[HostGraphCapture] | None = None,
                   set_attr: Callable[[Any, str, Any], None] = setattr) -> Callable[[], None]:
    """Makes the executors built from now on capture with :class:`HostGraphCapture` (or
    ``capture_class``, a subclass) wherever a GPU would capture; returns the function that undoes
    it. ``set_attr`` makes the two changes (``monkeypatch.setattr`` in a test, which undoes them)."""
    saved_capture, init = executor_module.Capture, executor_module.Executor.__init__
    cls = capture_class or type("HostGraphCapture", (HostGraphCapture,), {"run_segments": run_segments})

    def host_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.program.info.captured and self.uncaptured_reason is None:
            self.captured = True

    set_attr(executor_module, "Capture", cls)
    set_attr(executor_module.Executor, "__init__", host_init)

    def undo() -> None:
        executor_module.Capture = saved_capture
        executor_module.Executor.__init__ = init

    return undo


class HostClock:
    """Times host graph replays by the wall clock: ``pick.replay_round``'s clock on the host."""

    def lead(self) -> None:
        """Nothing runs ahead of the host here."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        """Host replays are done when they return."""


def measure_on_host(set_attr: Callable[[Any, str, Any], None] = setattr) -> Callable[[], None]:
    """Makes the compiles from now on measure their schedule candidates at each capture shape, as
    on a GPU (``pick="measure"``), over host graphs (use with :func:`replay_on_host`): each
    candidate captured, replayed by ``pick.replay_round`` with a :class:`HostClock`, the choice
    kept in no cache. Returns the function that undoes it; ``set_attr`` as for
    :func:`replay_on_host`."""
    from capturepass.backends import dynamo
    from capturepass.runtime import pick

    make = dynamo._picker

    def host_picker(*args: Any, **kwargs: Any) -> Any:
        picker = make(*args, **dict(kwargs, on_cuda=True))
        if picker is not None:
            picker.measure_round = lambda caps, order: pick.replay_round(caps, order, clock=HostClock())
            picker.device_name = lambda device: "host"
            picker.cache = picker.calibration = None  # nothing kept for another process
        return picker

    set_attr(dynamo, "_picker", host_picker)

    def undo() -> None:
        dynamo._picker = make

    return undo
