"""Static checks of the code Inductor generated for a segment compiled with its lanes inline.

The compile driver runs them on every fused compile (``capturepass.backends.compile``): a
segment whose code fails them keeps its lane regions, with the first finding logged. Inductor
decides where a value it copies or recomputes runs, and a copy made for a declared write that
could not be re-inplaced lands on the lane before the point, which no event may order before
its readers (seen on Phi's layer norm).

The code runs each line on the lane the last ``capturepass::inline_step`` call made current
(its sync point's ``lane``). From the code alone and the points' records and waits:

- :func:`lane_violations`: a buffer used on another lane than the one it was allocated on, and
  freed before the last point (its block would go back to the allocating lane's stream while
  the other lane may still use it), or a planned reuse of a buffer (``# reuse``);
- :func:`order_violations`: a buffer read on a lane that no event orders after the kernel that
  wrote it (vector clocks over the records and waits).

A kernel's first use of a buffer after its allocation counts as its write. The items of an op
that returns several new tensors (``buf7 = buf6[0]`` after ``buf6 = torch.ops.aten.sort...``:
values and indices) are buffers of their own, allocated where the op ran; an item of an op whose
schema says a result may alias an input, or of a call the checks cannot resolve, counts as a view
of the whole result.

Under Inductor's own CUDA graphs (``mode="reduce-overhead"``, with ``graph_partition``) the
generated ``call`` calls the graph's pieces as functions (``self.partitions[N](...)``), each
captured apart: the checks read each piece's body where ``call`` calls it, and sync points in
more than one piece are a finding (an event recorded in one capture orders nothing in another).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from capturepass.ir import meta
from capturepass.ir.plan import StepKind, SyncPoint

# A sync point's call: ``inline_step`` carries its point's index; ``lane_step`` (the pass route's)
# does not, and its calls come in the points' order (each writes the token the next one writes).
_POINT = re.compile(r"torch\.ops\.capturepass\.(?:inline_step\.default\(\d+, (\d+),|lane_step\.default\()")
_ALIAS = re.compile(r"(buf\d+) = reinterpret_tensor\((buf\d+)|(buf\d+) = (buf\d+)\[")
_REUSE = re.compile(r"(buf\d+) = (buf\d+); del (buf\d+)\s+# reuse")
_BUF = re.compile(r"\b(buf\d+)\b")
_OP_RESULT = re.compile(r"(buf\d+) = torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_ITEM = re.compile(r"(buf\d+) = (buf\d+)\[\d+\]$")


def _fresh_tuple(line: str) -> str | None:
    """The buffer ``line`` binds to the results of an op that returns several tensors, none of
    which its schema lets alias an input (``aten.sort``, ``aten.topk``); ``None`` otherwise."""
    m = _OP_RESULT.match(line)
    if m is None:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, m.group(2)), m.group(3)), m.group(4))
        returns = op._schema.returns
    except (AttributeError, RuntimeError):
        return None
    if len(returns) < 2 or any(r.alias_info is not None for r in returns):
        return None
    return m.group(1)


_PARTITION_DEF = re.compile(r"def (partition_\d+)\(args\):$")
_PARTITION_CALL = re.compile(r".* = self\.partitions\[(\d+)\]\(partition\d+_args\)$")


def _partitions(code: str) -> dict[str, list[str]]:
    """The bodies of the functions Inductor made of the graph's pieces it captures one by one
    under its CUDA graphs (``config.graph_partition``: ``def partition_N(args):``), by name."""
    bodies: dict[str, list[str]] = {}
    name, indent = None, 0
    for line in code.splitlines():
        stripped = line.strip()
        if name is not None and stripped and len(line) - len(line.lstrip()) <= indent:
            name = None
        if m := _PARTITION_DEF.match(stripped):
            name, indent = m.group(1), len(line) - len(line.lstrip())
            bodies[name] = []
        elif name is not None:
            bodies[name].append(stripped)
    return bodies


def _expanded(code: str) -> list[tuple[str, str | None]]:
    """The lines ``call`` runs, in order, each with the partition it runs in (``None``: ``call``
    itself): a partition's call (``self.partitions[N](partitionN_args)``) is replaced by its body,
    whose buffers bear the names ``call`` gives them."""
    bodies = _partitions(code)
    out: list[tuple[str, str | None]] = []
    for line in code[code.index("def call("):].splitlines():
        line = line.strip()
        m = _PARTITION_CALL.match(line)
        if m is not None and f"partition_{m.group(1)}" in bodies:
            name = f"partition_{m.group(1)}"
            out.extend((body, name) for body in bodies[name])
        else:
            out.append((line, None))
    return out


def _lines(code: str) -> list[str]:
    return [line for line, _ in _expanded(code)]


def _points(lines: list[str]) -> dict[int, int]:
    """The sync points' calls: line number to point index."""
    out: dict[int, int] = {}
    for i, line in enumerate(lines):
        if m := _POINT.match(line):
            out[i] = int(m.group(1)) if m.group(1) is not None else len(out)
    return out


class _Aliases(dict):
    def base(self, buf: str) -> str:
        while buf in self:
            buf = self[buf]
        return buf

    def take(self, line: str) -> bool:
        m = _ALIAS.match(line)
        if m is None:
            return False
        a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        self[a] = b
        return True


