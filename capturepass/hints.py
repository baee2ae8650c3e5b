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
import functools
import logging
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
import torch.fx.traceback as fx_traceback

from capturepass.errors import HintError
from capturepass.ir.meta import HINT_KEY, MAIN_LANE_NAME


log = logging.getLogger("capturepass")
P = ParamSpec("P")
R = TypeVar("R")

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


class Lane:
    """A lane hint: a context manager and a decorator, reusable and re-entrant.

    Each entry opens its own ``torch.fx.traceback.annotate`` block, kept on a stack
    of open blocks, and each exit closes the latest: one hint object may be entered
    in several places, one after another or nested in itself. The decorator form
    makes a fresh hint per call.

    NOTE: a hint made inside the compiled function (``with capturepass.lane("aux"):``,
    or one kept in a local and entered several times) and the decorator form are
    traced by every Dynamo. A hint object made outside and entered with ``with``
    inside a compiled function is traced by newer Dynamo (torch 2.14); earlier
    releases can only enter a context manager they saw being made, give up on that
    frame and run it eagerly: entering the hint then logs a warning saying so (once
    per hint object).

    Attributes:
        name: the lane's name.
    """

    def __init__(self, name: str) -> None:
        self.name = _check_name(name)
        self._open: list[contextlib.AbstractContextManager] = []
        self._warned = False

    @contextlib.contextmanager
    def _block(self) -> Iterator[None]:
        with fx_traceback.annotate({HINT_KEY: {"lane": self.name}}):
            yield

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            self._warn_if_skipped()
        block = self._block()
        block.__enter__()
        self._open.append(block)

    def __exit__(self, *exc: object) -> bool | None:
        return self._open.pop().__exit__(*exc)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        name = self.name

        @functools.wraps(fn)
        def hinted(*args: P.args, **kwargs: P.kwargs) -> R:
            with Lane(name):  # made here, so that Dynamo sees it made and can enter it
                return fn(*args, **kwargs)

        return hinted

    def _warn_if_skipped(self) -> None:
        """Warns when this hint runs eagerly inside a compiled function (Dynamo gave up on the frame)."""
        if self._warned:
            return
        try:
            from torch._C._dynamo.eval_frame import get_eval_frame_callback
        except ImportError:  # pragma: no cover - torch without Dynamo
            return
        if get_eval_frame_callback() in (None, False):
            return  # plain eager code: the hint does nothing, as documented
        self._warned = True
        log.warning(
            "capturepass: the hint %r runs eagerly inside a compiled function: Dynamo cannot enter a "
            "context manager made outside the compiled code, so it ran that frame without compiling it "
            "(no lanes). Write `with capturepass.lane(%r):` inside the function, or use the hint as a "
            "decorator.",
            self, self.name,
        )

    def __repr__(self) -> str:
        return f"capturepass.lane({self.name!r})"


def lane(name: str) -> Lane:
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
        A context manager that is also a decorator (Dynamo traces both forms); one
        object may be entered any number of times, also inside itself.

    Raises:
        HintError: an invalid or reserved name.
    """
    return Lane(name)
