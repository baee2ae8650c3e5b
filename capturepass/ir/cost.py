"""A per-node cost model: FLOPs and bytes, symbolic where shapes are dynamic.

FLOPs come from PyTorch's own formula table (``torch.utils.flop_counter``),
bytes from the tensors a node reads and writes. With dynamic shapes both are
sympy expressions over the graph's size symbols; the numbers used for
scheduling are those expressions evaluated at the shape hints, and the formula
is kept for the dump. When a formula is missing or fails, the estimate degrades
to the bytes alone, marked inexact, instead of failing the compile.

:func:`node_time` turns a cost into a time (seconds) under a :class:`DeviceModel`:
the roofline on a nominal device, scaled, with a floor per kernel. Ratios between
nodes drive the schedule; absolute times matter against the fixed costs the
scheduler weighs them with (an event record and wait, ``merge_lanes_below_us``).
:func:`fit` calibrates a device model from measured graph times (one lane's
captured replay is its kernels back to back), and :func:`device_model` makes one
current for the passes that read costs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, shape_wrapper

from capturepass.ir.meta import Cost

# Nominal device: an H200 (dense bf16 matmul, HBM bandwidth). Only ratios matter.
PEAK_FLOPS = 790e12
PEAK_BYTES_PER_S = 4.0e12
# A kernel launch's floor: even a tiny kernel occupies its lane this long.
LAUNCH_FLOOR_S = 2e-6


def fuses(node: fx.Node) -> bool:
    """Whether Inductor generates ``node`` into a kernel it fuses with its neighbours.

    Such a node (pointwise, a reduction, a gather or scatter: an ATen or prims op Inductor
    lowers itself) launches no kernel of its own when its producer or reader sits beside it;
    what :func:`node_time` prices as a launch of its own is then folded into theirs. Matrix
    products, attention, collectives, custom ops and the ATen kernels Inductor falls back
    to (``torch._inductor.lowering.fallbacks``) are kernels of their own (their inputs are
    realized: ``needs_realized_inputs``).
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace not in ("aten", "prims") or target.overloadpacket in flop_registry:
        return False
    lowering, decompositions = _inductor_tables()
    if target in lowering.fallbacks or target in lowering.needs_realized_inputs \
            or target.overloadpacket in lowering.needs_realized_inputs:
        return False
    # An op Inductor decomposes (``silu``, ``_softmax``, ``arange``) becomes ops it lowers.
    return target in lowering.lowerings or target in decompositions


@functools.cache
def _inductor_tables() -> tuple[Any, Any]:
    # Imported on first use: the import registers every lowering (seconds), which a compile
    # through Inductor pays anyway and a graph with one lane never needs.
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table

    return lowering, select_decomp_table()


def _numeric(x: Any) -> tuple[float, str | None]:
    """A value and, when symbolic, its formula."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        node = x.node
        expr = node.expr
        hint = node.hint
        if hint is None:
            env = node.shape_env
            # The same hint-or-raise (an unbacked symbol has none); torch 2.13 deprecates size_hint
            # for it, with a FutureWarning the user would see.
            hint_of = getattr(env, "guarding_hint_or_throw", None) or env.size_hint
            try:
                hint = hint_of(expr)
            except Exception:
                hint = None
        if isinstance(expr, sympy.Expr) and expr.free_symbols:
            return (float(hint) if hint is not None else float("nan")), str(expr)
        return float(hint if hint is not None else expr), None
    return float(x), None


def _tensor_bytes(t: torch.Tensor) -> Any:
    return t.numel() * t.element_size()


def _io_tensors(node: fx.Node) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(v)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        out.append(val)
    elif isinstance(val, (list, tuple)):
        out.extend(v for v in val if isinstance(v, torch.Tensor))
    return out


# torch wraps most FLOP formulas in ``shape_wrapper``: such a formula sees the shapes of the
# tensor arguments and the other arguments as they are, nothing else. For those, the count on
# static shapes is kept per (formula, argument shapes and values): graphs repeat a few call
# signatures many times, and converting arguments to shapes costs more than the formula.
_SHAPE_ONLY_CODE = shape_wrapper(lambda: None).__code__
_FLOP_CACHE: dict[tuple, int] = {}
_FLOP_CACHE_MAX = 4096


class _Uncacheable(Exception):
    pass


def _static_key(x: Any) -> Any:
    """A hashable stand-in for what a shape-wrapped formula receives for ``x``."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape)
        for d in shape:
            if type(d) is not int:
                raise _Uncacheable
        return ("tensor", shape)
    kind = type(x)
    if x is None or kind is int or kind is bool or kind is str:
        return (kind, x)
    if kind is float:
        return (float, repr(x))  # keeps -0.0 and 0.0 apart
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (kind, x)
    if isinstance(x, (list, tuple)):
        return (kind, tuple([_static_key(v) for v in x]))
    raise _Uncacheable