def lane_violations(code: str, points: Sequence[SyncPoint]) -> list[str]:
    """Buffers used on another lane than their allocating one and freed before the last point."""
    lines = _lines(code)
    at = _points(lines)
    last = max(at, default=-1)
    lane, alloc, uses, aliases, out = 0, {}, {}, _Aliases(), []
    tuples: set[str] = set()  # results of ops that return several new tensors
    for i, line in enumerate(lines):
        if not line or line.startswith("#"):
            continue
        if i in at:
            lane = points[at[i]].lane
            continue
        if _REUSE.match(line):
            out.append(f"reuse: {line}")
            continue
        if (m := _ITEM.match(line)) and aliases.base(m.group(2)) in tuples:
            alloc[m.group(1)] = alloc.get(aliases.base(m.group(2)), lane)
            continue
        if aliases.take(line):
            continue
        if (fresh := _fresh_tuple(line)) is not None:
            tuples.add(fresh)
        if (m := re.match(r"(buf\d+) = ", line)) and m.group(1) not in alloc:
            alloc[m.group(1)] = lane
        if m := re.match(r"del (buf\d+)$", line):
            buf = aliases.base(m.group(1))
            other = sorted(u for u in uses.get(buf, ()) if u != alloc.get(buf, u))
            if i < last and other:
                out.append(f"{buf} allocated on s{alloc[buf]}, used on s{other}, freed at line {i} before the last point")
            continue
        for buf in _BUF.findall(line):
            uses.setdefault(aliases.base(buf), set()).add(lane)
    return out


def order_violations(code: str, points: Sequence[SyncPoint]) -> list[str]:
    """Reads of a buffer on a lane that no event orders after the kernel that wrote it."""
    lanes = sorted({0} | {p.lane for p in points} | {s.lane.index for p in points for s in p.steps})
    clock = {a: {b: 0 for b in lanes} for a in lanes}
    events: dict[object, dict[int, int]] = {}
    lane, writer, aliases, out = 0, {}, _Aliases(), []
    lines = _lines(code)
    at = _points(lines)
    for i, line in enumerate(lines):
        if not line or line.startswith("#"):
            continue
        if i in at:
            point = points[at[i]]
            for step in point.steps:
                if step.kind == StepKind.RECORD:
                    events[meta.info(step.payload).event] = dict(clock[step.lane.index])
                elif step.kind == StepKind.WAIT and meta.info(step.payload).event in events:
                    mine = clock[step.lane.index]
                    for k, v in events[meta.info(step.payload).event].items():
                        mine[k] = max(mine[k], v)
            lane = point.lane
            continue
        if aliases.take(line) or re.match(r"buf\d+ = empty_strided", line) or line.startswith(("del ", "return")):
            continue
        clock[lane][lane] += 1
        bufs = [aliases.base(b) for b in _BUF.findall(line)]
        written = {aliases.base(m.group(1)) for m in [re.match(r"(buf\d+) = ", line), re.search(r"out=(buf\d+)", line)] if m}
        written |= {b for b in bufs if b not in writer}
        for buf in bufs:
            wlane, when = writer.get(buf, (None, 0))
            if buf not in written and wlane is not None and wlane != lane and clock[lane][wlane] < when:
                out.append(f"line {i} on s{lane} reads {buf}, written on s{wlane} with no event after: {line[:90]}")
        for buf in written:
            writer.setdefault(buf, (lane, clock[lane][lane]))
    return out


class CodeCapture:
    """Collects the output code of the Inductor compiles inside the block
    (``GraphLowering.save_output_code``, which Inductor also calls on a cache hit); ``codes``
    stays empty where this torch has no such hook."""

    def __init__(self) -> None:
        self.codes: list[str] = []

    def __enter__(self) -> "CodeCapture":
        from torch._inductor.graph import GraphLowering

        self._cls = GraphLowering
        self._prev = getattr(GraphLowering, "save_output_code", None)
        if hasattr(GraphLowering, "save_output_code"):
            prev = self._prev

            def save(code: str) -> None:
                self.codes.append(code)
                if prev is not None:
                    prev(code)

            GraphLowering.save_output_code = save
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self._cls, "save_output_code"):
            self._cls.save_output_code = self._prev


def findings(codes: Sequence[str], points: Sequence[SyncPoint], op: str = "inline_step") -> list[str]:
    """What the checks find in the code of a fused segment whose sync calls are ``op``'s (a
    reason when its code is missing, or holds another number of them than ``points``)."""
    mine = [c for c in codes if f"{op}.default(" in c and "def call(" in c]
    if len(mine) != 1:
        return [f"Inductor's generated code could not be read to check it ({len(mine)} candidates)"]
    calls = len(_points(_lines(mine[0])))
    if calls != len(points):
        return [f"Inductor's generated code calls {calls} of the {len(points)} sync points"]
    pieces = {piece for line, piece in _expanded(mine[0]) if _POINT.match(line)}
    if len(pieces) > 1:
        # Under Inductor's CUDA graphs each partition is captured on its own: an event recorded
        # in one capture cannot order work in another.
        return [f"Inductor's generated code splits the sync points over {len(pieces)} pieces it captures "
                f"apart ({', '.join(sorted(p or 'call' for p in pieces))})"]
    return lane_violations(mine[0], points) + order_violations(mine[0], points)
