"""The package's layers hold: no import runs upward, passes and runtime never meet, no two modules
import each other.

Bottom to top (docs/architecture.md): the base (``errors``, ``logs``) → ``ir`` → ``passes`` and
``runtime`` side by side → ``backends`` (the only place that joins passes and runtime) → the face
(``capturepass/__init__``, ``hints``, ``show``, ``measure``) → ``testing``. Every import counts,
function-local ones included: a local import is no way round a layer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "capturepass"

LAYERS = {"base": 0, "ir": 1, "passes": 2, "runtime": 2, "backends": 3, "face": 4, "testing": 5}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"  # capturepass/__init__
    top = parts[1]
    if top in ("errors", "logs"):
        return "base"
    if top in ("ir", "passes", "runtime", "backends", "testing"):
        return top
    return "face"  # hints, show, measure, __main__


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every capturepass module ``module`` imports (at any depth of its code; annotation-only
    imports under ``if TYPE_CHECKING:`` aside)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    skip = _type_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("capturepass"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("capturepass"):
                continue
            out.add(base)
            for alias in node.names:  # ``from capturepass.ir import meta`` imports a module
                out.add(f"{base}.{alias.name}")
    return out


MODULES = _modules()
GRAPH = {m: {i for i in _imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_upward_and_passes_never_meet_runtime(module):
    mine = _layer(module)
    bad = []
    for target in sorted(GRAPH[module]):
        theirs = _layer(target)
        if LAYERS[theirs] > LAYERS[mine] or {mine, theirs} == {"passes", "runtime"}:
            bad.append(f"{target} ({theirs})")
    assert not bad, f"{module} ({mine}) imports {', '.join(bad)}"


def test_no_two_modules_import_each_other():
    pairs = sorted(
        (a, b) for a, targets in GRAPH.items() for b in targets
        if a < b and a in GRAPH.get(b, ()) and not (b.startswith(a + ".") or a.startswith(b + "."))
    )
    assert pairs == []


def test_the_layer_table_knows_every_module():
    assert {_layer(m) for m in MODULES} == set(LAYERS)