def _flops(formula: Any, node: fx.Node) -> Any:
    """``formula`` applied to ``node``'s arguments and output (fake values)."""
    out_val = node.meta.get("val")
    key = None
    if getattr(formula, "__code__", None) is _SHAPE_ONLY_CODE:
        try:
            key = (
                formula,
                _static_key(node.args),
                tuple((k, _static_key(v)) for k, v in node.kwargs.items()),
                _static_key(out_val),
            )
        except Exception:  # _Uncacheable, or an odd value: compute it the usual way
            key = None
        if key is not None:
            hit = _FLOP_CACHE.get(key)
            if hit is not None:
                return hit
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    flops = formula(*args, **kwargs, out_val=out_val)
    if key is not None and type(flops) is int:
        if len(_FLOP_CACHE) >= _FLOP_CACHE_MAX:
            _FLOP_CACHE.clear()
        _FLOP_CACHE[key] = flops
    return flops


def estimate(node: fx.Node, alias: bool) -> Cost:
    """The cost of one node.

    Args:
        node: a compute node with fake-tensor metadata.
        alias: whether the node only creates a view (no kernel, no bytes).
    """
    return Estimator().estimate(node, alias)


# The cost of a node that launches no kernel (a view, a tuple selection, a non-call); records
# are frozen, so one serves every such node.
_NO_KERNEL = Cost()


class Estimator:
    """:func:`estimate` over the nodes of one graph, computing what nodes share once.

    A value's bytes are counted where it is produced and again by every reader; here they
    are computed once per node. Equal costs (graphs repeat a few shapes many times) share
    one record.
    """

    def __init__(self) -> None:
        self._bytes: dict[fx.Node, Any] = {}  # node -> bytes of its tensor value
        self._costs: dict[tuple, Cost] = {}

    def _value_bytes(self, node: fx.Node, val: torch.Tensor) -> Any:
        """The bytes of ``val``, the tensor value of ``node``."""
        nbytes = self._bytes.get(node)
        if nbytes is None:
            nbytes = self._bytes[node] = _tensor_bytes(val)
        return nbytes

    def _cost(self, flops: float, nbytes: float, symbolic: str | None, exact: bool) -> Cost:
        key = (flops, nbytes, symbolic, exact)
        c = self._costs.get(key)
        if c is None:
            c = self._costs[key] = Cost(flops=flops, bytes=nbytes, symbolic=symbolic, exact=exact)
        return c

    def estimate(self, node: fx.Node, alias: bool) -> Cost:
        """The cost of one node (see :func:`estimate`)."""
        if node.op != "call_function" or node.target is operator.getitem or alias:
            return _NO_KERNEL
        target = node.target
        try:
            # What _io_tensors lists, in its order: the inputs' tensors, then the outputs.
            total_bytes: Any = 0
            for a in node.all_input_nodes:
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    total_bytes = total_bytes + self._value_bytes(a, v)
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                total_bytes = total_bytes + self._value_bytes(node, val)
            elif isinstance(val, (list, tuple)):
                for v in val:
                    if isinstance(v, torch.Tensor):
                        total_bytes = total_bytes + _tensor_bytes(v)
            nbytes, bytes_sym = _numeric(total_bytes)
        except Exception:
            return self._cost(0.0, 0.0, None, False)
        packet = getattr(target, "overloadpacket", None)
        formula = flop_registry.get(packet) if packet is not None else None
        if formula is None:
            return self._cost(0.0, nbytes, bytes_sym and f"bytes={bytes_sym}", True)
        try:
            flops = _flops(formula, node)
            nflops, flops_sym = _numeric(flops)
        except Exception:
            return self._cost(0.0, nbytes, None, False)
        symbolic = None
        if flops_sym or bytes_sym:
            symbolic = f"flops={flops_sym or int(nflops)}"
        return self._cost(nflops, nbytes, symbolic, True)


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """How a node's cost becomes a time: ``max(scale * roofline, launch_floor_s)``.

    Attributes:
        name: what it models (``"nominal"``, or the device it was calibrated on).
        scale: measured time over the nominal roofline (below 1: the device, or Inductor's
            fusion, does better than the nominal figures; above: worse).
        launch_floor_s: the least time a kernel occupies its lane.
        samples: the measurements it was fitted to (0: not calibrated).
    """

    name: str = "nominal"
    scale: float = 1.0
    launch_floor_s: float = LAUNCH_FLOOR_S
    samples: int = 0

    def describe(self) -> str:
        """One line for the dump and the log."""
        if not self.samples:
            return f"cost model: {self.name} device (roofline x1, launch floor {self.launch_floor_s * 1e6:.1f} us)"
        return (f"cost model: calibrated on {self.name} from {self.samples} measured graph(s): roofline "
                f"x{self.scale:.3g}, launch floor {self.launch_floor_s * 1e6:.2f} us")


