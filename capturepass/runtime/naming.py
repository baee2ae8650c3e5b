"""One numbering of owners, from the dump to the runtime, and the record of the owners that ran.

A compiled graph's owner (``OwnerId``, printed ``gN``) is the number the compile driver
gave the graph in this process (``backends.compile.new_owner``, counting from 0): its
dumps say ``owner gN``. At run time the graph's callable (``Executor``) holds several
owners (``GraphOwner``), each named after the graph owner:

``gN.mI``
    model instance ``I`` of graph ``gN``: the ``I``-th set of static-input addresses (a
    model's parameters and buffers) the graph ran with, counted from 0 per graph owner
    in this process. Dynamo serves every instance of a module class with one compiled
    graph, so a target and a draft model of one class share ``gN`` and are ``gN.m0`` and
    ``gN.m1``. A model that was collected and a new one built at the same addresses are
    two instances. Not an owner object itself: the prefix of its owners.
``gN.mI.cJ``
    the owner of instance ``I``'s ``J``-th capture shape (from 0, in the order its shapes
    were first captured; a shape captured again after a release keeps its number).
``gN.mI.cJ.<schedule>``
    the owner of another schedule candidate of that capture shape than the cost model's
    (``one_lane``, ``auxK``, ``merged``: ``runtime.pick``), captured to be measured; the
    chosen one stays open (and is listed in ``owners.json``), the others are closed once
    measured. The cost model's candidate is ``gN.mI.cJ`` itself.
``gN.mI.eager``
    the owner of instance ``I``'s uncaptured runs (host graphs, ``cudagraphs="none"``,
    shapes beyond ``max_captures``) and of its runs inside an engine's capture.
``gN.mI.profile``
    a throwaway owner of instance ``I`` inside ``capturepass.profiling_capture`` (a host
    graph's first run there stands for its capture).

Runtime messages and errors (``ResourceError``, the closed-callable error, the logs),
:func:`capturepass.trace`'s measured traces and ``capturepass show`` use these names. An
owner's name is unique among the open owners of the process (leases, channels and
workspaces are keyed by it).

The dump is written at compile time, before any model ran, so it names the graph owner
only. The callable of a graph compiled with a ``dump_dir`` also writes ``owners.json``
into the graph's dump folder (:data:`OWNERS_FILE`): written empty when the callable is
made, rewritten whenever it creates an owner, it lists every owner it created in this
process, in order, with its model instance, role and input shapes (an owner released
later stays listed). ``capturepass show`` prints them under the graph.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from capturepass.ir import graph_json
from capturepass.ir.printer import format_type

log = logging.getLogger("capturepass")

OWNERS_FILE = "owners.json"
OWNERS_FORMAT = "capturepass-owners/1"
ROLES = ("capture", "eager", "profile")

_models: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def next_model(graph_owner: str) -> str:
    """The name of the next model instance of ``graph_owner`` (``"g3"`` -> ``"g3.m0"``, ``"g3.m1"``, ...)."""
    with _lock:
        index = _models[graph_owner]
        _models[graph_owner] += 1
    return f"{graph_owner}.m{index}"


def model_of(owner: str) -> str:
    """The model instance an owner belongs to: ``"g3.m0.c1.one_lane"`` -> ``"g3.m0"``."""
    return ".".join(owner.split(".")[:2])


def model_order(model: str) -> tuple[int, int]:
    """A sort key of model instance names in the order they were made: ``"g3.m1"`` -> ``(3, 1)``."""
    graph, index = model.split(".")[:2]
    return int(graph[1:]), int(index[1:])


def capture_owner(model: str, shape: int) -> str:
    """The name of the owner of ``model``'s capture shape number ``shape``: ``g3.m0.c1``."""
    return f"{model}.c{shape}"


def candidate_owner(capture: str, schedule: str) -> str:
    """The name of the owner of schedule candidate ``schedule`` of capture owner ``capture``:
    ``g3.m0.c1.one_lane``."""
    return f"{capture}.{schedule}"


