"""Lanes after fusion: one Inductor compile's generated code, its kernels put on lanes.

A graph compiled once without lanes gives one lane's fused kernels. This module rewrites the
``call`` function of that compile's output code so that each kernel launches on a lane chosen
for it (:func:`rewrite`), with the records and waits its buffers need, written between the
launches: every candidate schedule is then a rewrite of one compile, and its fusion is one
lane's. It rests on what docs/one_compile.md records of Inductor's wrapper code (torch 2.11
and newer): each Triton launch reads the current stream just before it (``streamN =
get_raw_stream(N)``), an extern kernel runs on the current stream, and a buffer is allocated
on the stream current at its ``empty_strided`` line.

What the rewrite keeps true, from the code alone (no knowledge of Inductor's IR):

- **Orderings.** Every launch reads and writes storages (a buffer and its ``reinterpret_tensor``
  views and planned reuses are one storage; graph inputs are storages written on the main lane
  before the call). A Triton kernel writes the arguments its definition names ``out_ptr`` or
  ``in_out_ptr``; an extern kernel its ``out=``; an op whose schema marks an argument written
  writes it; any other call is taken to write every storage it names. A launch waits, through
  an event recorded right after the launch it depends on, for the last write of what it reads
  and for the last write and every read since of what it writes, unless an earlier wait on its
  lane already covers it (vector clocks). A side lane first waits for the main lane's entry,
  before it allocates or launches anything (a capture must fork every stream it uses from the
  capturing one), and the main lane waits for every side lane at the end.
- **Allocations.** A buffer's ``empty_strided`` runs on the lane of the first launch that names
  it, and counts as a write there: the allocator hands it a block that lane's stream freed, and
  that stream's own order puts the first use after whatever used the block there, whatever else
  shares the stream (a lane map runs several lanes on one, with one free list) or freed into it
  (an op's temporaries, another thread). Allocating on another lane's stream, so that two
  streams do not each cache the same memory, raced on a GPU under lane maps (RELIABILITY.md).
  A planned reuse that only writes the reused block and runs on another lane than a user of the
  block gets a block of its own, allocated as the reused name was.
- **Frees.** The allocator gives a freed block back to its allocating stream at once, and hands
  it to the next allocation on that stream (Inductor emits no ``record_stream``): a ``del`` of a
  storage used on a lane other than its allocating one runs only once the allocating lane has
  waited for every such use (its clock covers them), so that whatever that lane does with the
  block next is ordered after them. It stays where Inductor wrote it if the lane's waits already
  cover the uses there, moves right after the first later wait of that lane that does (a lane
  usually waits for the others' results of one layer before it starts the next), and otherwise
  after the final join. Holding every such block to the join instead would keep each layer's
  cross-lane buffers alive to the end of the graph.

Lines the rewrite cannot classify are launches on the current lane that read and write every
storage they name (correct, and at worst ordered more than needed). :func:`check` runs a
rewritten body's lane calls on vector clocks apart from the rewrite. The hooks that run all this
inside Inductor's compile are in ``capturepass.backends.fused_inductor``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from collections.abc import Callable, Mapping

import torch

_DEF_CALL = re.compile(r"^(\s*)def call\((self, )?args\):\s*$")
_UNPACK = re.compile(r"^([\w, ]+) = args$")
_STREAM = re.compile(r"^(stream\d+) = get_raw_stream\((\d+)\)$")
_ALLOC = re.compile(r"^(buf\d+) = empty_strided_\w+\(")
_REUSE = re.compile(r"^(buf\d+) = (buf\d+); del (buf\d+)\s+# reuse$")
_ALIAS = re.compile(r"^(buf\d+) = (?:reinterpret_tensor\((buf\d+)\b|(buf\d+)\[\d+\]$|(buf\d+)\.view\()")
_DEL = re.compile(r"^del ([\w, ]+)$")
_TRITON_RUN = re.compile(r"^(\w+)\.run\((.*)\)$")
_ASSIGN = re.compile(r"^(buf\d+) = ")
_OUT = re.compile(r"\bout=(buf\d+)\b")
_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\((.*)\)$")
_KERNEL_DEF = re.compile(r"def (\w+)\(([^)]*)\):")
_SOURCE_NODES = re.compile(r"^# Topologically Sorted Source Nodes: \[([^\]]*)\]")
_SKIP = ("assert_size_stride", "assert_alignment", "torch.cuda.set_device", "with torch.cuda._DeviceGuard",
         "args.clear()", "pass")

# The name the rewritten code calls its lanes' runtime by (bound in the module's globals).
RUNTIME = "_cp_lanes"
# The device index the rewrite gives a host compile's code: its lanes' calls then do nothing.
HOST = -1


class RewriteError(ValueError):
    """The code is not in a form the rewrite reads (it has no ``call``)."""


@dataclasses.dataclass
class Summary:
    """What one rewrite wrote (counts), as the rewritten module states it in a line of its own
    (:data:`MARK`), so that a module loaded from Inductor's cache still tells it."""

    launches: int
    side: int
    switches: int
    records: int
    held: int
    lanes: list[int]
    moved: int = 0

    def line(self) -> str:
        return f"{MARK}{json.dumps(dataclasses.asdict(self), sort_keys=True)}"

    @classmethod
    def of_module(cls, source: str) -> "Summary | None":
        """The summary a rewritten module states, or ``None`` (its first line as the rewrite wrote
        it; Inductor may put its compile-time tuning block before it)."""
        m = re.search(rf"^{re.escape(MARK)}(.*)$", source, re.MULTILINE)
        if m is None:
            return None
        try:
            return cls(**json.loads(m.group(1)))
        except (TypeError, ValueError):
            return None


