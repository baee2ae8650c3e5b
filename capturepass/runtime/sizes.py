"""Batch sizes of a compiled graph: which dimension is the batch, which sizes the graph serves,
and the arguments of a call at another size (what ``capture_sizes`` captures)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from capturepass.runtime.program import Program


def batch_dim(program: Program) -> torch.SymInt | None:
    """The batch size of the graph: dim 0 of its first dynamic non-static input, or ``None``."""
    for i, node in enumerate(program.inputs):
        val = node.meta.get("val")
        if i in program.static_inputs or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        d0 = val.shape[0]
        if isinstance(d0, torch.SymInt) and d0.node.expr.free_symbols:
            return d0
    return None


def batch_range(program: Program) -> tuple[int, int | None] | None:
    """The batch sizes the graph serves, ``(lowest, highest or None)``, from its shape environment;
    ``None`` without a dynamic batch or a range to read. Dynamo specializes sizes 0 and 1, so a
    graph with a dynamic batch usually serves 2 and up (calls at 1 compile another graph)."""
    d0 = batch_dim(program)
    env = getattr(d0.node, "shape_env", None) if d0 is not None else None
    bound = getattr(env, "bound_sympy", None)
    if bound is None:
        return None
    try:
        vr = bound(d0.node.expr)
        lower = int(vr.lower)
    except Exception:  # noqa: BLE001 - an unbounded or symbolic bound: nothing to say
        return None
    try:
        upper: int | None = int(vr.upper)
    except Exception:  # noqa: BLE001 - int_oo, oo
        upper = None
    return lower, upper


def args_for_size(program: Program, args: Sequence[Any], size: int) -> list[Any] | None:
    """``args`` with the batch symbol (dim 0 of the first dynamic non-static input) set to ``size``.

    A tensor sized by the batch is replaced by zeros of the new size; any other is the caller's
    own, as a call at that size would bring it. A cache passed as an argument (``[max_batch,
    ...]``, written in place) is then captured in place at each size, where zeros of its size
    would have cost a buffer of the cache's size per captured size and two copies of it per
    call. The captures ahead are not calls (``Executor.capture``): their warm-ups leave the
    caller's written tensors as they were.
    """
    d0 = batch_dim(program)
    if d0 is None:
        return None
    symbol = d0.node.expr
    out: list[Any] = []
    for i, (node, arg) in enumerate(zip(program.inputs, args)):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr == symbol:
            out.append(size)
        elif isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor) and i not in program.static_inputs:
            batched = [isinstance(d, torch.SymInt) and d.node.expr == symbol for d in val.shape]
            if any(batched):
                out.append(zeros_laid_out_as(arg, [size if b else int(a) for b, a in zip(batched, arg.shape)]))
            else:
                out.append(arg)
        else:
            out.append(arg)
    return out


def zeros_laid_out_as(arg: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zeros of ``shape`` laid out as ``arg`` is: repeated (stride 0) where ``arg`` repeats (position
    ids expanded over the batch), its other dimensions dense in ``arg``'s memory order. A capture
    is keyed on its inputs' strides: a size captured ahead on a contiguous stand-in would not serve
    a call whose input is expanded or permuted."""
    strides = arg.stride()
    base = [1 if stride == 0 else n for n, stride in zip(shape, strides)]
    dense = [0] * len(shape)
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], -d)):  # innermost first
        dense[d] = step
        step *= base[d]
    out = torch.empty_strided(base, dense, dtype=arg.dtype, device=arg.device).zero_()
    return out.expand(list(shape)) if base != list(shape) else out


def served(program: Program, capture_sizes: Sequence[int]) -> tuple[list[int], list[int], tuple[int, int | None]]:
    """``capture_sizes`` split into those the graph serves, largest first (the smaller captures'
    temporaries then fit in memory the larger ones freed in a shared pool), and those outside
    its batch range (ascending); and that range (``(0, None)`` where it cannot be read)."""
    lower, upper = batch_range(program) or (0, None)
    inside = [s for s in capture_sizes if lower <= s and (upper is None or s <= upper)]
    outside = sorted(s for s in capture_sizes if s not in inside)
    return sorted(inside, reverse=True), outside, (lower, upper)


def why_no_batch(program: Program, args: Sequence[Any]) -> str:
    """Why a graph called with ``args`` has no dynamic batch, where the call tells (``""``: it does
    not): Dynamo specializes batch sizes 0 and 1 even with ``dynamic=True``."""
    batch = next((a.shape[0] for i, a in enumerate(args) if i not in program.static_inputs
                  and isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if batch not in (0, 1):
        return ""
    return (f" (its first call had batch size {batch}, which Dynamo specializes even with dynamic=True: the "
            "first call at another size compiles a graph with a dynamic batch, and that graph captures "
            "capture_sizes)")