NOMINAL = DeviceModel()
_current: contextvars.ContextVar[DeviceModel] = contextvars.ContextVar("capturepass_device_model", default=NOMINAL)


@contextlib.contextmanager
def device_model(model: DeviceModel | None) -> Iterator[DeviceModel]:
    """Makes ``model`` (``None``: the nominal one) the model :func:`node_time` uses inside the block."""
    token = _current.set(model if model is not None else NOMINAL)
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def current_model() -> DeviceModel:
    """The device model :func:`node_time` uses here."""
    return _current.get()


def roofline(cost: Cost | None) -> float:
    """The nominal roofline time of a cost, in seconds, with no floor (0 for no kernel)."""
    if cost is None or (cost.flops == 0 and cost.bytes == 0):
        return 0.0
    flops = cost.flops if cost.flops == cost.flops else 0.0  # NaN: unknown hint
    nbytes = cost.bytes if cost.bytes == cost.bytes else 0.0
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES_PER_S)


def node_time(cost: Cost | None, model: DeviceModel | None = None) -> float:
    """The time of a cost under ``model`` (default: the current one), in seconds (0 for no kernel)."""
    if cost is None or (cost.flops == 0 and cost.bytes == 0):
        return 0.0
    m = model if model is not None else _current.get()
    return max(m.scale * roofline(cost), m.launch_floor_s)


def predicted(rooflines: Sequence[tuple[float, int]], scale: float, floor_s: float) -> float:
    """A one-lane graph's time under a device model: ``rooflines`` are (nominal roofline in
    seconds, how many kernel nodes have it)."""
    return sum(count * max(scale * r, floor_s) for r, count in rooflines)


# The fit's search: launch floors from 0 to 20 us, scales from 1/100 to 100 (log-spaced).
_FLOORS_S = [i * 0.25e-6 for i in range(81)]
_LOG10_SCALES = [k / 40 for k in range(-80, 81)]


def fit(samples: Sequence[tuple[Sequence[tuple[float, int]], float]], name: str) -> DeviceModel:
    """The device model that best predicts measured one-lane graph times.

    Each sample is a graph's rooflines (as :func:`predicted` takes them) and its measured
    time in seconds. The error is the squared log ratio of predicted to measured, summed
    over the samples; ties go to the scale nearest 1. Fewer than three samples leave the
    floor underdetermined (one graph's time is met by many pairs): they fit the scale alone,
    at the nominal floor.

    Raises:
        ValueError: no sample with kernels and a positive time.
    """
    usable = [(r, t) for r, t in samples if t > 0 and any(c > 0 for _, c in r)]
    if not usable:
        raise ValueError("no measured graph with kernels and a positive time to fit a device model to")
    floors = _FLOORS_S if len(usable) >= 3 else [LAUNCH_FLOOR_S]
    dt = torch.float64
    log_k = torch.tensor(_LOG10_SCALES, dtype=dt) * math.log(10.0)
    scales = torch.exp(log_k)
    floor_t = torch.tensor(floors, dtype=dt)
    # A node runs at its floor when scale * roofline < floor, i.e. below the threshold floor / scale:
    # with each sample's rooflines sorted and summed cumulatively, every (floor, scale) pair is
    # one binary search per sample.
    threshold = floor_t[:, None] / scales[None, :]  # [floors, scales]
    err = torch.zeros_like(threshold)
    for r, t in usable:
        ordered = sorted((v, c) for v, c in r if c > 0)
        rv = torch.tensor([v for v, _ in ordered], dtype=dt)
        rc = torch.tensor([float(c) for _, c in ordered], dtype=dt)
        count_below = torch.cat([torch.zeros(1, dtype=dt), torch.cumsum(rc, 0)])
        time_below = torch.cat([torch.zeros(1, dtype=dt), torch.cumsum(rv * rc, 0)])
        idx = torch.searchsorted(rv, threshold)  # nodes [0, idx) run at the floor
        pred = floor_t[:, None] * count_below[idx] + scales[None, :] * (time_below[-1] - time_below[idx])
        err += (torch.log(pred) - math.log(t)) ** 2
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))
    # Ties (within rounding) go to the scale nearest 1: the nominal model unless told otherwise.
    err = err + 1e-12 * log_k.abs()[None, :]
    f, k = divmod(int(torch.argmin(err)), len(_LOG10_SCALES))
    best = (float(scales[k]), floors[f])
    return DeviceModel(name=name, scale=best[0], launch_floor_s=best[1], samples=len(usable))