# The first line of a rewritten module: its summary follows as JSON.
MARK = "# capturepass lanes after fusion: "


@dataclasses.dataclass
class Rewritten:
    """The rewritten ``call`` and what the rewrite put in it.

    Attributes:
        source: the rewritten function's source (``def call(...)``, dedented).
        launches: the launches of the original, with their lanes in order.
        switches: lane switches written.
        records: events recorded (each waited on at least once).
        waits: waits written (the final join not counted).
        held: storages whose ``del`` moved after the final join.
        lanes: the side lanes the code uses, sorted.
        moved: names whose ``del`` moved to a later wait of their storage's allocating lane.
    """

    source: str
    launches: list[tuple[str, int]]
    switches: int
    records: int
    waits: int
    held: list[str]
    lanes: list[int]
    moved: int = 0

    def summary(self) -> Summary:
        return Summary(len(self.launches), sum(1 for _, lane in self.launches if lane), self.switches,
                       self.records, len(self.held), list(self.lanes), self.moved)


def kernel_params(module_source: str) -> dict[str, list[str]]:
    """The parameter names of every kernel defined in a module's source (Triton kernels are
    defined inside the source strings ``async_compile.triton`` receives)."""
    out: dict[str, list[str]] = {}
    for m in _KERNEL_DEF.finditer(module_source):
        params = [p.split(":")[0].strip() for p in m.group(2).split(",")]
        out.setdefault(m.group(1), [p for p in params if p])
    return out


def call_body(module_source: str, name: str = "call") -> tuple[int, int, list[str]]:
    """The span of the function ``name`` (``call``, or :func:`rewrite_module`'s ``_cp_lanes_call``)
    in ``module_source``: first line (its ``def``), the line after its body, and the body's lines."""
    lines = module_source.splitlines()
    pattern = _DEF_CALL if name == "call" else re.compile(rf"^(\s*)def {re.escape(name)}\((self, )?args\):\s*$")
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m is None:
            continue
        indent = len(m.group(1))
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():
            end -= 1
        return i, end, lines[i + 1:end]
    raise RewriteError(f"the generated module has no `def {name}(args)` function")


def lanes_call(module_source: str) -> str:
    """The lanes' body of a module :func:`rewrite_module` wrote, as a function ``call`` (what runs
    while an owner binds side streams: the launches with their lane switches, records, waits and
    held frees), dedented."""
    first, end, _ = call_body(module_source, LANES_CALL)
    lines = module_source.splitlines()[first:end]
    return textwrap.dedent("\n".join(lines)).replace(f"def {LANES_CALL}(", "def call(", 1) + "\n"


