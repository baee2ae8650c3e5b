"""Exact layouts at region seams.

Each region is compiled on its own, and a compiled region specialises on the
strides of its inputs: Inductor's generated code begins with
``assert_size_stride`` for every input, at the strides of the FX graph's fake
values. The producing region is free to return another layout, though: Inductor
re-traces a region before lowering it and keeps only the stride *order* of an
output that its own trace turned into a view (``cat`` with an empty operand
becomes the other operand, transposed), so a consumer compiled for a contiguous
tensor was handed a transposed one (``expected size 2==2, stride 8==128``).

:class:`ExactLayouts` wraps a compiled region and hands every output on at the
layout of its fake value: an output whose strides differ is copied once into a
buffer of the expected strides (on the producing lane's stream; under capture,
into the graph). Strides are compared as ints where the fake value's are static;
where they are symbolic, a dense layout is rebuilt from the runtime sizes in the
fake value's stride order, and any other layout from the symbols bound by the
runtime sizes of the region's tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

log = logging.getLogger("capturepass")


def _hint(value: Any) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else None
    return None


def _expr(value: Any) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


class _Expected:
    """The layout one output must have: static strides, a dense stride order, or expressions."""

    def __init__(self, val: torch.Tensor) -> None:
        strides = val.stride()
        self.static: tuple[int, ...] | None = None
        self.order: tuple[int, ...] | None = None
        self.exprs: tuple[sympy.Expr, ...] | None = None
        if all(isinstance(s, int) for s in strides):
            self.static = tuple(strides)
            return
        sizes = [_hint(s) for s in val.shape]
        hints = [_hint(s) for s in strides]
        if None not in sizes and None not in hints:
            # The stride order at the traced sizes: innermost first, ties (size-1 dims) by dim.
            order = sorted(range(len(hints)), key=lambda d: (hints[d], -d))
            expect = 1
            dense = True
            for d in order:
                if sizes[d] != 1 and hints[d] != expect:
                    dense = False
                    break
                expect *= sizes[d]
            if dense:
                self.order = tuple(order)
                return
        self.exprs = tuple(_expr(s) for s in strides)

    def strides(self, shape: torch.Size, bindings: dict[sympy.Symbol, int]) -> tuple[int, ...] | None:
        if self.static is not None:
            return self.static
        if self.order is not None:
            out = [0] * len(shape)
            expect = 1
            for d in self.order:
                out[d] = expect
                expect *= shape[d]
            return tuple(out)
        try:
            return tuple(int(e.subs(bindings)) for e in self.exprs)
        except (TypeError, ValueError):
            return None  # a symbol no runtime size binds


def _bind(vals: Sequence[Any], values: Sequence[Any], into: dict[sympy.Symbol, int]) -> None:
    for val, value in zip(vals, values):
        if isinstance(val, torch.Tensor) and isinstance(value, torch.Tensor):
            for d, v in zip(val.shape, value.shape):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    into[d.node.expr] = int(v)


def _same(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``t`` has ``strides`` where they matter (a dim of size 1 or 0 has any stride)."""
    actual = t.stride()
    if actual == strides:
        return True
    return all(a == s or n <= 1 for a, s, n in zip(actual, strides, t.shape))


class ExactLayouts:
    """A compiled region whose outputs leave with the strides of their fake values.

    Args:
        fn: the compiled region (takes the inputs, returns a sequence).
        input_vals: the fake values of its inputs (to bind symbols).
        output_vals: the fake values of its outputs, in order.
        name: the region's name, for the log.
    """

    def __init__(
        self, fn: Callable[..., Sequence[Any]], input_vals: Sequence[Any], output_vals: Sequence[Any], name: str
    ) -> None:
        self.fn = fn
        self.name = name
        self._input_vals = list(input_vals)
        self._output_vals = list(output_vals)
        self._expected = [
            (i, _Expected(v)) for i, v in enumerate(output_vals)
            if isinstance(v, torch.Tensor) and v.layout == torch.strided
        ]
        self._needs_bindings = any(e.exprs is not None for _, e in self._expected)
        # With static strides a compiled region returns the same layouts at every call: after the
        # first, only the outputs that differed are looked at again (none, most of the time).
        self._static = all(e.static is not None for _, e in self._expected)
        self._checked = False
        self._logged = False

    @property
    def needed(self) -> bool:
        """Whether any output has a layout to keep."""
        return bool(self._expected)

    @property
    def settled(self) -> Callable[..., Sequence[Any]] | None:
        """The compiled region alone once its calls are known to return the expected layouts
        (static strides, all as expected at the first call), else ``None``."""
        return self.fn if self._checked and not self._expected else None

    def __call__(self, *args: Any) -> Sequence[Any]:
        outs = self.fn(*args)
        if self._checked and not self._expected:
            return outs
        bindings: dict[sympy.Symbol, int] = {}
        if self._needs_bindings:
            _bind(self._input_vals, args, bindings)
            _bind(self._output_vals, outs, bindings)
        fixed = None
        differ = []
        for i, expected in self._expected:
            out = outs[i]
            if not isinstance(out, torch.Tensor):
                continue
            strides = expected.strides(out.shape, bindings)
            if strides is None or _same(out, strides):
                continue
            differ.append((i, expected))
            if fixed is None:
                fixed = list(outs)
            buf = torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)
            buf.copy_(out)
            fixed[i] = buf
            if not self._logged:
                self._logged = True
                log.debug(
                    "capturepass: %s returned output %d with strides %s; its consumers were compiled for %s: "
                    "copied to that layout", self.name, i, tuple(out.stride()), strides,
                )
        if self._static and not self._checked:
            self._expected, self._checked = differ, True
        if fixed is None:
            return outs
        return type(outs)(fixed) if isinstance(outs, tuple) else fixed
