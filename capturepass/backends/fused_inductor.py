"""Lanes after fusion inside Inductor: the hooks that give one compile's code its lanes.

:class:`Compiling` holds, for the compiles inside it, Inductor's post-fusion scheduler hook
(``config._post_fusion_custom_pass``: each fused node's FX origins give it a lane) and the step
that writes the generated module (``GraphLowering._compile_to_module_lines``: its ``call`` is
rewritten by :func:`capturepass.backends.fused_lanes.rewrite_module` and checked by
:func:`~capturepass.backends.fused_lanes.check`). :func:`unavailable` says where this torch has
neither; the code rewriting itself is in ``fused_lanes`` and reads no Inductor object.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from capturepass.backends import fused_lanes
from capturepass.backends.fused_lanes import HOST, RewriteError, Summary, check, lanes_call, rewrite_module


def unavailable() -> str | None:
    """Why this torch's Inductor cannot be given lanes after fusion (``None``: it can): the
    scheduler's post-fusion hook and the step that writes the generated module must exist."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.graph import GraphLowering
    except ImportError:
        return "this torch has no Inductor"
    if not hasattr(inductor_config, "_post_fusion_custom_pass"):
        return "this torch's Inductor has no post-fusion scheduler hook (config._post_fusion_custom_pass)"
    if not callable(getattr(GraphLowering, "_compile_to_module_lines", None)):
        return "this torch's Inductor writes its modules otherwise (no GraphLowering._compile_to_module_lines)"
    return None