def split_args(text: str) -> list[str]:
    """A call's arguments, split at the top-level commas."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


@dataclasses.dataclass
class _Line:
    """One line of ``call``: ``kind`` is ``launch``, ``alloc``, ``reuse``, ``alias``, ``del``,
    ``stream``, ``return`` or ``other``."""

    kind: str
    text: str
    indent: str
    names: list[str] = dataclasses.field(default_factory=list)
    wrote: list[str] = dataclasses.field(default_factory=list)
    lane: int = 0
    reads: set[str] = dataclasses.field(default_factory=set)
    writes: set[str] = dataclasses.field(default_factory=set)
    fresh: set[str] = dataclasses.field(default_factory=set)


class _Storages:
    """Names to storages: a buffer, its views and its planned reuses are one."""

    def __init__(self) -> None:
        self.base: dict[str, str] = {}

    def of(self, name: str) -> str:
        while name in self.base:
            name = self.base[name]
        return name


def _op_writes(ns: str, op: str, overload: str) -> list[int] | None:
    """The positions of an op's arguments its schema marks written (``None``: unknown op)."""
    try:
        schema = getattr(getattr(getattr(torch.ops, ns), op), overload)._schema
    except (AttributeError, RuntimeError):
        return None
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _parse(module_source: str, lane_of: Callable[[list[str], list[str]], int | None],
           params: Mapping[str, list[str]] | None = None,
           ) -> tuple[list[_Line], list[str], dict[str, str], _Storages]:
    """``call``'s lines, each launch with its lane and the storages it reads and writes; the
    graph's inputs; the stream variables (name to device); the storage of each name. The
    lanes' runtime calls of a rewritten body are lines of kind ``lanes``. ``params``: the
    kernels' parameter names (by default read from ``module_source``)."""
    if params is None:
        params = kernel_params(module_source)
    _, _, body = call_body(module_source)
    stripped = [line.strip() for line in body]
    inputs: list[str] = []
    for s in stripped:
        if m := _UNPACK.match(s):
            inputs = [n.strip() for n in m.group(1).split(",") if n.strip()]
            break
    known = set(inputs)

    # Pass 1: the lines, each launch with the names it reads and writes and its lane.
    parsed: list[_Line] = []
    sources: list[str] = []
    streams: dict[str, str] = {}
    for raw, s in zip(body, stripped):
        indent = raw[: len(raw) - len(raw.lstrip())]
        if not s:
            continue
        if s.startswith("#"):
            if m := _SOURCE_NODES.match(s):
                sources = [n.strip() for n in m.group(1).split(",") if n.strip()]
            parsed.append(_Line("other", raw, indent))
            continue
        if _UNPACK.match(s) or s.startswith(_SKIP):
            parsed.append(_Line("other", raw, indent))
            continue
        if s.startswith(f"{RUNTIME}."):
            parsed.append(_Line("lanes", raw, indent))
            continue
        if m := _STREAM.match(s):
            streams[m.group(1)] = m.group(2)
            parsed.append(_Line("stream", raw, indent))
            continue
        if s.startswith("return"):
            parsed.append(_Line("return", raw, indent))
            continue
        if m := _ALLOC.match(s):
            known.add(m.group(1))
            parsed.append(_Line("alloc", raw, indent, names=[m.group(1)]))
            continue
        if m := _REUSE.match(s):
            known.add(m.group(1))
            parsed.append(_Line("reuse", raw, indent, names=[m.group(1), m.group(2)]))
            continue
        if m := _ALIAS.match(s):
            src = next(g for g in m.groups()[1:] if g)
            if src in known:
                known.add(m.group(1))
                parsed.append(_Line("alias", raw, indent, names=[m.group(1), src]))
                continue
        if m := _DEL.match(s):
            parsed.append(_Line("del", raw, indent, names=[n.strip() for n in m.group(1).split(",") if n.strip()]))
            continue
        mentioned = [t for t in re.findall(r"\b\w+\b", s) if t in known]
        writes: set[str] | None = None
        # Names the launch writes through an output argument and reads nowhere: a planned reuse
        # whose first launch this is only reuses memory (not an in-place update of its values).
        fresh: set[str] = set()
        if m := _TRITON_RUN.match(s):
            kernel_params_ = params.get(m.group(1))
            if kernel_params_ is not None:
                args = [a for a in split_args(m.group(2)) if "=" not in a.split("(")[0]]
                writes = set()
                others: list[str] = []
                for p, a in zip(kernel_params_, args):
                    toks = [t for t in re.findall(r"\b\w+\b", a) if t in known]
                    if p.startswith(("out_ptr", "in_out_ptr")):
                        writes.update(toks)
                    if p.startswith("out_ptr"):
                        fresh.update(toks)
                    else:
                        others.extend(toks)
                fresh -= set(others)
        elif (m := _OP.search(s)) is not None and not s.startswith("extern_kernels"):
            positions = _op_writes(m.group(1), m.group(2), m.group(3))
            if positions is not None:
                args = split_args(m.group(4))
                writes = set()
                for i in positions:
                    if i < len(args):
                        writes.update(t for t in re.findall(r"\b\w+\b", args[i]) if t in known)
        elif s.startswith("extern_kernels."):
            writes = {m.group(1)} if (m := _OUT.search(s)) else set()
            if writes and mentioned.count(next(iter(writes))) == 1:
                fresh = set(writes)
        if (m := _ASSIGN.match(s)) is not None:
            # A call that returns a new tensor allocates it on its own lane.
            known.add(m.group(1))
            if writes is not None:
                writes.add(m.group(1))
            mentioned.append(m.group(1))
        if writes is None:
            writes = set(mentioned)
        lane = lane_of(sorted(writes), sources)
        parsed.append(_Line("launch", raw, indent, names=list(dict.fromkeys(mentioned)), wrote=sorted(writes),
                            lane=lane if lane is not None else 0, fresh=fresh))
        sources = []

    # The lane of the first launch that names each buffer: its allocation runs there.
    first_lane: dict[str, int] = {}
    overwrites: dict[str, bool] = {}  # whether that first launch only writes it
    for line in parsed:
        if line.kind == "launch":
            for n in line.names:
                if n not in first_lane:
                    first_lane[n] = line.lane
                    overwrites[n] = n in line.fresh

    # Storages: a view or planned reuse shares its base's storage, except a reuse whose first
    # launch runs on another lane than one that used the base and only writes it (memory
    # reused, not values updated in place): it gets a block of its own (allocated as the base
    # was), so that the lanes need no wait for it.
    names = _Storages()
    alloc_of: dict[str, str] = {}
    lanes_of: dict[str, set[int]] = {n: {0} for n in inputs}
    for k, line in enumerate(parsed):
        if line.kind == "alloc":
            line.lane = first_lane.get(line.names[0], 0)
            alloc_of[line.names[0]] = line.text.strip().split(" = ", 1)[1]
            lanes_of[line.names[0]] = set()
        elif line.kind == "reuse":
            new_name, old = line.names
            base = names.of(old)
            lane = first_lane.get(new_name, 0)
            # A plain reuse has the reused name's size and strides (a view of its block would be
            # a reinterpret_tensor): only a name allocated as it stands gives them.
            if lanes_of.get(base, set()) - {lane} and old in alloc_of and overwrites.get(new_name, False):
                parsed[k] = _Line("alloc", f"{line.indent}{new_name} = {alloc_of[old]}", line.indent,
                                  names=[new_name], lane=lane)
                alloc_of[new_name] = alloc_of[old]
                lanes_of[new_name] = set()
                parsed.insert(k + 1, _Line("del", f"{line.indent}del {old}", line.indent, names=[old]))
            else:
                names.base[new_name] = old
                if old in alloc_of:  # a plain reuse of a reuse is still allocated as the first was
                    alloc_of[new_name] = alloc_of[old]
        elif line.kind == "alias":
            names.base[line.names[0]] = line.names[1]
        elif line.kind == "launch":
            for n in line.names:
                lanes_of.setdefault(names.of(n), set()).add(line.lane)
            line.writes = {names.of(n) for n in line.wrote}
            line.reads = {names.of(n) for n in line.names} - line.writes
    return parsed, inputs, streams, names