def eager_owner(model: str) -> str:
    """The name of the owner of ``model``'s uncaptured runs: ``g3.m0.eager``."""
    return f"{model}.eager"


def profile_owner(model: str) -> str:
    """The name of ``model``'s throwaway owner inside a profiling capture: ``g3.m0.profile``."""
    return f"{model}.profile"


def describe_inputs(args: Sequence[Any], static: Sequence[int], in_place: Collection[int] = ()) -> str:
    """The inputs a call passes besides the static ones (parameters), as the dump types them:
    ``f32[8,64], 3``; those a capture reads where they are (``in_place``, no copy per call) say so:
    ``f32[8,64] in place``."""
    skip = set(static)
    parts = []
    for i, a in enumerate(args):
        if i in skip:
            continue
        if isinstance(a, torch.Tensor):
            parts.append(format_type(a) + (" in place" if i in in_place else ""))
        elif isinstance(a, (bool, int, float)):
            parts.append(repr(a))
        else:
            parts.append(type(a).__name__)
    return ", ".join(parts)


class OwnersRecord:
    """``owners.json`` of one compiled graph: the owners its callable created (see the module doc).

    Args:
        folder: the graph's dump folder.
        graph_owner: the graph owner's name (``"g3"``).
        kind: the graph's kind (``"inference"``, ``"forward"``, ...).
    """

    def __init__(self, folder: str, graph_owner: str, kind: str) -> None:
        self.path = os.path.join(folder, OWNERS_FILE)
        self.doc: dict[str, Any] = {"format": OWNERS_FORMAT, "graph": kind, "owner": graph_owner,
                                    "pid": os.getpid(), "owners": []}
        self._broken = False
        self._write()

    def add(self, name: str, model: str, role: str, inputs: str, device: str) -> None:
        """Records a new owner and rewrites the file; an owner made again under its name (a shape
        captured again: an input moved, or stayed put) replaces its entry."""
        entry = {"name": name, "model": model, "role": role, "inputs": inputs, "device": device}
        owners = self.doc["owners"]
        for i, old in enumerate(owners):
            if old["name"] == name:
                owners[i] = entry
                break
        else:
            owners.append(entry)
        self._write()

    def _write(self) -> None:
        if self._broken:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.doc, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, self.path)  # a reader never sees half a file
        except OSError as exc:
            self._broken = True
            log.warning("capturepass: cannot write %s (%s); the graph's runtime owners are not recorded",
                        self.path, exc.strerror or exc)


def load_owners(folder: str, graph_owner: str) -> tuple[dict[str, Any] | None, str | None]:
    """The ``owners.json`` of a graph's dump folder, if it is there and belongs to ``graph_owner``.

    Returns:
        ``(document, None)``, or ``(None, reason)``: ``reason`` is ``None`` when there is no
        ``owners.json`` and says why it is not used otherwise (unreadable, malformed, or
        written by another compile: its ``owner`` is not the ``graph.json``'s).
    """
    doc, reason = graph_json.load_side_file(os.path.join(folder, OWNERS_FILE), OWNERS_FORMAT)
    if doc is None:
        return None, reason
    owners = doc.get("owners")
    if not isinstance(doc.get("owner"), str) or not isinstance(owners, list):
        return None, f"{OWNERS_FILE} is malformed: owner must be a string and owners a list"
    for i, o in enumerate(owners):
        if not isinstance(o, dict) or not all(isinstance(o.get(k), str) for k in ("name", "model", "role", "inputs")):
            return None, f"{OWNERS_FILE} is malformed: owners[{i}] needs the strings name, model, role and inputs"
    if doc["owner"] != graph_owner:
        return None, f"{OWNERS_FILE} belongs to owner {doc['owner']}, another compile than graph.json's {graph_owner}"
    return doc, None