@functools.cache
def rewrite_version() -> str:
    """Part of the FX graph cache key of a compile with lanes after fusion: the sources of the
    rewrite and of these hooks, hashed, so that a change to what is written never loads a module
    an earlier rule wrote."""
    digest = hashlib.sha256()
    for path in (fused_lanes.__file__, __file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _scheduler_pass_base() -> type | None:
    """Inductor's base class of a scheduler pass whose ``uuid()`` enters the FX graph cache key
    (``torch._inductor.custom_graph_pass.CustomSchedulerPass``), where this torch has one."""
    try:
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
    except ImportError:
        return None
    return CustomSchedulerPass


def _lanes_pass(key: str, run: Callable[[list[Any]], list[Any]] | None = None) -> Any:
    """Inductor's post-fusion scheduler pass that reads the lanes (``run``), keyed by ``key`` in
    the FX graph cache. Inductor pickles and deep-copies its config: the pass pickles as its key
    (unpickled it reads nothing) and copies as itself."""
    base = _scheduler_pass_base()
    assert base is not None

    class LanesAfterFusion(base):  # type: ignore[misc, valid-type]
        def __call__(self, nodes: list[Any]) -> list[Any]:
            return run(nodes) if run is not None else nodes

        def uuid(self) -> str:
            return key

        def __deepcopy__(self, memo: dict) -> Any:
            return self

        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return _lanes_pass, (key,)

    return LanesAfterFusion()


class Compiling:
    """While active, every Inductor compile of a CUDA graph has its ``call`` rewritten with
    lanes after fusion (:func:`rewrite_module`): each fused kernel takes the lane ``lane_by_name``
    gives its FX origins when they agree on one, else the main lane. ``summaries`` collects what
    each rewrite wrote (a module Inductor loads from its cache states its own); a rewrite that
    :func:`check` finds fault with is not used (the code stays one lane's), and ``findings``
    says why. With ``host``, a host compile's code is rewritten too (its lanes' body runs in
    program order: :data:`HOST`).

    The post-fusion hook is a scheduler pass whose ``uuid()`` covers the lanes and the rewrite's
    rules, so Inductor's FX graph cache stays on (a hit loads the rewritten module, checked when
    it was written); where this torch has no such pass, the cache is off inside (its key would
    not cover the lanes, and a hit skips the scheduler the lanes are read from).
    """

    def __init__(self, lane_by_name: Mapping[str, int], host: bool = False) -> None:
        self.lane_by_name = dict(lane_by_name)
        self.host = host
        self.summaries: list[Summary] = []
        self.codes: list[str] = []  # each rewritten module's lanes' body, as a function ``call``
        self.findings: list[str] = []
        self._buffers: dict[str, int] = {}
        self._writing = False

    def key(self) -> str:
        """What the FX graph cache key takes of this compile's lanes."""
        text = json.dumps([rewrite_version(), self.host, sorted(self.lane_by_name.items())])
        return hashlib.sha256(text.encode()).hexdigest()

    def after_fusion(self, nodes: list[Any]) -> list[Any]:
        if self._user is not None:
            nodes = self._user(nodes)
        for node in nodes:
            lane = self._library_call_lane(node)
            if lane is None:
                origins: set[Any] = set()
                for inner in node.get_nodes():
                    origins |= set(getattr(getattr(inner, "node", None), "origins", ()) or ())
                lane = self._agreed(getattr(o, "name", None) for o in origins)
            for name in node.get_buffer_names():
                self._buffers[name] = lane if lane is not None else 0
        return nodes

    def _library_call_lane(self, node: Any) -> int | None:
        """The lane of the op a library call (an extern kernel: a matrix product, a fallback op)
        computes, where its IR node names that op (``origin_node``) and the plan gave it one.

        Such a call computes its own op and nothing else: its inputs are buffers other kernels
        realized, but Inductor lists their producers among its origins too (a shared expert's up
        projection on a side lane lists the main lane's RMS norm that feeds it), and a vote of
        all of them would put the call on the main lane."""
        from torch._inductor import ir

        inner = node.get_nodes()
        if len(inner) != 1 or not isinstance(getattr(inner[0], "node", None), ir.ExternKernel):
            return None
        origin = getattr(inner[0].node, "origin_node", None)
        return self.lane_by_name.get(getattr(origin, "name", None))

    def lane_of(self, writes: list[str], sources: list[str]) -> int | None:
        for w in writes:
            if w in self._buffers:
                return self._buffers[w]
        return self._agreed(sources)

    def _agreed(self, names: Iterable[Any]) -> int | None:
        """The lane every one of ``names`` with a lane has, or ``None`` (none, or several)."""
        lanes = {self.lane_by_name[n] for n in names if n in self.lane_by_name}
        return lanes.pop() if len(lanes) == 1 else None

    def _hook(self) -> Any:
        me = self
        base = _scheduler_pass_base() if self._user is None else None
        if base is None:
            def after_fusion(nodes: list[Any]) -> list[Any]:
                # A function, not a bound method: Inductor deep-copies its config for a repro at
                # every compile (torch 2.13), and a function is copied as itself.
                return me.after_fusion(nodes)

            return after_fusion

        return _lanes_pass(me.key(), me.after_fusion)

    def __enter__(self) -> "Compiling":
        from torch._inductor import config as inductor_config
        from torch._inductor.graph import GraphLowering

        self._user = inductor_config._post_fusion_custom_pass
        self._real = GraphLowering._compile_to_module_lines
        self._saved = GraphLowering.save_output_code
        real, me, saved = self._real, self, self._saved

        def write_module(lowering: Any, wrapper_code: Any) -> Any:
            devices = getattr(lowering, "device_types", ())
            if ("cuda" in devices or (me.host and "cpu" in devices)) and "def call(" in wrapper_code.value:
                index = next(iter(getattr(lowering, "device_idxs", ()) or ()), 0) if "cuda" in devices else HOST
                try:
                    new, done = rewrite_module(wrapper_code.value, me.lane_of, device=index)
                    found = check(done.source, wrapper_code.value) if done.lanes else []
                except Exception as exc:  # noqa: BLE001 - code the rewrite cannot read runs as written
                    found = [f"the rewrite could not read the code ({type(exc).__name__}: {exc})"]
                    done = None
                if found:
                    # Left as one lane's code, with what the check found (the compile logs it).
                    me.findings.extend(found)
                else:
                    if done.lanes:  # a module with nothing on a side lane stays as Inductor wrote it
                        wrapper_code.value = new
                        me.codes.append(lanes_call(new))
                        if hasattr(wrapper_code, "line_map"):
                            wrapper_code.line_map = []  # its line numbers are the original's
                    me.summaries.append(done.summary())
            me._buffers = {}
            me._writing = True
            try:
                return real(lowering, wrapper_code)
            finally:
                me._writing = False

        def save_output_code(code: str) -> None:
            # Inductor calls this for a module it loads from its cache too: its summary is in it.
            if not me._writing and (got := Summary.of_module(code)) is not None:
                me.summaries.append(got)
                try:
                    me.codes.append(lanes_call(code))
                except RewriteError:  # a summary without its body: counted, not shown
                    pass
            if saved is not None:
                saved(code)

        hook = self._hook()
        patches: dict[str, Any] = {"_post_fusion_custom_pass": hook}
        if not isinstance(hook, _scheduler_pass_base() or ()):
            patches["fx_graph_cache"] = False
        self._patch = inductor_config.patch(**patches)
        self._patch.__enter__()
        GraphLowering._compile_to_module_lines = write_module
        GraphLowering.save_output_code = save_output_code
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._inductor.graph import GraphLowering

        GraphLowering._compile_to_module_lines = self._real
        GraphLowering.save_output_code = self._saved
        self._patch.__exit__(*exc)
