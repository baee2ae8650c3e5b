"""User lane hints: ``with capturepass.lane("aux"):`` and ``@capturepass.lane("aux")``.

A hint is carried through Dynamo and AOT autograd by
``torch.fx.traceback.annotate``, which tags every node traced inside the block
with ``meta["custom"]["capturepass"]``; the ``read_hints`` pass turns that tag
into typed metadata and removes it before any graph reaches Inductor. Nested
hints: the innermost lane wins. In eager execution (no ``torch.compile``) a hint
does nothing.
"""

from __future__ import annotations

import contextlib

import torch.fx.traceback as fx_traceback

from capturepass.errors import HintError
from capturepass.ir.meta import MAIN_LANE_NAME

HINT_KEY = "capturepass"

if not hasattr(fx_traceback, "annotate"):  # pragma: no cover - every supported torch has it
    raise ImportError("capturepass needs torch.fx.traceback.annotate (torch 2.11 or newer)")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise HintError(f"a lane name must be a non-empty identifier, got {name!r}")
    if name == MAIN_LANE_NAME:
        raise HintError(
            f"capturepass.lane({name!r}) names the main lane, which is where unhinted code already "
            "runs; name an auxiliary lane (for example 'aux')"
        )
    return name


def lane(name: str) -> contextlib.AbstractContextManager:
    """Puts the code inside on a named auxiliary lane.

    Usable as a context manager inside a model's ``forward``, or as a decorator
    of a function or method::

        with capturepass.lane("shared"):
            s = self.shared_expert(x)

        @capturepass.lane("indexer")
        def index(self, q, k): ...

    Args:
        name: the lane's name; ``"main"`` is refused.

    Returns:
        A context manager that is also a decorator (Dynamo traces both forms).

    Raises:
        HintError: an invalid or reserved name.
    """
    return fx_traceback.annotate({HINT_KEY: {"lane": _check_name(name)}})