def rewrite(module_source: str, lane_of: Callable[[list[str], list[str]], int | None],
            device: int = 0) -> Rewritten:
    """Rewrites ``module_source``'s ``call`` so that each launch runs on its lane.

    Args:
        module_source: the output code of one Inductor compile (a CUDA graph's).
        lane_of: a launch's lane from the buffers it writes and the source nodes Inductor
            listed above it (``None``: no lane known, the main lane's).
        device: the CUDA device index of the code's kernels (:data:`HOST` for a host compile's).

    Returns:
        The rewritten function and what was written into it.

    Raises:
        RewriteError: the module has no ``call`` in a form this reads.
    """
    parsed, inputs, streams, names = _parse(module_source, lane_of)

    # Pass 2: emit, with the switches, records and waits the storages need. A lane's clock
    # holds, per lane, how many of its launches it is ordered after (-1: none; the main lane's
    # entry, where the caller's work and the inputs stand, is its launch 0).
    lanes = sorted({line.lane for line in parsed if line.kind in ("launch", "alloc")} - {0})
    clock: dict[int, dict[int, int]] = {0: {0: 0}}
    count: dict[int, int] = {0: 0}
    last_at: dict[int, int] = {}
    snapshot: dict[int, dict[int, int]] = {}
    last_write: dict[str, tuple[int, int, int]] = {}  # storage -> (lane, its count, out index)
    reads_since: dict[str, list[tuple[int, int, int]]] = {}
    alloc_lane: dict[str, int] = {n: 0 for n in inputs}
    # storage -> lane -> that lane's count at its last use of the storage.
    last_use: dict[str, dict[int, int]] = {n: {0: 0} for n in inputs}
    # Names whose del waits for their allocating lane to cover every use: name -> [the del's
    # indent, the least indent of a line since] (a del moves only within its block: a line less
    # indented since means the code left it, and a wait there may not run where the del would).
    pending: dict[str, list[int]] = {}
    out: list[str] = []
    record_after: dict[int, int] = {}  # out index -> event slot
    state = {"waits": 0, "switches": 0, "current": 0, "moved": 0}
    started: set[int] = {0}
    launches: list[tuple[str, int]] = []
    body_indent: str | None = None
    entry_at = -1

    def covered(st: str) -> bool:
        """Whether the allocating lane of ``st`` is ordered after every use of it elsewhere."""
        home = alloc_lane.get(st, 0)
        mine = clock.get(home, {})
        return all(mine.get(k, -1) >= v for k, v in last_use.get(st, {}).items() if k != home)

    def need(lane: int, dep: tuple[int, int, int], indent: str) -> None:
        dlane, when, at = dep
        mine = clock.setdefault(lane, {})
        if dlane == lane or mine.get(dlane, -1) >= when:
            return
        slot = record_after.setdefault(at, len(record_after))
        out.append(f"{indent}{RUNTIME}.wait({slot})")
        state["waits"] += 1
        for k, v in snapshot[at].items():
            mine[k] = max(mine.get(k, -1), v)
        free = [n for n, (level, least) in pending.items() if level == len(indent) and least >= level
                and alloc_lane.get(names.of(n), 0) == lane and covered(names.of(n))]
        if free:
            out.append(f"{indent}del {', '.join(free)}")
            state["moved"] += len(free)
            for n in free:
                del pending[n]

    def use(st: str, lane: int) -> None:
        last_use.setdefault(st, {})[lane] = count[lane]

    def switch(lane: int, indent: str) -> None:
        if lane == state["current"]:
            return
        out.append(f"{indent}{RUNTIME}.switch({lane})")
        out.extend(f"{indent}{var} = get_raw_stream({dev})" for var, dev in streams.items())
        state["switches"] += 1
        state["current"] = lane
        if lane not in started:
            # A capture forks each stream it uses from the capturing one, before anything is
            # allocated or launched there (an allocation on a stream outside the capture would
            # not come from the capture's pool): a side lane first waits for the main lane's
            # entry; what its launches read, they wait for themselves.
            started.add(lane)
            need(lane, (0, 0, entry_at), indent)

    tail: list[str] = []
    for k, line in enumerate(parsed):
        if line.kind == "return":
            tail = [p.text for p in parsed[k:]]
            break
        if line.text.strip():
            for since in pending.values():
                since[1] = min(since[1], len(line.indent))
        if line.kind in ("launch", "alloc") and body_indent is None:
            body_indent = line.indent
            out.append(f"{line.indent}{RUNTIME}.enter({device})")
            entry_at = last_at[0] = len(out) - 1
            snapshot[last_at[0]] = {0: 0}
            for n in inputs:
                last_write[n] = (0, 0, last_at[0])
        if line.kind == "alloc":
            switch(line.lane, line.indent)
            out.append(line.text)
            st = names.of(line.names[0])
            alloc_lane[st] = line.lane
            # The block may be one this lane's earlier work used: a write here, in its order.
            count[line.lane] = count.get(line.lane, 0) + 1
            clock.setdefault(line.lane, {})[line.lane] = count[line.lane]
            last_use[st] = {}
            use(st, line.lane)
            last_at[line.lane] = len(out) - 1
            snapshot[last_at[line.lane]] = dict(clock[line.lane])
            last_write[st] = (line.lane, count[line.lane], last_at[line.lane])
            reads_since[st] = []
            continue
        if line.kind == "del":
            keep, later = [], []
            for n in line.names:
                st = names.of(n)
                (keep if covered(st) else later).append(n)
            if keep:
                out.append(f"{line.indent}del {', '.join(keep)}")
            for n in later:
                pending[n] = [len(line.indent), len(line.indent)]
            continue
        if line.kind != "launch":
            out.append(line.text)
            continue
        lane = line.lane
        switch(lane, line.indent)
        for st in sorted(line.reads | line.writes):
            if st in last_write:
                need(lane, last_write[st], line.indent)
        for st in sorted(line.writes):
            for dep in reads_since.get(st, ()):
                need(lane, dep, line.indent)
        out.append(line.text)
        count[lane] = count.get(lane, 0) + 1
        clock.setdefault(lane, {})[lane] = count[lane]
        at = last_at[lane] = len(out) - 1
        snapshot[at] = dict(clock[lane])
        for st in line.reads:
            reads_since.setdefault(st, []).append((lane, count[lane], at))
            use(st, lane)
        for st in line.writes:
            last_write[st] = (lane, count[lane], at)
            reads_since[st] = []
            alloc_lane.setdefault(st, lane)
            use(st, lane)
        launches.append((line.text.strip(), lane))

    # Each record goes right after the launch its waits depend on, on that launch's lane.
    final: list[str] = []
    for i, text in enumerate(out):
        final.append(text)
        if i in record_after:
            final.append(f"{text[: len(text) - len(text.lstrip())]}{RUNTIME}.record({record_after[i]})")
    if body_indent is not None:
        # The main lane waits for every side lane (the runtime records their ends), then the
        # frees held back run: every use of those blocks is ordered before the caller's next work.
        final.append(f"{body_indent}{RUNTIME}.leave()")
        if pending:  # the frees never covered within their blocks
            final.append(f"{body_indent}del {', '.join(pending)}")
    header = module_source.splitlines()[call_body(module_source)[0]]
    return Rewritten("\n".join([header, *final, *tail]) + "\n", launches, state["switches"], len(record_after),
                     state["waits"], list(pending), lanes, state["moved"])


