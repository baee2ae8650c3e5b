"""One capture shape: the first call (warm-up and capture), and the replays after it.

The first call of a shape *is* the warm-up: the program runs eagerly on the
caller's arguments (lazy initialization, autotuning, cuBLAS handles) and its
results are what the call returns. It runs every lane on one stream: tuning a
kernel allocates a flush buffer the size of L2, and each side stream that runs a
matrix product holds a cuBLAS workspace of its own, so a warm-up on the lanes'
streams peaked with both (157 MiB against one lane's 92 on the MoE block on an
H200); the capture, which runs no kernel, allocates the side streams' workspaces
in the pool. While no graph of the model lives in its pool,
it warms up where the capture will run (the capture stream, the model's pool:
``CaptureMemory.warms_up_in_pool``), so that the captures reuse the memory it took;
the results it returns are copied out of the pool first, which stays the captures'.
Then every segment is captured into its own
CUDA graph in the pool its model's captures share, on one capture stream, in the
thread-local capture mode (``runtime.capture``). Capturing runs no kernel, and
breaks (non-capturable ops) do not run again during the capture: the segments
after a break are captured reading copies of the break's outputs from the
warm-up. So a call's visible effects (a buffer bumped in place, a cache written
at positions, a custom op's ``mutates_args``) happen once, the first call
included.

Later calls copy the values of non-static inputs into the capture's static
input buffers and replay; breaks run eagerly between segment replays, reading
the same buffers, their outputs copied into the next segment's staged buffers.
Inputs the graph writes in place are written in the buffers, so they are copied
back to the caller's tensors after the replay. Static inputs (parameters and
buffers of the module) and the inputs the executor chose to capture *in place*
(``in_place``: a KV cache the caller passes at one address every call) have no
buffer: the graphs read and write the caller's tensor itself, and its address
is part of the capture's key, so a call replays this capture only when the
tensor is where the graphs expect it.

Outputs that live in memory the next replay overwrites (the pool, the buffers)
are returned over aliases of that memory, copied out only when the caller still
holds them when it is about to be overwritten (``runtime.outputs``), unless
``static_outputs`` (returned as they are, overwritten by the next call).

Once captured, a capture of a model whose captures share a pool holds its outputs and its
static input buffers (moved into the pool before the capture) over non-owning storages
(:meth:`Capture._let_go`): their blocks go back to the pool, where the model's later captures
take them, as vLLM holds its graphs' outputs through weak references; captured largest
first, a model's sizes hold the memory of the largest, not the sum of their outputs.

A segment that reads a value its capture baked in but that changes at replay
(a break's output of another shape or stride, or a host scalar such as a size
or an ``.item()``) runs uncaptured from then on, and the log says so.

Captures that are not a call (``capture_sizes``) warm up on copies of the
inputs the graph writes, so that they leave no visible effect either (on the host where
the device cannot spare a copy: ``runtime.aside``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from capturepass.errors import CapturePassError, ResourceError
from capturepass.runtime import aside, capture, context, outputs, pools
from capturepass.runtime.owner import WARM_UP, GraphOwner
from capturepass.runtime.snapshot import Snapshot
from capturepass.runtime.program import Program
from capturepass.runtime.workspaces import locked_for_capture

log = logging.getLogger("capturepass")


# The largest written input whose value before the call is kept where the state after it would
# mislead (a probe of a failed capture, the measured choice's warm-ups on copies and timed
# replays): counters and positions, which pick where a graph writes, not caches, whose contents
# move no index and whose copy would cost their size again.
BEFORE_CALL_BYTES = 1 << 20


class CaptureFailure(Exception):
    """A segment failed to capture; the capture was ended and discarded.

    Attributes:
        piece: the index of the failing piece.
        error: what its capture raised.
        outputs: the warm-up's results (the call's own results when the warm-up was the call).
        env: values of every node the failing piece reads, for a probe (inputs the graph
            writes replaced by copies, or the caller's own where its device cannot spare a copy).
        device: the CUDA device.
        owner: the name of the owner whose capture failed (``g3.m0.c1``).
        undo: ``(tensor, copy)``: the caller's tensors in ``env`` and copies of them on the host,
            to put back after the probe (:meth:`put_back`).
    """

    def __init__(self, piece: int, error: BaseException, outputs: Any, env: dict[fx.Node, Any],
                 device: torch.device, owner: str = "",
                 undo: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        super().__init__(f"capturing piece {piece} of {owner or 'an owner'} failed: {type(error).__name__}: {error}")
        self.owner = owner
        self.piece = piece
        self.error = error
        self.outputs = outputs
        self.env = env
        self.device = device
        self.undo = list(undo)

    def put_back(self) -> None:
        """Puts back the caller's tensors the probe ran on (``undo``)."""
        aside.put_back(self.undo)


class InPlaceMoved(Exception):
    """A replay found inputs captured in place elsewhere than at capture once it had copied the
    model's held outputs out of the graph's memory (they were such outputs): nothing ran, and
    the call must go again on their new addresses.

    Attributes:
        positions: the input positions that moved.
    """

    def __init__(self, positions: Sequence[int]) -> None:
        super().__init__(f"inputs {list(positions)} captured in place moved")
        self.positions = tuple(positions)


def overlaps(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout addresses one element more than once (an ``expand``, stride 0), which
    ``copy_`` refuses to write; a call may pass such an input (position ids expanded over a batch)."""
    return t.numel() > 1 and torch._debug_has_internal_overlap(t) != 0


def span(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory from its first element to its last, as one flat view: two tensors of one
    layout hold the same values once their spans are equal, whatever the layout repeats."""
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((n,), (1,), t.storage_offset())


def fill(buf: torch.Tensor, src: torch.Tensor, by_span: bool) -> None:
    """Copies ``src`` into ``buf``, a tensor of the same layout: by :func:`span` where the layout
    :func:`overlaps`, else with ``copy_``."""
    if by_span:
        span(buf).copy_(span(src))
    else:
        buf.copy_(src)


def before_call(positions: Iterable[int], args: Sequence[Any]) -> dict[int, torch.Tensor]:
    """Copies of the arguments at ``positions`` that are tensors of at most
    :data:`BEFORE_CALL_BYTES` (counters, positions), by position: what they hold before a call."""
    return {i: args[i].clone() for i in positions if i < len(args) and isinstance(args[i], torch.Tensor)
            and args[i].numel() * args[i].element_size() <= BEFORE_CALL_BYTES}


def _in_pool_memory(t: torch.Tensor, shared: Any) -> bool:
    """Whether ``t`` is memory of the device whose graph pool ``shared`` holds.

    Only that pool keeps a block once no tensor owns it: host memory (a break's CPU result, a
    per-call CPU input's buffer) or another device's would go back to its allocator, which hands
    it to anything while the graphs and the copy in still write it.
    """
    return t.device == shared.capture_stream.device


def _storages(values: Iterable[Any]) -> set[int]:
    """The storages (``_cdata``) of the strided tensors among ``values``."""
    return {v.untyped_storage()._cdata for v in values if isinstance(v, torch.Tensor) and v.layout == torch.strided}


class Capture:
    """One capture shape: its owner, graphs and static buffers.

    Args:
        program: the program to capture.
        owner: the owner of the graphs, pool and buffers.
        static_outputs: return replayed outputs as they are, in the pool (overwritten by the
            next call); otherwise as aliases copied out only when still held at the next replay.
        written: input positions the graph writes in place.
        in_place: non-static input positions captured on the caller's tensor itself (no
            buffer, no copy); the caller keys this capture on their addresses.

    Attributes:
        outputs: the aliases of replayed outputs (``None`` with ``static_outputs``, or where
            torch cannot alias them: outputs are then copied out).
        input_copies: copies of inputs into buffers and back to the caller's tensors, over
            all replays (in-place inputs make none).
        replays: calls this capture ran.
        in_place_ptrs: the address each in-place input had at capture.
    """

    def __init__(self, program: Program, owner: GraphOwner, static_outputs: bool, written: frozenset[int],
                 in_place: frozenset[int] = frozenset()) -> None:
        self.program = program
        self.owner = owner
        self.static_outputs = static_outputs
        self.written = written
        self.in_place = in_place
        self.in_place_ptrs: dict[int, int] = {}
        self.outputs: outputs.OutputAliases | None = None
        self.input_copies = 0
        self.replays = 0
        self.watchers: list[Any] = []  # finalizers of the in-place inputs' storages
        self.eager_lanes = owner.lanes("eager")
        self.eager = program.bind(owner, self.eager_lanes)
        self.warm_up = program.bind(owner, owner.lanes(WARM_UP))  # every lane on one stream
        self.inputs: dict[int, torch.Tensor] = {}  # input position -> static buffer
        self.spans: set[int] = set()  # positions whose layout repeats memory (an expand): copied by span
        self.input_nodes: list[tuple[fx.Node, torch.Tensor]] = []
        self.copy_back: tuple[int, ...] = ()  # written inputs that have a buffer
        self.seg_in: dict[int, list[tuple[fx.Node, torch.Tensor]]] = {}  # piece -> (value, staged buffer)
        self.seg_scalars: dict[int, list[tuple[fx.Node, Any]]] = {}  # piece -> (host value, as captured)
        self.seg_out: dict[int, list[torch.Tensor]] = {}
        self.uncaptured: set[int] = set()
        self.snapshot: Snapshot | None = None
        self._warmed: tuple[dict[fx.Node, Any], Any] | None = None  # (values, results) of warm()
        self.outputs_dropped = False
        self.direct: _Direct | None = None  # the replay without a value environment, where it has none
        self.let_go = False  # outputs and input buffers held over non-owning storages (_let_go)
        # The call's arguments while the measured choice times this capture (``pick.replay_round``
        # copies them in first: another candidate's replays may have written the buffers).
        self.timing_args: Sequence[Any] | None = None
        # The values the call read of the inputs the graph writes, put back before each timed replay.
        self.timing_restore: Sequence[tuple[int, torch.Tensor]] | None = None
        self._read: dict[int, torch.Tensor] = {}  # written inputs before the call (``_warm``), until captured
        # The cuBLAS workspaces its capture allocated, bytes (``None``: not a CUDA capture).
        self.workspace_bytes: int | None = None

    # -- the first call ---------------------------------------------------------------------------
    def run(self, args: Sequence[Any], real: bool, before: Mapping[int, torch.Tensor] | None = None) -> Any:
        """Warms up, then captures every segment; returns the warm-up's results (``None`` when
        not ``real``).

        Args:
            args: the call's arguments.
            real: the warm-up is the call itself (its effects are the call's); otherwise
                it runs on copies of the inputs the graph writes.
            before: what inputs the graph writes held before the call, by position, where the
                call already ran (a warm-up on copies then copies these: the call's effects are
                not its inputs; a static cache's counter one step ahead would point it past the
                cache's end); the measured choice keeps the small ones (:data:`BEFORE_CALL_BYTES`).

        Raises:
            CaptureFailure: a segment failed to capture (not an error of capturepass's own).
        """
        with self.owner.lock:  # the model's other captures share the pool: not while one of them runs
            out = self._warm(args, real, before)
            self._capture_warmed(args)
            return out

    def warm(self, args: Sequence[Any], real: bool, before: Mapping[int, torch.Tensor] | None = None) -> Any:
        """The warm-up alone (see :meth:`run`: its results, ``None`` when not ``real``);
        :meth:`capture_warmed` captures it later. The
        measured choice warms every candidate up before it captures any: while no graph of the
        model lives in its pool, the warm-ups run there (``CaptureMemory.warms_up_in_pool``)."""
        with self.owner.lock:
            return self._warm(args, real, before)

    def capture_warmed(self, args: Sequence[Any]) -> None:
        """Captures every segment after :meth:`warm` (with the same ``args``).

        Raises:
            CaptureFailure: a segment failed to capture.
        """
        with self.owner.lock:
            self._capture_warmed(args)

    def _warm(self, args: Sequence[Any], real: bool, before: Mapping[int, torch.Tensor] | None = None) -> Any:
        program, owner = self.program, self.owner
        for i, (node, arg) in enumerate(zip(program.inputs, args)):
            if isinstance(arg, torch.Tensor) and i in self.in_place:
                self.in_place_ptrs[i] = arg.data_ptr()  # the graphs use the caller's tensor: held by nobody here
            elif isinstance(arg, torch.Tensor) and i not in program.static_inputs:
                # Filled before the warm-up, which may write the caller's tensor; where the call
                # already ran, with what it read.
                buf = torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device)
                if overlaps(buf):
                    self.spans.add(i)
                fill(buf, arg if before is None or i not in before else before[i], i in self.spans)
                self.inputs[i] = buf
                self.input_nodes.append((node, buf))
        self.copy_back = tuple(i for i in sorted(self.written) if i in self.inputs)
        # What the inputs the graph writes in place held before the call, for a probe of a failed
        # capture, which runs the failing piece's ops eagerly: an index read from a counter the
        # call moved (a static cache's length) would point one step past what the call wrote,
        # past the cache's end at its last slot (on a GPU a device-side assert). Small inputs
        # only (:data:`BEFORE_CALL_BYTES`).
        if before is not None:
            self._read = dict(before)
        elif real:
            self._read = before_call((i for i in self.written if i not in self.inputs), args)
        else:
            self._read = {}
        warm_args = list(args)
        undo: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not real:
            run, undo = aside.scratch(self._written_args(args), before or {}, f"{owner.name}: its warm-up")
            for i, t in run.items():
                warm_args[i] = t
        env = self.warm_up.initial_env(warm_args)
        shared = owner.shared
        if shared is not None:
            owner.begin_capture()  # the warm-up allocates in the pool the capture then uses
        routed = shared is not None and shared.warms_up_in_pool()
        try:
            with shared.warm_up() if routed else contextlib.nullcontext(), context.running(owner):
                for p in range(len(program.pieces)):
                    self.warm_up.run_piece(p, env)
        finally:
            aside.put_back(undo)
        out = self.warm_up.result(env)
        if real and routed:
            # The pool is the captures' memory: a result the caller keeps would pin its block
            # there for as long as it lives, past the release of every capture.
            out = outputs.copy_out(out, _storages([*args, *program.constants.values()]))
        # Until the capture, keep only what it reads of the warm-up: the values captured pieces
        # read and breaks produced (the capture and a failure's probe use them), and the results
        # of a real warm-up (the call's, if the capture fails). The results of a warm-up on
        # copies, which nobody reads, are neither kept nor returned: in the model's pool while no
        # graph lives there, they are freed now for the captures to take (the measured choice
        # warms every candidate up before it captures any).
        # The graph's inputs are not among them: the capture and the probe read the caller's
        # tensors (``_capture``, ``_probe_env``), and a warm-up on copies would otherwise keep a
        # copy of every input the graph writes (a whole KV cache) per candidate until captured.
        keep = {n for piece in program.pieces for n in piece.live_in}
        keep.update(n for piece in program.pieces if piece.kind == "break" for n in piece.live_out)
        keep.difference_update(program.inputs)
        if not real:
            out = None
        self._warmed = ({n: v for n, v in env.items() if n in keep}, out)
        return out

    def _capture_warmed(self, args: Sequence[Any]) -> None:
        owner = self.owner
        device = owner.device
        assert self._warmed is not None, "capture_warmed() before warm()"
        env, out = self._warmed
        self._warmed = None
        let_go = self._lets_go()
        if let_go:
            # The buffers below may take the block of another capture's output the caller holds.
            outputs.rescue_group(owner.shared.held_outputs)
            if capture.POOL_WARM_UP_UNSUPPORTED is None:
                self._buffers_into_pool()
        try:
            with self._capturing(device):
                self._capture(args, env, out)
        finally:
            self._read = {}
        if let_go:
            self._let_go(args)
            self.let_go = True
        self.snapshot = Snapshot.of(self)
        if not self.static_outputs and outputs.supported():
            self.outputs = outputs.OutputAliases(self._overwritten(args))
            owner.before_close.append(self.outputs.close)
            if owner.shared is not None:
                self.outputs.group = owner.shared.held_outputs
        self.direct = _Direct.of(self)

    # -- what a CUDA capture does (a host stand-in overrides these three) -------------------------
    @contextlib.contextmanager
    def _capturing(self, device: torch.device) -> Iterator[None]:
        """The scope of capturing every segment of this capture."""
        streams = 1 + len({id(s) for s in self.owner.streams if s is not None})
        with capture.exclusive(), capture.split_cublas_workspace(streams):  # cuBLAS's cache is the process's
            torch.cuda.synchronize(device)
            capture.clear_cublas_workspaces()  # so that the graphs allocate and own theirs
            try:
                yield
                torch.cuda.synchronize(device)
            finally:
                # The workspaces the capture allocated are the graphs' memory from now on (their
                # replays write them), freed into the pool as the capture's temporaries are: left
                # in cuBLAS's cache they stay allocated, and the next capture's warm-up, outside
                # the pool, peaks with them beside its own (cudagraph trees clear before and after).
                # What the clear gives back is what they held: one per stream that ran a matrix
                # product in the capture (``Picker`` reports it), each a share of the process's
                # size where torch can set it at run time (``capture.split_cublas_workspace``).
                held = torch.cuda.memory_allocated(device)
                capture.clear_cublas_workspaces()
                self.workspace_bytes = max(0, held - torch.cuda.memory_allocated(device))

    def _capture_stream(self) -> Any:
        """The stream the segments are captured on, ordered after the caller's."""
        stream = self.owner.begin_capture()
        stream.wait_stream(torch.cuda.current_stream(self.owner.device))
        return stream

    def _segment_graph(self, p: int, bound: Any, env: dict[fx.Node, Any], stream: Any) -> tuple[Any, Any]:
        """A fresh graph for piece ``p`` and the context that captures the piece's run into it
        (``env`` holds what the piece reads, its staged buffers in place)."""
        graph = torch.cuda.CUDAGraph()
        return graph, capture.segment(graph, self.owner.pool, stream, self.owner.side_streams)

    def _lets_go(self) -> bool:
        """Whether this capture holds its outputs (and, in the pool, its input buffers) over
        non-owning storages once captured (:meth:`_let_go`): with a pool its model's captures
        share, outputs handed out as aliases (rescued before any of their replays), and not
        ``static_outputs`` (returned as they are: they keep their memory)."""
        return self.owner.shared is not None and not self.static_outputs and outputs.supported()

    def _buffers_into_pool(self) -> None:
        """Moves the static input buffers into the model's pool (values kept), where
        :meth:`_let_go` can hand their blocks to the model's later captures."""
        shared = self.owner.shared
        moved: dict[int, torch.Tensor] = {}
        with capture.in_pool(self.owner.pool, shared.capture_stream, after=(shared.last_stream,)):
            for i, buf in self.inputs.items():
                if not _in_pool_memory(buf, shared):
                    continue  # a buffer of the host (or of another device) cannot go into the pool
                new = torch.empty_strided(buf.size(), buf.stride(), dtype=buf.dtype, device=buf.device)
                fill(new, buf, i in self.spans)
                moved[id(buf)] = new
        self._replace_buffers(moved)

    def _replace_buffers(self, new: dict[int, torch.Tensor]) -> None:
        """Swaps input buffers for the tensors ``new`` gives by ``id`` of the old one."""
        self.inputs = {i: new.get(id(b), b) for i, b in self.inputs.items()}
        self.input_nodes = [(node, new.get(id(b), b)) for node, b in self.input_nodes]

    def _let_go(self, args: Sequence[Any]) -> None:
        """Holds the captured outputs and the input buffers in the pool over non-owning storages.

        Their blocks go back to the pool the model's captures share, where its later (smaller,
        when captured largest first) captures take them: the memory held grows with the largest
        shape, not with the sum of its shapes' outputs (logits at every size of an LLM). The
        graph still writes the same addresses when it replays. That is safe because (1) the
        model's replays, warm-ups and captures run one at a time (its lock, and
        ``order_after_last`` across streams), and within one call an output is written by its
        segment's replay and read by later segments or breaks before any other capture replays;
        (2) an input buffer is written by the copy in at the start of every call (an output
        passed back as an input is rescued first, so it is never the buffer itself); (3) outputs
        the caller still holds are rescued before the replay of any capture of the model
        (``CaptureMemory.held_outputs``) and before a capture moves its buffers into the pool.
        Objects retained for the lanes keep their storages, and with them their blocks, and so
        does memory outside the pool's device (:func:`_in_pool_memory`).
        """
        theirs = _storages([*args, *self.program.constants.values()])
        theirs |= _storages(buf for staged in self.seg_in.values() for _, buf in staged)
        mine = [t for outs in self.seg_out.values() for t in outs if isinstance(t, torch.Tensor)]
        if capture.POOL_WARM_UP_UNSUPPORTED is None:
            mine += list(self.inputs.values())
        else:
            theirs |= _storages(self.inputs.values())  # outside the pool: their blocks are anyone's
        weak = outputs.non_owning(t for t in mine if t.layout == torch.strided and _in_pool_memory(t, self.owner.shared)
                                  and t.untyped_storage()._cdata not in theirs)
        for p, outs in self.seg_out.items():
            self.seg_out[p] = [weak.get(id(t), t) for t in outs]
        self._replace_buffers(weak)

    def _overwritten(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """Tensors over the memory a replay writes anew: segment outputs, input and staged buffers.

        A segment output over the caller's memory (a view of a parameter, of an in-place
        input, of a constant) is not: it is returned as it is, as eager returns it.
        """
        theirs = _storages([a for i, a in enumerate(args) if i in self.program.static_inputs or i in self.in_place])
        theirs |= _storages(self.program.constants.values())
        mine = [t for outs in self.seg_out.values() for t in outs if isinstance(t, torch.Tensor)]
        mine += [buf for staged in self.seg_in.values() for _, buf in staged]
        mine += list(self.inputs.values())
        return [t for t in mine if t.layout == torch.strided and t.untyped_storage()._cdata not in theirs]

    def _capture(self, args: Sequence[Any], warm: dict[fx.Node, Any], out: Any) -> None:
        program, owner = self.program, self.owner
        device = owner.device
        stream = self._capture_stream()
        # External joins run outside the graphs, around each segment's replay.
        bound = program.bind(owner, owner.lanes("capture:0"), externals=False)
        env = bound.initial_env(args)
        for node, buf in self.input_nodes:
            env[node] = buf
        fresh: set[fx.Node] = set()  # values computed anew at every call outside the graphs
        reason = f"capture of {owner.name}"
        with context.running(owner), owner.workspaces.locked(reason), locked_for_capture(reason), \
                pools.entered_for_capture(owner.name, stream):
            for p, piece in enumerate(program.pieces):
                if piece.kind == "break":
                    for node in piece.live_out:
                        env[node] = warm[node]  # the warm-up ran it: it does not run twice
                    fresh.update(piece.live_out)
                    self.uncaptured.add(p)
                    continue
                if not piece.has_kernels:
                    # Only views and host scalar math: nothing to capture, no effect to repeat.
                    bound.run_piece(p, env)
                    fresh.update(piece.live_out)
                    self.uncaptured.add(p)
                    continue
                staged, scalars = [], []
                for node in piece.live_in:
                    if node not in fresh:
                        continue
                    value = env[node]
                    if isinstance(value, torch.Tensor):
                        buf = value.clone()
                        env[node] = buf
                        staged.append((node, buf))
                    else:
                        scalars.append((node, value))
                graph, capturing = self._segment_graph(p, bound, env, stream)
                owner.graphs[piece.segment] = graph
                owner.capturing = piece.segment
                try:
                    with capturing:
                        bound.run_piece(p, env)
                except CapturePassError:
                    owner.graphs.pop(piece.segment, None)
                    raise
                except Exception as exc:  # noqa: BLE001 - the capture failed: the executor decides
                    owner.graphs.pop(piece.segment, None)
                    env, undo = self._probe_env(warm, args)
                    raise CaptureFailure(p, exc, out, env, device, owner.name, undo) from exc
                finally:
                    owner.capturing = None
                self.seg_in[p] = staged
                self.seg_scalars[p] = scalars
                self.seg_out[p] = [env[n] for n in piece.live_out]

    def _probe_env(self, warm: dict[fx.Node, Any],
                   args: Sequence[Any]) -> tuple[dict[fx.Node, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The values a failed capture's probe runs on, and the caller's tensors among them to put
        back after it: the probe runs the piece's ops once, on copies of the inputs the graph
        writes, or on the caller's own where the device cannot spare a copy (``runtime.aside``)."""
        env = dict(warm)
        written = {i: t for i, t in self._written_args(args).items() if i not in self.inputs}
        run, undo = aside.scratch(written, self._read, f"{self.owner.name}: the probe of its failed capture")
        for i, node in enumerate(self.program.inputs):
            if i in self.inputs:
                env[node] = self.inputs[i]  # still the call's input values: nothing ran in the capture
            elif i < len(args):
                env[node] = run.get(i, args[i])
        return env, undo

    def _written_args(self, args: Sequence[Any]) -> dict[int, torch.Tensor]:
        """The tensors among ``args`` the graph writes, by position."""
        return {i: args[i] for i in sorted(self.written) if i < len(args) and isinstance(args[i], torch.Tensor)}

    def drop_outputs(self) -> bool:
        """Lets go of the captured segment's outputs, for a capture that is only timed (a schedule
        candidate of the measured choice), then closed; returns whether it did.

        Their blocks go back to the model's pool, where the next candidate's capture takes them,
        so measuring holds one candidate's outputs, not one set per candidate. The graph still
        writes that memory when it replays, as the other candidate's graph does: harmless while
        the replays run one at a time, nothing reads their results, and the graph reads no
        output of its own (one captured segment: no later segment reads what it wrote, and
        values crossing its lanes inside it are retained by its owner, not returned). A
        capture of more than one segment, or whose segment reads staged buffers, keeps its
        outputs (``False``). Such a capture can no longer run a call (:meth:`replay` refuses).
        """
        if len(self.seg_out) != 1 or any(self.seg_in.values()):
            return False
        for p in self.seg_out:
            self.seg_out[p] = []
        if self.outputs is not None:
            self.outputs.close()  # it holds the static storages
        self.outputs_dropped = True
        self.direct = None
        return True

    # -- replays ----------------------------------------------------------------------------------
    def replay(self, args: Sequence[Any], check: bool = False) -> Any:
        """Copies the inputs in, replays the segments (breaks in between), copies written inputs back.

        Outputs the caller still holds from the previous replay are copied out of the
        memory first (an input may be one of them: it is read after its rescue).
        """
        program = self.program
        if self.outputs_dropped:
            raise ResourceError(f"{self.owner.name}: a capture whose outputs were dropped (a timed schedule "
                                "candidate) cannot run a call")
        if check and self.snapshot is not None:
            self.snapshot.check(self, args)
        self.replays += 1
        # The copies in and out are this owner's work too (an observer's owner range holds them).
        # The lock: the model's other captures share this one's temporaries (``CaptureMemory``).
        with self.owner.lock, context.running(self.owner):
            if self.owner.device is not None:
                self.owner.order_replay()
            if self.owner.shared is not None:
                # Any capture of the model: its outputs may lie in this one's temporaries.
                outputs.rescue_group(self.owner.shared.held_outputs)
            elif self.outputs is not None:
                self.outputs.rescue()
            if self.in_place_ptrs and (moved := self.moved_in_place(args)):
                raise InPlaceMoved(moved)
            self.input_copies += self.copy_in(args)
            direct = self.direct
            if direct is not None:
                graphs = self.owner.graphs
                for segment in direct.segments:
                    graphs[segment].replay()
                if self.copy_back:
                    self._copy_back(args)
                return direct.result(args, self.outputs)
            env: dict[fx.Node, Any] = dict(zip(program.inputs, args))
            env.update(program.constants)
            for node, buf in self.input_nodes:
                env[node] = buf  # breaks read and write what the segments read and write
            graphs = self.owner.graphs
            for p, piece in enumerate(program.pieces):
                if piece.kind == "break" or p in self.uncaptured or not self._stage(p, piece, env):
                    self.eager.run_piece(p, env)
                    continue
                joins = piece.external_joins
                for name, into in joins:
                    if into:
                        self.eager_lanes.join_external(name, True)
                graphs[piece.segment].replay()
                for name, into in joins:
                    if not into:
                        self.eager_lanes.join_external(name, False)
                for node, value in zip(piece.live_out, self.seg_out[p]):
                    env[node] = value
            self._copy_back(args)
            env.update(zip(program.inputs, args))  # an input returned as is is the caller's tensor
            out = self.eager.result(env)
            if self.static_outputs:
                return out
            if self.outputs is not None:
                return self.outputs.wrap(out)
            static = {id(t) for outs in self.seg_out.values() for t in outs if isinstance(t, torch.Tensor)}
            return fx.node.map_aggregate(
                out, lambda v: v.clone() if isinstance(v, torch.Tensor) and id(v) in static else v
            )

    def _copy_back(self, args: Sequence[Any]) -> None:
        """Copies the buffers of the inputs the graph writes back into the caller's tensors."""
        for i in self.copy_back:
            arg, buf = args[i], self.inputs[i]
            if arg.data_ptr() != buf.data_ptr():
                arg.copy_(buf)
                self.input_copies += 1

    def moved_in_place(self, args: Sequence[Any]) -> list[int]:
        """The in-place positions whose tensor in ``args`` is not where the graphs read it.

        The executor keys a capture on these addresses, so only a rescue can have moved one
        since: the caller handed back an output of the model, which lies in the graph's memory.
        """
        return [i for i, ptr in self.in_place_ptrs.items() if args[i].data_ptr() != ptr]

    def copy_in(self, args: Sequence[Any]) -> int:
        """Copies the values of the non-static inputs of ``args`` into the static input buffers;
        returns how many it copied (an input that is its buffer needs none). Static and in-place
        inputs are where the capture saw them: their addresses are part of the key."""
        n = 0
        spans = self.spans
        for i, buf in self.inputs.items():
            arg = args[i]
            if arg.data_ptr() != buf.data_ptr():
                if spans and i in spans:
                    span(buf).copy_(span(arg))
                else:
                    buf.copy_(arg)
                n += 1
        return n

    def release(self) -> None:
        """Stops watching the in-place inputs and closes the owner (held outputs are copied out first)."""
        for finalizer in self.watchers:
            finalizer.detach()
        self.watchers.clear()
        self.owner.close()

    def _stage(self, p: int, piece: Any, env: dict[fx.Node, Any]) -> bool:
        """Copies a segment's fresh inputs into its staged buffers; ``False`` if it must run uncaptured."""
        staged = self.seg_in[p]
        for node, buf in staged:
            value = env[node]
            if value.shape != buf.shape or value.stride() != buf.stride():
                return self._fall_back(p, piece, f"reads %{node.name} with shape {tuple(value.shape)} and stride "
                                       f"{value.stride()}, captured with {tuple(buf.shape)} and {buf.stride()}")
        for node, captured in self.seg_scalars[p]:
            if env[node] != captured:
                return self._fall_back(p, piece, f"reads the host value %{node.name} = {env[node]!r}, captured "
                                       f"with {captured!r}")
        for node, buf in staged:
            buf.copy_(env[node])
        return True

    def _fall_back(self, p: int, piece: Any, why: str) -> bool:
        log.warning("capturepass: %s: segment %s %s; running the segment uncaptured from now on",
                    self.owner.name, piece.segment, why)
        self.uncaptured.add(p)
        return False


# How a result of a direct replay is found: the value captured, an argument of the call, or an
# alias of the graph's memory handed out anew at every call.
_VALUE, _ARG, _ALIAS = 0, 1, 2


class _Direct:
    """A replay that needs no value environment: the segments to launch, in order, and where each
    result comes from (a capture's replay otherwise threads every value of the graph through a
    dictionary at each call, a few microseconds of host time on a decoder's 40 inputs).

    Attributes:
        segments: the segments to replay, in program order.
        leaves: per result, ``(kind, what, how)``: ``_VALUE`` and the value (a segment output the
            caller gets as it is, a constant), ``_ARG`` and the argument's position, ``_ALIAS``
            and the segment output over static memory with its storage's key and
            ``outputs.build_meta`` of it.
        container: builds the results from their list (the program's output is a flat tuple or list).
    """

    __slots__ = ("segments", "leaves", "container")

    def __init__(self, segments: tuple[int, ...], leaves: list[tuple[int, Any, Any]],
                 container: Callable[[list[Any]], Any]) -> None:
        self.segments = segments
        self.leaves = leaves
        self.container = container

    @classmethod
    def of(cls, cap: "Capture") -> "_Direct | None":
        """The direct replay of ``cap``, or ``None`` where a replay needs its environment: a
        piece that is not a captured segment (a break, views alone), staged buffers or host
        values to check, external joins, an output that requires grad or is copied out (no
        aliases here), or an output that is not a flat tuple or list of values."""
        program, aliases = cap.program, cap.outputs
        if cap.uncaptured or cap.outputs_dropped or (aliases is None and not cap.static_outputs):
            return None
        for p, piece in enumerate(program.pieces):
            if piece.kind != "segment" or piece.external_joins or cap.seg_in.get(p) or cap.seg_scalars.get(p):
                return None
        out = program.output
        if type(out) is tuple:
            container: Callable[[list[Any]], Any] = tuple
        elif isinstance(out, list):
            container = fx.immutable_collections.immutable_list  # what ``map_arg`` makes of a list
        else:
            return None
        produced: dict[fx.Node, Any] = {}
        for p, piece in enumerate(program.pieces):
            produced.update(zip(piece.live_out, cap.seg_out[p]))
        position = {node: i for i, node in enumerate(program.inputs)}
        leaves: list[tuple[int, Any, Any]] = []
        for leaf in out:
            if not isinstance(leaf, fx.Node):
                if isinstance(leaf, (tuple, list, dict)):
                    return None
                leaves.append((_VALUE, leaf, None))
            elif leaf in position:  # an input returned as is is the caller's tensor
                leaves.append((_ARG, position[leaf], None))
            elif leaf in program.constants:
                leaves.append((_VALUE, program.constants[leaf], None))
            elif leaf in produced:
                value = produced[leaf]
                if isinstance(value, torch.Tensor) and aliases is not None and aliases.is_static(value):
                    if value.requires_grad:
                        return None
                    leaves.append((_ALIAS, value, (value.untyped_storage()._cdata, outputs.build_meta(value))))
                else:
                    leaves.append((_VALUE, value, None))
            else:
                return None
        return cls(tuple(piece.segment for piece in program.pieces), leaves, container)

    def result(self, args: Sequence[Any], aliases: "outputs.OutputAliases | None") -> Any:
        """The call's results, after its replay."""
        fresh: dict[int, Any] = {}
        return self.container([
            what if kind == _VALUE else args[what] if kind == _ARG else aliases.alias(what, how[0], fresh, how[1])
            for kind, what, how in self.leaves
        ])
