"""The ``capturepass`` logger, registered with torch's logging.

``TORCH_LOGS="capturepass"`` shows one INFO line per decision the passes take
(the lane assignment of each graph, each serialization, each op enqueued first,
each break); ``TORCH_LOGS="+capturepass"`` adds DEBUG lines, among them each
pass's time. Every module logs to ``logging.getLogger("capturepass")``.

Where torch offers ``torch._logging._internal.register_log``, the name is
registered there (so that ``torch._logging.set_logs`` and the ``TORCH_LOGS``
help know it). torch parses ``TORCH_LOGS`` when it is imported, before
capturepass can register anything; torch versions that accept importable module
names there configure the logger then (importing capturepass to find its
submodules). Where torch has no ``register_log``, :func:`register` configures
the logger from ``TORCH_LOGS`` with the standard ``logging`` module.
"""

from __future__ import annotations

import logging
import os
import re

LOGGER_NAME = "capturepass"
ENV = "TORCH_LOGS"

log = logging.getLogger(LOGGER_NAME)


def _requested_level(setting: str) -> int | None:
    """The level ``TORCH_LOGS`` asks of the capturepass logger, or ``None``."""
    for item in re.split(r"[,\s]+", setting.strip()):
        name = item.lstrip("+-")
        if name != LOGGER_NAME:
            continue
        return logging.DEBUG if item.startswith("+") else logging.ERROR if item.startswith("-") else logging.INFO
    return None


def register() -> str:
    """Registers the logger with torch's logging where possible; returns ``"torch"`` or ``"logging"``.

    Idempotent. Never raises: logging set-up must not break an import.
    """
    how = "logging"
    try:
        from torch._logging import _internal
    except Exception:  # pragma: no cover - torch without its logging module
        _internal = None
    register_log = getattr(_internal, "register_log", None)
    if callable(register_log):
        try:
            registry = getattr(_internal, "log_registry", None)
            is_log = getattr(registry, "is_log", None)
            if not (callable(is_log) and is_log(LOGGER_NAME)):
                register_log(LOGGER_NAME, LOGGER_NAME)
            how = "torch"
        except Exception:  # pragma: no cover - a private API that changed shape
            how = "logging"
    level = _requested_level(os.environ.get(ENV, ""))
    if how == "logging" and level is not None and log.level == logging.NOTSET:
        # torch cannot configure it: do what TORCH_LOGS asks with the standard module.
        # (Where torch can, it may be importing capturepass right now, while it parses
        # TORCH_LOGS, and sets the level and handler itself once this returns.)
        log.setLevel(level)
        if not _has_handler(log):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname).1s %(asctime)s %(name)s] %(message)s"))
            log.addHandler(handler)
        log.propagate = False
    return how


def _has_handler(logger: logging.Logger) -> bool:
    return bool(logger.handlers)