def rewrite_module(module_source: str, lane_of: Callable[[list[str], list[str]], int | None],
                   device: int = 0) -> tuple[str, Rewritten]:
    """``module_source`` with two ``call`` bodies: the original, and :func:`rewrite`'s with
    its launches on lanes; ``call`` runs the second while :func:`capturepass.runtime.code_lanes.active`
    says lanes are bound (a candidate with side streams), the first otherwise (one lane's code,
    its frees where Inductor put them)."""
    done = rewrite(module_source, lane_of, device)
    first, end, body = call_body(module_source)
    lines = module_source.splitlines()
    head = lines[first]
    indent = head[: len(head) - len(head.lstrip())]
    method = "self, " in head
    one, lanes = "_cp_one_call", LANES_CALL
    inner = indent + "    "
    target = "self." if method else ""
    params = "self, args" if method else "args"
    dispatch = [
        f"{indent}def call({params}):",
        f"{inner}if {RUNTIME}.active():",
        f"{inner}    return {target}{lanes}(args)",
        f"{inner}return {target}{one}(args)",
        "",
        f"{indent}def {one}({params}):",
        *body,
        "",
        f"{indent}def {lanes}({params}):",
        *done.source.splitlines()[1:],
    ]
    new = [done.summary().line(), f"import capturepass.runtime.code_lanes as {RUNTIME}", *lines[:first], *dispatch,
           *lines[end:]]
    return "\n".join(new) + "\n", done


