"""External streams: streams capturepass does not own, joined at every segment boundary.

An engine runs work beside the model on streams of its own: a weight-offload
copy stream that fills the weights a layer is about to read, a communication
stream that sends the model's output while the next step starts. The compile
option ``external_streams={"offload": "before", "comm": "after"}`` declares
them by name and relation (see :class:`~capturepass.ir.meta.GraphInfo`); the
passes put a ``capturepass.join_external`` at every segment boundary, which the
verifier checks like any other join; and at run time the engine binds each
name to its stream::

    capturepass.external_stream("offload", copy_stream)

A join ``into`` the graph makes the main lane wait for what the external
stream has issued so far; a join out of it makes the external stream wait for
the main lane, after every lane has joined. A captured segment cannot wait for
a stream outside its capture, so around a capture and each replay the runtime
performs the joins outside the graph, on the stream the graph is launched on:
the same order, at the same boundaries. Inside a capture an engine started
around the model, the external stream must be part of that capture (forked
from the capturing stream); otherwise the join raises, naming the stream.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from capturepass.errors import ResourceError

_bound: dict[str, Any] = {}
_lock = threading.Lock()


def external_stream(name: str, stream: Any) -> None:
    """Binds the external stream ``name`` (declared by the option ``external_streams``) to ``stream``.

    Args:
        name: the declared name.
        stream: a ``torch.cuda.Stream``, or ``None`` to unbind.

    Raises:
        ResourceError: a bad name or stream.
    """
    if not isinstance(name, str) or not name:
        raise ResourceError(f"an external stream needs a non-empty name, got {name!r}")
    with _lock:
        if stream is None:
            _bound.pop(name, None)
            return
        if not isinstance(stream, torch.cuda.Stream):
            raise ResourceError(f"external stream {name!r} must be a torch.cuda.Stream, got {type(stream).__name__}")
        _bound[name] = stream


def bound_stream(name: str) -> Any:
    """The stream bound to ``name``.

    Raises:
        ResourceError: nothing is bound to ``name``.
    """
    with _lock:
        stream = _bound.get(name)
    if stream is None:
        raise ResourceError(
            f"external stream {name!r} is declared (option external_streams) but not bound: call "
            f"capturepass.external_stream({name!r}, stream) before running the compiled model"
        )
    return stream


def is_capturing(stream: Any) -> bool:
    """Whether ``stream`` is part of a stream capture in progress."""
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()
