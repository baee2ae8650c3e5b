"""The options of the capturepass backend, validated once at compile time.

``torch.compile(model, backend="capturepass", options={...})`` passes a plain
mapping; :meth:`Options.from_mapping` turns it into a frozen record and raises
:class:`~capturepass.errors.OptionError` naming the offending key and the valid
choices (and, for a misspelled name, the closest valid one). Values that can be
checked before anything is compiled are checked here: a ``dump_dir`` that is a file,
or below one, or in a directory this process cannot write, is refused at once, naming
the option or the environment variable it came from (``CAPTUREPASS_DUMP_DIR``,
``CAPTUREPASS_OPTIONS``), rather than failing after the whole compile. The record is
part of every pass's cache key (``Options.key()``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
from collections.abc import Mapping
from typing import Any

from capturepass.errors import OptionError
from capturepass.ir.meta import CaptureMode

POLICIES = ("auto", "hints", "off")
INNER_COMPILERS = ("inductor", "eager", "tensorrt")
REGION_MODES = ("auto", "lanes", "segments", "fused")
# How the schedule of a captured graph is chosen (option ``pick``).
PICKS = ("measure", "model")
CUDAGRAPH_MODES = tuple(mode.value for mode in CaptureMode)
# How a graph relates to an external stream (option ``external_streams``).
RELATIONS = ("before", "after", "both")

DUMP_DIR_ENV = "CAPTUREPASS_DUMP_DIR"
VERIFY_ENV = "CAPTUREPASS_VERIFY"
OPTIONS_ENV = "CAPTUREPASS_OPTIONS"  # a JSON object of options, under those given in code
CACHE_DIR_ENV = "CAPTUREPASS_CACHE_DIR"  # where measured schedule choices are kept
PICK_LOCK_ENV = "CAPTUREPASS_PICK_LOCK"  # a file whose lock processes sharing a GPU time their candidates under


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
        static_outputs: return replayed outputs as they are, in the graph's pool:
            each is overwritten by the model's next call (at any shape: a model's
            shapes share one pool), and nothing is ever copied (for callers that
            consume outputs before the next call). By default outputs are returned
            over aliases of the pool too, and the next replay of the model (or the
            graph's release) first copies out those the caller still holds: an
            output is never overwritten under the caller, and only held ones cost
            a copy. Where torch cannot move a held output's memory (no
            ``UntypedStorage._swap_data_ptr_``, torch 2.11) the tensors over it are
            moved to the copy instead; a capture whose caller keeps views it derived
            copies its outputs out from then on (logged).
        external_streams: streams capturepass does not own, by name, with their
            relation to the graph: ``"before"`` (the graph reads what the stream
            produced), ``"after"`` (the stream reads what the graph produced) or
            ``"both"``; joined at every segment boundary. The engine binds each
            name to its stream with ``capturepass.external_stream(name, stream)``.
        check_replay: before every replay, check that the input buffers and
            the storage of every retained object are those the capture baked in
            (a debug aid; raises ``ResourceError`` naming what moved).
        regions: ``"auto"``: on a host graph (no CUDA tensor, lanes run in program
            order) each segment is one region, compiled once; on CUDA, ``"fused"`` where this
            torch allows, else ``"segments"``'s inline route (logged). ``"fused"``: lanes after
            fusion: one lane's plan compiled once by Inductor, each fused kernel put on the
            lane the cost model gave its nodes by a rewrite of the generated code
            (``capturepass.backends.fused_lanes``), so every schedule candidate is that one
            compile and keeps one lane's fusion (on the host too, where the lanes' body runs
            in program order: to read and run the code a GPU would). ``"segments"``: each capture segment compiled
            once with its lanes inline (``capturepass.backends.inline``; on the host too), a
            segment that cannot be keeping one region per lane between sync points, with the
            reason logged. ``"lanes"``: the per-lane regions everywhere (the region route; on
            the CPU, to inspect the outer program a GPU runs it by).
        disable: names of passes to leave out, for bisecting a compile; a pass
            that a later one depends on cannot be left out (``PipelineError``).
        pick: ``"measure"`` (the default): when a CUDA graph is captured for a new
            shape, the cost model's schedule and the cheaper ones derived from it (one
            lane, fewer lanes, short lanes merged back) are each captured and replayed,
            and the fastest is kept, or one lane within 2% of it (the choice is
            cached per device, graph and shape).
            Uncaptured calls on CUDA (``cudagraphs="none"``, shapes past ``max_captures``)
            choose per shape between the cost model's lanes and one stream by timing their own
            first calls (``runtime.uncaptured``: without a graph every lane switch and event is
            a host call, which a host-paced call pays in full).
            ``"model"``: the cost model's schedule, unmeasured (reproducible schedules).
            Graphs captured breakable and graphs that post collectives (each rank would measure
            on its own clock) run the cost model's schedule, captured or not.
        pick_budget_ms: the replay time measuring the candidates of one shape may take
            (milliseconds of timed replays; at least one round is timed).
        pick_predict: with ``pick="measure"``, a graph whose lanes the device's lane factor
            (``runtime.calibration``: its measured lanes against one lane, over the cost
            model's estimate) predicts no faster than one lane is compiled with one lane alone,
            unmeasured (one Inductor compile instead of two), and the pass route leaves such
            lanes out. Off by default: the factor is one number per device, and graphs the cost
            model rates alike differ (on the H200 an attention block with an indexer, which its
            lanes speed up, is estimated as a Llama decoder whose lanes slow it down), so it can
            give up a gain the measurement would keep. ``False``: every captured graph's
            candidates are compiled and measured (a choice cached for its shape still applies).
        pick_cache_dir: where measured choices are kept; ``None``: ``CAPTUREPASS_CACHE_DIR``,
            else ``capturepass/schedules`` under torch's cache directory.
        merge_lanes_below_us: lanes whose estimated busy time is below this many
            microseconds are put back on the main lane (0: none; the schedule
            candidate "short lanes merged" sets it).

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
    regions: str = "auto"
    disable: tuple[str, ...] = ()
    pick: str = "measure"
    pick_budget_ms: float = 200.0
    pick_predict: bool = False
    pick_cache_dir: str | None = None
    merge_lanes_below_us: float = 0.0

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "Options":
        """Builds options from a user mapping, filling defaults from the environment
        (``CAPTUREPASS_OPTIONS``, then ``CAPTUREPASS_DUMP_DIR`` and ``CAPTUREPASS_VERIFY``).

        Raises:
            OptionError: an unknown key, or a value of the wrong type or range.
        """
        code = dict(options or {})
        options = {**env_options(), **code}
        # Where each value came from, for messages: the code (None) or an environment variable.
        sources: dict[str, str | None] = {k: None if k in code else OPTIONS_ENV for k in options}
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            parts = []
            for key in unknown:
                where = f" (in {OPTIONS_ENV})" if sources.get(key) == OPTIONS_ENV else ""
                parts.append(f"{key!r}{where}{_did_you_mean(key, valid)}")
            raise OptionError(
                f"unknown capturepass option(s) {', '.join(parts)}; valid options are: {', '.join(valid)}"
            )
        # An empty CAPTUREPASS_DUMP_DIR is unset (the shell convention); an empty option is an error.
        if "dump_dir" not in options and os.environ.get(DUMP_DIR_ENV):
            options["dump_dir"] = os.environ[DUMP_DIR_ENV]
            sources["dump_dir"] = DUMP_DIR_ENV
        if "verify" not in options and os.environ.get(VERIFY_ENV):
            options["verify"] = os.environ[VERIFY_ENV] not in ("", "0", "false", "False")
        if "capture_sizes" in options:
            sizes = options["capture_sizes"]
            if not isinstance(sizes, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes
            ):
                raise OptionError(f"{_label('capture_sizes', sources)} must be a list of positive ints, got {sizes!r}")
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
        opts._validate(sources)
        return opts

    def _validate(self, sources: Mapping[str, str | None] | None = None) -> None:
        sources = sources or {}

        def name(key: str) -> str:
            return _label(key, sources)

        _choice("policy", self.policy, POLICIES, name("policy"))
        _choice("inner", self.inner, INNER_COMPILERS, name("inner"))
        _choice("regions", self.regions, REGION_MODES, name("regions"))
        _choice("pick", self.pick, PICKS, name("pick"))
        for key in ("pick_budget_ms", "merge_lanes_below_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise OptionError(f"{name(key)} must be a finite non-negative number, got {value!r}")
        if self.pick_cache_dir is not None and (
            not isinstance(self.pick_cache_dir, (str, os.PathLike)) or os.fspath(self.pick_cache_dir) in ("", b"")
        ):
            raise OptionError(f"{name('pick_cache_dir')} must be a directory path or None, got {self.pick_cache_dir!r}")
        if self.cudagraphs is not None:
            _choice("cudagraphs", self.cudagraphs, CUDAGRAPH_MODES, name("cudagraphs"))
        if isinstance(self.max_aux_lanes, bool) or not isinstance(self.max_aux_lanes, int) or self.max_aux_lanes < 0:
            raise OptionError(f"{name('max_aux_lanes')} must be a non-negative int, got {self.max_aux_lanes!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise OptionError(f"{name('dump_dir')} must be a path or None, got {self.dump_dir!r}")
        if self.dump_dir is not None and os.fspath(self.dump_dir) in ("", b""):
            raise OptionError(
                f"{name('dump_dir')} is an empty path; give a directory, or None (the default) for no dumps"
            )
        if self.dump_dir is not None:
            _check_dump_dir(os.fspath(self.dump_dir), name("dump_dir"))
        if isinstance(self.max_captures, bool) or not isinstance(self.max_captures, int) or self.max_captures < 1:
            raise OptionError(f"{name('max_captures')} must be a positive int, got {self.max_captures!r}")
        for key in ("static_outputs", "check_replay", "verify", "pick_predict"):
            if not isinstance(getattr(self, key), bool):
                raise OptionError(f"{name(key)} must be True or False, got {getattr(self, key)!r}")

    def resolved_cudagraphs(self, on_cuda: bool) -> CaptureMode:
        """The capture mode for a graph whose tensors live on CUDA (or not)."""
        if self.cudagraphs is not None:
            return CaptureMode(self.cudagraphs)
        return CaptureMode.MONOLITHIC if on_cuda else CaptureMode.NONE

    def for_graph(self, kind: str, on_cuda: bool) -> "Options":
        """The options of one graph: the capture mode resolved for its device; the backward
        graph (``kind="backward"``) on one lane, uncaptured, with no capture sizes (and so
        nothing to measure)."""
        if kind == "backward":
            return dataclasses.replace(
                self, policy="off", cudagraphs=CaptureMode.NONE, capture_sizes=(), pick="model"
            )
        return dataclasses.replace(self, cudagraphs=self.resolved_cudagraphs(on_cuda))

    def key(self) -> str:
        """A stable digest of the options that change generated code."""
        fields = dataclasses.asdict(self)
        fields.pop("dump_dir")
        fields.pop("verify")
        fields.pop("check_replay")  # a runtime check: the generated code is the same
        # Which schedule runs, not how one compiles.
        for key in ("pick", "pick_budget_ms", "pick_predict", "pick_cache_dir"):
            fields.pop(key)
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


def _label(key: str, sources: Mapping[str, str | None]) -> str:
    """How a message names option ``key``: by the environment variable it came from, if it did."""
    source = sources.get(key)
    if source == DUMP_DIR_ENV:
        return f"{DUMP_DIR_ENV} (the option 'dump_dir')"
    if source is not None:
        return f"option {key!r} (from {source})"
    return f"option {key!r}"


def _did_you_mean(word: Any, choices: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a misspelled ``word``, or ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:  # a different case or a prefix ("Hints", "break") is close too
        lowered = {str(c).lower(): str(c) for c in choices}
        hit = lowered.get(word.lower()) or next((c for lo, c in lowered.items() if lo.startswith(word.lower())), None)
        close = [hit] if hit and word else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_dump_dir(path: str, label: str) -> None:
    """Refuses a dump directory that cannot be made or written, before anything is compiled.

    The dumps are written after each graph's passes: a path that is a file, lies below a
    file, or lies in a directory this process may not write would otherwise fail only then,
    with an ``OSError`` that names no option.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise OptionError(f"{label} is {path!r}, which is a file, not a directory; give a directory for the dumps")
    # The nearest part of the path that exists must be a directory this process can write into.
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise OptionError(
            f"{label} is {path!r}, below {probe!r}, which is a file; give a directory for the dumps"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "a directory" if probe == os.path.abspath(path) else f"to be made in {probe!r}, a directory"
        raise OptionError(f"{label} is {path!r}, {where} this process cannot write; give one it can write")


def _choice(name: str, value: Any, choices: tuple[str, ...], label: str | None = None) -> None:
    if value not in choices:
        raise OptionError(
            f"{label or f'option {name!r}'} must be one of {', '.join(map(repr, choices))}; "
            f"got {value!r}{_did_you_mean(value, choices)}"
        )
