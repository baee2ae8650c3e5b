"""Reading a dump directory back: every compiled graph's folder and its validated ``graph.json``."""

from __future__ import annotations

import os

from capturepass.errors import DumpError
from capturepass.ir import graph_json
from capturepass.ir.graph_json import GRAPH_FILE, GraphDoc


def graph_dirs(root: str) -> list[str]:
    """The folders under ``root`` (``root`` itself, or below it) that hold a ``graph.json``, in path order."""
    if not os.path.exists(root):
        raise DumpError(root, "", "no such directory")
    if not os.path.isdir(root):
        raise DumpError(root, "", f"is a file, not a dump directory (give the folder that holds {GRAPH_FILE})")
    if os.path.isfile(os.path.join(root, GRAPH_FILE)):
        return [root]
    found = []
    for dirpath, _dirnames, filenames in sorted(os.walk(root)):
        if GRAPH_FILE in filenames:
            found.append(dirpath)
    return sorted(found)


def load_graph_dirs(root: str) -> list[tuple[str, str, GraphDoc]]:
    """``(name, folder, graph.json document)`` of every graph under ``root``, in path order.

    Every document is validated (:func:`capturepass.ir.graph_json.load`).

    Raises:
        DumpError: ``root`` is missing or a file, holds no ``graph.json``, or one is
            malformed; it names the file and the field at fault.
    """
    graphs = []
    for d in graph_dirs(root):
        name = os.path.relpath(d, root) if d != root else os.path.basename(os.path.normpath(d))
        graphs.append((name, d, graph_json.load(os.path.join(d, GRAPH_FILE))))
    if not graphs:
        raise DumpError(root, "", f"no capturepass dump ({GRAPH_FILE}) in this directory or below")
    return graphs


def load_graphs(root: str) -> list[tuple[str, GraphDoc]]:
    """``(name, graph.json document)`` of every graph under ``root``, in path order.

    Raises:
        DumpError: as :func:`load_graph_dirs`.
    """
    return [(name, graph) for name, _, graph in load_graph_dirs(root)]
