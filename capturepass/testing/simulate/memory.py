"""The simulator's memory model: values, poison, and vector-clock happens-before over storage blocks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from capturepass.ir import collectives

_RNG_KEY = -2  # the generator's hidden state, as a storage block random ops read and write


@contextlib.contextmanager
def seeded_rng() -> Iterator[None]:
    """Within the block the CPU generator starts from the state every simulated and serial run
    starts from (the caller's state is restored after it), so that random ops drawn in another
    order than serial execution's give other values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0x5EED)
        yield


@dataclasses.dataclass(frozen=True, order=True)
class Race:
    """Two accesses to one storage block that no event orders.

    Attributes:
        first / second: the two nodes, earlier in program order first (``output`` for the
            graph's output, read on the main lane).
        storage: the node that allocated the block (or the input / constant).
        kind: ``"read-write"`` (a read and a later write, such as a reuse after free),
            ``"write-read"`` (a read not ordered after the write it needs), ``"write-write"``,
            or ``"serialize"`` (a node not ordered with a serialized op; ``storage`` is empty).
    """

    first: str
    second: str
    storage: str
    kind: str

    def __str__(self) -> str:
        if self.kind == "serialize":
            return f"%{self.first} and %{self.second} may run concurrently, but one of them is serialized"
        return f"%{self.first} and %{self.second} race on the storage of %{self.storage} ({self.kind})"


@dataclasses.dataclass
class SimResult:
    """One simulated run.

    Attributes:
        outputs: the graph's outputs as read by the main lane at the output.
        inputs: the inputs after the run (copies; in-place mutations show here).
        trace: the executed order, ``"s1:%mm"`` per lane step.
        races: unordered access pairs (empty for a correctly synchronised graph).
        reused: how many freed blocks the allocator handed to a later allocation.
    """

    outputs: Any
    inputs: list[Any]
    trace: list[str]
    races: list[Race]
    reused: int


def _poison(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        elif t.dtype == torch.int8:
            t.fill_(-91)
        else:
            t.fill_(-1234567)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _storage_key(t: torch.Tensor) -> int | None:
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _buffer_like(ref: Any) -> Any:
    if isinstance(ref, torch.Tensor):
        if torch._debug_has_internal_overlap(ref) == 1:
            buf = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
        else:
            buf = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=ref.device)
        _poison(buf)
        return buf
    if isinstance(ref, (tuple, list)):
        return type(ref)(_buffer_like(r) for r in ref)
    return ref


def _copy_into(buf: Any, value: Any) -> None:
    if isinstance(buf, torch.Tensor):
        with torch.no_grad():
            buf.copy_(value)
    elif isinstance(buf, (tuple, list)):
        for b, v in zip(buf, value):
            _copy_into(b, v)


def _run_node(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    value = node.target(*args, **kwargs)
    if collectives.is_collective(node):
        # NOTE: a functional collective returns before its work completes; wait_tensor finds the
        # work by the output's storage. The simulator copies values into buffers of its own (its
        # allocations), so the graph's wait_tensor would see another storage and wait for
        # nothing: complete the work here. The lanes and events model when it completes.
        value = torch.utils._pytree.tree_map_only(torch.Tensor, collectives.WAIT_TENSOR, value)
    return value


@dataclasses.dataclass
class _Access:
    node: str
    order: int
    lane: int
    epoch: int


class _Memory:
    """Vector-clock happens-before over storage blocks."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.write: dict[int, _Access] = {}
        self.reads: dict[int, list[_Access]] = {}
        self.races: dict[tuple[str, str, str], Race] = {}

    @staticmethod
    def _before(a: _Access, clock: list[int]) -> bool:
        return a.epoch <= clock[a.lane]

    def _race(self, a: _Access, b: _Access, key: int, kind: str) -> None:
        first, second = (a, b) if a.order <= b.order else (b, a)
        storage = "" if key == -1 else self.owner.get(key, "?")
        self.races.setdefault((first.node, second.node, storage), Race(first.node, second.node, storage, kind))

    def read(self, key: int, acc: _Access, clock: list[int]) -> None:
        w = self.write.get(key)
        if w is not None and not self._before(w, clock):
            self._race(w, acc, key, "write-read")
        self.reads.setdefault(key, []).append(acc)

    def do_write(self, key: int, acc: _Access, clock: list[int]) -> None:
        w = self.write.get(key)
        if w is not None and not self._before(w, clock):
            self._race(w, acc, key, "write-write")
        for r in self.reads.get(key, ()):
            if r.node != acc.node and not self._before(r, clock):
                self._race(r, acc, key, "read-write")
        self.write[key] = acc
        self.reads[key] = []
