"""JSON files that processes share (the schedule cache, the devices' calibration): read
leniently, written atomically, and each failure warned about once per file or folder.

Another process reads either the old file or the new one, never half of one (a write goes
to a temporary file that replaces the old). A file that cannot be read or written never
fails a call: the reader gets ``None`` and measures (or calibrates) again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

log = logging.getLogger("capturepass")

_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Logs ``message`` (a warning, or ``level``) the first time ``key`` is seen in this process."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.log(level, message, *args)


def read_json(path: str, unreadable: str) -> Any:
    """The JSON value in ``path``; ``None`` when there is no such file, or when it cannot be
    read or parsed (warned once with ``unreadable % (path, error type, error)``)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no file (a folder that cannot be made is reported when one is written)
    except (OSError, ValueError) as e:
        warn_once(f"read:{path}", unreadable, path, type(e).__name__, e)
        return None


def write_json(path: str, value: Any, unwritable: str, indent: int | None = None) -> bool:
    """Writes ``value`` to ``path`` atomically, making its folder; on failure warns once per
    folder with ``unwritable % (folder, error)`` and returns ``False``."""
    directory = os.path.dirname(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(value, f, indent=indent)
        os.replace(tmp, path)
        return True
    except OSError as e:
        warn_once(f"write:{directory}", unwritable, directory, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
