"""The options of the capturepass backend, validated once at compile time.

``torch.compile(model, backend="capturepass", options={...})`` passes a plain
mapping; :meth:`Options.from_mapping` turns it into a frozen record and raises
:class:`~capturepass.errors.OptionError` naming the offending key and the valid
choices. The record is part of every pass's cache key (``Options.key()``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from typing import Any

from capturepass.errors import OptionError
from capturepass.ir.meta import CaptureMode

POLICIES = ("auto", "hints", "off")
INNER_COMPILERS = ("inductor", "eager", "tensorrt")
CUDAGRAPH_MODES = tuple(mode.value for mode in CaptureMode)
# How a graph relates to an external stream (option ``external_streams``).
RELATIONS = ("before", "after", "both")

DUMP_DIR_ENV = "CAPTUREPASS_DUMP_DIR"
VERIFY_ENV = "CAPTUREPASS_VERIFY"
OPTIONS_ENV = "CAPTUREPASS_OPTIONS"  # a JSON object of options, under those given in code


def env_options() -> dict[str, Any]:
    """The options given by ``CAPTUREPASS_OPTIONS`` (a JSON object), or ``{}``.

    This is how options reach capturepass where the caller passes none, as in an
    engine that calls the backend itself (vLLM): keys given in code win.

    Raises:
        OptionError: the variable is not a JSON object.
    """
    import json

    text = os.environ.get(OPTIONS_ENV, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"{OPTIONS_ENV} must hold a JSON object of options: {e}") from None
    if not isinstance(value, dict):
        raise OptionError(f"{OPTIONS_ENV} must hold a JSON object of options, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated backend options.

    Attributes:
        policy: ``"auto"`` finds independent branches and assigns lanes,
            ``"hints"`` honours only user hints, ``"off"`` keeps one lane.
        max_aux_lanes: how many auxiliary lanes the policy may use (>= 0).
        inner: the compiler of each region: ``"inductor"``, ``"eager"`` or
            ``"tensorrt"`` (needs ``torch_tensorrt``).
        cudagraphs: ``"monolithic"`` (one captured segment), ``"breakable"``
            (segments around non-capturable ops) or ``"none"``. ``None`` means
            "monolithic on CUDA, none elsewhere" and is resolved per graph.
        dump_dir: directory for the per-pass dumps, or ``None``. An empty path is
            refused (it would mean the working directory, which nobody asks for by
            writing nothing). ``CAPTUREPASS_DUMP_DIR`` fills it when the option is not
            given; that variable set to an empty string counts as unset, as shells treat
            an empty variable.
        verify: run the verifier after every pass.
        capture_sizes: batch sizes to capture up front (dim 0 of the first
            dynamic input), as engines pre-capture.
        max_captures: capture shapes kept per graph; beyond it new shapes run
            uncaptured (logged once).
        static_outputs: return replayed outputs without copying them out of the
            graph's pool (they are overwritten by the next call).
        external_streams: streams capturepass does not own, by name, with their
            relation to the graph: ``"before"`` (the graph reads what the stream
            produced), ``"after"`` (the stream reads what the graph produced) or
            ``"both"``; joined at every segment boundary. The engine binds each
            name to its stream with ``capturepass.external_stream(name, stream)``.
        check_replay: before every replay, check that the input buffers and
            the storage of every retained object are those the capture baked in
            (a debug aid; raises ``ResourceError`` naming what moved).
        disable: names of passes to leave out, for bisecting a compile; a pass
            that a later one depends on cannot be left out (``PipelineError``).

    :meth:`for_graph` resolves the options of one graph (its capture mode; the
    backward graph's single lane, uncaptured) into the one record its passes and
    its runtime read.
    """

    policy: str = "auto"
    max_aux_lanes: int = 2
    inner: str = "inductor"
    cudagraphs: str | None = None
    dump_dir: str | None = None
    verify: bool = False
    capture_sizes: tuple[int, ...] = ()
    max_captures: int = 16
    static_outputs: bool = False
    check_replay: bool = False
    external_streams: tuple[tuple[str, str], ...] = ()
    disable: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "Options":
        """Builds options from a user mapping, filling defaults from the environment
        (``CAPTUREPASS_OPTIONS``, then ``CAPTUREPASS_DUMP_DIR`` and ``CAPTUREPASS_VERIFY``).

        Raises:
            OptionError: an unknown key, or a value of the wrong type or range.
        """
        options = {**env_options(), **dict(options or {})}
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise OptionError(
                f"unknown capturepass option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(valid)}"
            )
        # An empty CAPTUREPASS_DUMP_DIR is unset (the shell convention); an empty option is an error.
        if "dump_dir" not in options and os.environ.get(DUMP_DIR_ENV):
            options["dump_dir"] = os.environ[DUMP_DIR_ENV]
        if "verify" not in options and os.environ.get(VERIFY_ENV):
            options["verify"] = os.environ[VERIFY_ENV] not in ("", "0", "false", "False")
        if "capture_sizes" in options:
            sizes = options["capture_sizes"]
            if not isinstance(sizes, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes
            ):
                raise OptionError(f"option 'capture_sizes' must be a list of positive ints, got {sizes!r}")
            options["capture_sizes"] = tuple(sorted(set(sizes), reverse=True))
        if "external_streams" in options:
            options["external_streams"] = _external_streams(options["external_streams"])
        if "disable" in options:
            names = options["disable"]
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
                isinstance(n, str) for n in names
            ):
                raise OptionError(f"option 'disable' must be a list of pass names, got {names!r}")
            options["disable"] = tuple(names)
        opts = cls(**options)
        opts._validate()
        return opts

    def _validate(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("inner", self.inner, INNER_COMPILERS)
        if self.cudagraphs is not None:
            _choice("cudagraphs", self.cudagraphs, CUDAGRAPH_MODES)
        if isinstance(self.max_aux_lanes, bool) or not isinstance(self.max_aux_lanes, int):
            raise OptionError(
                f"option 'max_aux_lanes' must be a non-negative int, got {self.max_aux_lanes!r}"
            )
        if self.max_aux_lanes < 0:
            raise OptionError(
                f"option 'max_aux_lanes' must be a non-negative int, got {self.max_aux_lanes!r}"
            )
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise OptionError(f"option 'dump_dir' must be a path or None, got {self.dump_dir!r}")
        if self.dump_dir is not None and os.fspath(self.dump_dir) in ("", b""):
            raise OptionError(
                "option 'dump_dir' is an empty path; give a directory, or None (the default) for no dumps"
            )
        if isinstance(self.max_captures, bool) or not isinstance(self.max_captures, int) or self.max_captures < 1:
            raise OptionError(f"option 'max_captures' must be a positive int, got {self.max_captures!r}")
        if not isinstance(self.static_outputs, bool):
            raise OptionError(f"option 'static_outputs' must be True or False, got {self.static_outputs!r}")
        if not isinstance(self.check_replay, bool):
            raise OptionError(f"option 'check_replay' must be True or False, got {self.check_replay!r}")
        if not isinstance(self.verify, bool):
            raise OptionError(f"option 'verify' must be True or False, got {self.verify!r}")

    def resolved_cudagraphs(self, on_cuda: bool) -> CaptureMode:
        """The capture mode for a graph whose tensors live on CUDA (or not)."""
        if self.cudagraphs is not None:
            return CaptureMode(self.cudagraphs)
        return CaptureMode.MONOLITHIC if on_cuda else CaptureMode.NONE

    def for_graph(self, kind: str, on_cuda: bool) -> "Options":
        """The options of one graph: the capture mode resolved for its device; the backward
        graph (``kind="backward"``) on one lane, uncaptured, with no capture sizes."""
        if kind == "backward":
            return dataclasses.replace(self, policy="off", cudagraphs=CaptureMode.NONE, capture_sizes=())
        return dataclasses.replace(self, cudagraphs=self.resolved_cudagraphs(on_cuda))

    def key(self) -> str:
        """A stable digest of the options that change generated code."""
        fields = dataclasses.asdict(self)
        fields.pop("dump_dir")
        fields.pop("verify")
        fields.pop("check_replay")  # a runtime check: the generated code is the same
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def _external_streams(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise OptionError(
            f"option 'external_streams' must map stream names to one of {', '.join(map(repr, RELATIONS))}, "
            f"got {value!r}"
        ) from None
    for name, relation in pairs:
        if not isinstance(name, str) or not name.isidentifier():
            raise OptionError(f"option 'external_streams': stream name {name!r} must be an identifier")
        if relation not in RELATIONS:
            raise OptionError(
                f"option 'external_streams': stream {name!r} has relation {relation!r}; "
                f"valid relations are {', '.join(map(repr, RELATIONS))}"
            )
    if len({n for n, _ in pairs}) != len(pairs):
        raise OptionError(f"option 'external_streams' names a stream twice: {value!r}")
    return tuple(sorted(pairs))


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionError(
            f"option {name!r} must be one of {', '.join(map(repr, choices))}; got {value!r}"
        )
