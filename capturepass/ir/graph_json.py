"""Reading ``graph.json`` back: the one validating loader of the document the printer writes.

:func:`capturepass.ir.printer.to_json` writes ``graph.json`` into each graph's dump
folder; ``capturepass show`` and the viewer read it back through :func:`load`, which
checks every field they use before anything reads it. A malformed document (a list at
the top, a field of the wrong type, bytes that are not UTF-8, a lane index past the
graph's lanes, a cost that is infinite or too large for a float) raises
:class:`~capturepass.errors.DumpError` naming the file and the field at fault, never a
``TypeError`` or a ``MemoryError`` from deep inside the viewer.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, TypedDict

from capturepass.errors import DumpError
from capturepass.ir.meta import Effect

GRAPH_FILE = "graph.json"

# A dump of a real graph is a few MB per ten thousand nodes; a file far beyond that is not one.
MAX_BYTES = 1 << 30
# Costs are FLOPs and bytes of one node: far below this, which keeps every sum of them finite.
MAX_COST = 1e30
# CTA counts are those of one launch.
MAX_CTAS = 1 << 31

EFFECTS = frozenset(e.value for e in Effect)


class BreakDoc(TypedDict):
    """One graph break: the node (``""`` when Dynamo cut the graph), why, and who decided."""

    node: str
    reason: str
    source: str


class NodeDoc(TypedDict, total=False):
    """One node of ``graph.json``; ``name``, ``op``, ``effect``, ``type``, ``args`` and ``lane`` always present."""

    name: str
    op: str
    effect: str
    type: str
    args: list[str]
    lane: int | None
    event: str
    role: str
    external: str
    hint: str
    lease: str
    owner: str
    segment: str
    resources: list[str]
    capability: dict[str, Any]
    cost: dict[str, Any]
    created_by: str
    why: str


class GraphDoc(TypedDict, total=False):
    """A ``graph.json`` document; every key but ``decisions`` and ``external`` always present."""

    graph: str
    owner: str
    lanes: list[str]
    cudagraphs: str
    segments: list[str]
    breaks: list[BreakDoc]
    decisions: list[str]
    external: list[dict[str, str]]
    nodes: list[NodeDoc]


def load_side_file(path: str, fmt: str) -> tuple[dict[str, Any] | None, str | None]:
    """A JSON document a dump folder keeps beside ``graph.json`` (``owners.json``,
    ``measured.json``), if it is there and of format ``fmt``.

    Returns:
        ``(document, None)``, or ``(None, reason)``: ``reason`` is ``None`` when there is no such
        file, and says why it is not used otherwise (unreadable, or not a ``fmt`` document).
    """
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"{name} unreadable ({exc})"
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        return None, f"{name} is not a {fmt} document"
    return doc, None


def load(path: str) -> GraphDoc:
    """Reads and validates the ``graph.json`` at ``path``.

    Raises:
        DumpError: the file cannot be read, is not UTF-8 JSON, or a field is missing,
            of the wrong type or out of range; it names the file and the field.
    """
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise DumpError(path, "", f"is {size} bytes, more than any dump ({MAX_BYTES}); not a graph.json")
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DumpError(path, "", f"cannot be read ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DumpError(path, "", f"is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                        "not a graph.json") from exc
    try:
        doc = json.loads(text)
    except RecursionError as exc:
        raise DumpError(path, "", "is not JSON: nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
        raise DumpError(path, "", f"is not JSON ({_one_line(str(exc))})") from exc
    return validate(doc, path)


def validate(doc: Any, path: str = GRAPH_FILE) -> GraphDoc:
    """Checks a parsed ``graph.json`` document; returns it.

    Raises:
        DumpError: a field is missing, of the wrong type or out of range.
    """
    v = _Validator(path)
    top = v.obj(doc, "")
    for key in ("graph", "owner", "cudagraphs"):
        v.string(v.need(top, key, ""), key)
    lanes = v.strings(v.need(top, "lanes", ""), "lanes")
    v.strings(v.need(top, "segments", ""), "segments")
    for i, b in enumerate(v.array(v.need(top, "breaks", ""), "breaks")):
        where = f"breaks[{i}]"
        brk = v.obj(b, where)
        for key in ("node", "reason", "source"):
            v.string(v.need(brk, key, where), f"{where}.{key}")
    if "decisions" in top:
        v.strings(top["decisions"], "decisions")
    if "external" in top:
        for i, x in enumerate(v.array(top["external"], "external")):
            where = f"external[{i}]"
            ext = v.obj(x, where)
            for key in ("name", "relation"):
                v.string(v.need(ext, key, where), f"{where}.{key}")
    for i, n in enumerate(v.array(v.need(top, "nodes", ""), "nodes")):
        v.node(n, f"nodes[{i}]", len(lanes))
    return top  # type: ignore[return-value]


class _Validator:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> DumpError:
        return DumpError(self.path, field, problem)

    def need(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"{where}.{key}" if where else key, "missing")
        return obj[key]

    def obj(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field or "top level", f"must be an object, not {_kind(value)}")
        return value

    def array(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(field, f"must be a list, not {_kind(value)}")
        return value

    def string(self, value: Any, field: str, optional: bool = False) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, not {_kind(value)}")

    def strings(self, value: Any, field: str) -> list[str]:
        for i, s in enumerate(self.array(value, field)):
            self.string(s, f"{field}[{i}]")
        return value

    def boolean(self, value: Any, field: str) -> None:
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, not {_kind(value)}")

    def integer(self, value: Any, field: str, lo: int, hi: int, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer, not {_kind(value)}")
        if not lo <= value < hi:
            raise self.fail(field, f"is {_brief(value)}, outside [{lo}, {hi})")

    def cost(self, value: Any, field: str) -> None:
        # NaN is written for a size without a hint; anything infinite or huge is not a cost.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"must be a number, not {_kind(value)}")
        if isinstance(value, int):
            if abs(value) > MAX_COST:
                raise self.fail(field, f"is {_brief(value)}, beyond the largest cost ({MAX_COST:g})")
            return
        if math.isnan(value):
            return
        if not math.isfinite(value) or abs(value) > MAX_COST:
            raise self.fail(field, f"is {_brief(value)}, beyond the largest cost ({MAX_COST:g})")

    def node(self, value: Any, where: str, lanes: int) -> None:
        node = self.obj(value, where)
        for key in ("name", "op", "effect", "type"):
            self.string(self.need(node, key, where), f"{where}.{key}")
        if node["effect"] not in EFFECTS:
            raise self.fail(f"{where}.effect", f"is {_brief(node['effect'])}, not one of {', '.join(sorted(EFFECTS))}")
        self.strings(self.need(node, "args", where), f"{where}.args")
        # A lane names one of the graph's lanes; the viewer keeps a clock per lane.
        lane = self.need(node, "lane", where)
        self.integer(lane, f"{where}.lane", 0, 1 << 62, optional=True)
        if lane is not None and lane >= max(lanes, 1):
            raise self.fail(f"{where}.lane", f"is {_brief(lane)}, but the graph has {lanes} lane(s)")
        for key in ("event", "role", "external", "hint", "lease", "owner", "segment", "break", "created_by", "why"):
            if key in node:
                self.string(node[key], f"{where}.{key}")
        if "resources" in node:
            self.strings(node["resources"], f"{where}.resources")
        if "capability" in node:
            self.capability(node["capability"], f"{where}.capability")
        if "cost" in node:
            field = f"{where}.cost"
            cost = self.obj(node["cost"], field)
            for key in ("flops", "bytes"):
                self.cost(self.need(cost, key, field), f"{field}.{key}")
            if "symbolic" in cost:
                self.string(cost["symbolic"], f"{field}.symbolic", optional=True)

    def capability(self, value: Any, field: str) -> None:
        cap = self.obj(value, field)
        for key in ("capturable", "resident_grid", "barrier_free", "monolithic", "collective"):
            if key in cap:
                self.boolean(cap[key], f"{field}.{key}")
        for key in ("overlap", "reason", "source"):
            if key in cap:
                self.string(cap[key], f"{field}.{key}")
        if "resources" in cap:
            self.strings(cap["resources"], f"{field}.resources")
        if "ctas" in cap:
            self.integer(cap["ctas"], f"{field}.ctas", 0, MAX_CTAS, optional=True)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {_brief(value)}"
    if isinstance(value, str):
        return f"the string {_brief(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _brief(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = _one_line(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())