# The lanes' body of a rewritten module (its one lane's body is ``_cp_one_call``).
LANES_CALL = "_cp_lanes_call"

_LANES_CALL = re.compile(rf"^{RUNTIME}\.(enter|switch|record|wait|leave)\((-?\d*)\)$")


def check(rewritten: str, module_source: str) -> list[str]:
    """What the lanes' body of a rewrite (:attr:`Rewritten.source`, of ``module_source``'s
    ``call``) leaves unordered, found by
    running its lane switches, records and waits on vector clocks, apart from the rewrite:

    - a launch that reads a storage another lane wrote last, or writes one another lane read or
      wrote, with no event ordering it after that;
    - a side lane that allocates or launches before it waits for the main lane (a capture
      forks every stream it uses from the capturing one);
    - a ``del`` of a storage used on a lane other than its allocating one, before the join and
      before the allocating lane waits for that use;
    - a wait for a slot not yet recorded; a return with side lanes not joined.
    """
    parsed, inputs, _, names = _parse(rewritten, lambda writes, sources: None, kernel_params(module_source))
    out: list[str] = []
    clock: dict[int, dict[int, int]] = {0: {0: 0}}
    events: dict[int, dict[int, int]] = {}
    last_write: dict[str, tuple[int, int]] = {n: (0, 0) for n in inputs}
    reads_since: dict[str, list[tuple[int, int]]] = {}
    alloc_lane: dict[str, int] = {n: 0 for n in inputs}
    used: dict[str, dict[int, int]] = {n: {0: 0} for n in inputs}  # storage -> lane -> its last use
    lane, joined, side = 0, True, set()

    def merge(into: dict[int, int], other: dict[int, int]) -> None:
        for k, v in other.items():
            into[k] = max(into.get(k, -1), v)

    def ordered(on: int, dep: tuple[int, int]) -> bool:
        return dep[0] == on or clock.setdefault(on, {}).get(dep[0], -1) >= dep[1]

    def tick(on: int) -> int:
        mine = clock.setdefault(on, {})
        mine[on] = mine.get(on, 0) + 1
        return mine[on]

    for line in parsed:
        s = line.text.strip()
        if line.kind == "lanes":
            m = _LANES_CALL.match(s)
            if m is None:
                out.append(f"unreadable lanes call: {s}")
                continue
            op, arg = m.group(1), int(m.group(2)) if m.group(2) else 0
            if op == "enter":
                lane, joined = 0, False
            elif op == "switch":
                lane = arg
                if arg:
                    side.add(arg)
            elif op == "record":
                events[arg] = dict(clock.setdefault(lane, {}))
            elif op == "wait":
                if arg not in events:
                    out.append(f"wait for event {arg} before it is recorded")
                else:
                    merge(clock.setdefault(lane, {}), events[arg])
            elif op == "leave":
                for k in side:
                    merge(clock[0], clock.get(k, {}))
                lane, joined = 0, True
            continue
        if line.kind in ("alloc", "launch") and lane and clock.get(lane, {}).get(0, -1) < 0:
            what = "allocates" if line.kind == "alloc" else "launches"
            out.append(f"lane {lane} {what} before it waits for the main lane: {s[:80]}")
        if line.kind == "alloc":
            st = names.of(line.names[0])
            alloc_lane[st] = lane
            last_write[st], reads_since[st] = (lane, tick(lane)), []
            used[st] = {lane: last_write[st][1]}
        elif line.kind == "del":
            for n in line.names:
                st = names.of(n)
                home = alloc_lane.get(st, 0)
                early = sorted(k for k, v in used.get(st, {}).items() if k != home and not ordered(home, (k, v)))
                if not joined and early:
                    out.append(f"{n} freed before lane {home}, which allocated it, waits for its use on lanes "
                               f"{early}")
        elif line.kind == "launch":
            for st in sorted(line.reads | line.writes):
                if st in last_write and not ordered(lane, last_write[st]):
                    out.append(f"lane {lane} uses {st}, written on lane {last_write[st][0]} with no event after: "
                               f"{s[:80]}")
            for st in sorted(line.writes):
                for dep in reads_since.get(st, ()):
                    if not ordered(lane, dep):
                        out.append(f"lane {lane} writes {st}, read on lane {dep[0]} with no event after: {s[:80]}")
            now = tick(lane)
            for st in line.reads:
                reads_since.setdefault(st, []).append((lane, now))
                used.setdefault(st, {})[lane] = now
            for st in line.writes:
                last_write[st], reads_since[st] = (lane, now), []
                used.setdefault(st, {})[lane] = now
                alloc_lane.setdefault(st, lane)
        elif line.kind == "return" and not joined:
            out.append("returns before the side lanes are joined")
    return out
