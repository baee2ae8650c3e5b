"""The capability registry: what an op may do inside a capture and beside other lanes.

Op authors declare, at registration time, whether an op is capturable and how
it may overlap with work on other lanes::

    capturepass.register_capability("mylib::persistent_gemm", overlap="serialize")

    @capturepass.capability(overlap=plan_for_shape)   # next to torch.library.custom_op
    @torch.library.custom_op("mylib::routed_moe", mutates_args=())
    def routed_moe(x: torch.Tensor, ...) -> torch.Tensor: ...

``overlap`` is one of three levels, or a callable that receives a
:class:`CallInfo` for the concrete call (shapes, dtypes, the device's SM count)
and returns a :class:`~capturepass.ir.meta.Capability` or a mapping of its
fields. A callable is queried once per distinct call (every argument it can see,
by position) and cached.
The levels:

- ``"safe"``: the op may run beside work on other lanes;
- ``"join"``: other lanes' independent work is enqueued before the op (a
  resident-grid launch then cannot block its submission) and every lane is
  joined before the op starts; once it has started, other lanes may run again;
- ``"serialize"``: nothing runs beside the op, before or after its start.

An op may also declare ``monolithic=True``: it needs the whole forward in one
CUDA graph (it communicates across what would be segments). A breakable
partition is then refused with an error naming the op and the break, and a
graph asked to be ``breakable`` without any break is captured monolithic.
An op that communicates with other ranks declares ``collective=True``: it gets
a lane kind of its own (the comm lane) and starts as early as its inputs allow.

Ops nobody declared get defaults: ops tagged ``cudagraph_unsafe``, host
synchronisations (ops whose output size or value depends on data: ``.item()``,
``.tolist()``, ``nonzero``, any op that binds a data-dependent size) and copies
between host and device memory are not capturable; aten and prims ops are
overlap-safe; the functional collectives (namespace ``_c10d_functional``) have one
declaration for the whole namespace (``ir.collectives.capability``: collective,
free to overlap, one communicator resource per traced group); any other custom
op is serialized (the conservative answer), with one log line naming it.

A functionalization or effect wrapper (``auto_functionalized``,
``auto_functionalized_v2``, ``with_effects``: a custom op that mutates its
arguments reaches the graph so) answers for the op it wraps; a higher-order op
with subgraphs answers for the ops of its subgraphs, and is not capturable when
its control flow reads a tensor on the host (``cond``, ``while_loop``).

Some ops cannot be told apart before they run: an opaque custom op that calls
``.tolist()`` inside. When a capture fails on one, the runtime finds it and the
registry *learns* that it cannot be captured (:meth:`CapabilityRegistry.learn`):
from then on every graph compiled in the process treats it as a break, and
no other owner has to fail on it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import operator
import threading
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch
import torch.fx as fx

from capturepass.errors import CapabilityError, is_dynamo_signal
from capturepass.ir import collectives, hops
from capturepass.ir.meta import Capability, Overlap

log = logging.getLogger("capturepass")

OVERLAP_CHOICES = tuple(level.value for level in Overlap)

_SAFE_NAMESPACES = ("aten", "prims", "capturepass")
# Ops that return a Python scalar read from tensor metadata, not from device memory.
_METADATA_OPS = frozenset(
    f"aten::{n}" for n in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim")
)


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """The concrete call a launch-plan callable is asked about.

    Attributes:
        op: qualified op name (``"ns::name"``).
        shapes: the shape of each tensor argument, in argument order (ints at
            their shape hints when dynamic).
        dtypes: the dtype of each tensor argument.
        device: the device of the first tensor argument.
        sm_count: the device's multiprocessor count, or ``None`` off CUDA.
        args: every argument of the op's schema, in schema order (given
            positionally or by keyword, or the schema's default), with tensors
            as fake tensors.
        dynamic: some size is symbolic; ``shapes`` then holds the sizes the
            graph was traced with, and an answer of ``"safe"`` is only trusted
            for them, so capturepass serializes such a call.
        arg_names: the schema's name of each entry of ``args``.
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    device: torch.device | None
    sm_count: int | None
    args: tuple = ()
    dynamic: bool = False
    arg_names: tuple[str, ...] = ()

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument the schema calls ``name`` (``default`` if the op has none of that name)."""
        for n, v in zip(self.arg_names, self.args):
            if n == name:
                return v
        return default

    def key(self) -> tuple:
        """What the answer may depend on: calls of equal keys share one answer.

        Everything a plan can see is in it: the op, the device and its SM count, and each
        argument by position (a tensor by shape, stride, dtype, device and layout; any
        other value by value where it is hashable, else by its ``repr``).
        """
        return (self.op, self.shapes, self.dtypes, str(self.device), self.sm_count, self.dynamic,
                self.arg_names, tuple(_value_key(a) for a in self.args))


def _dim_key(d: Any) -> Any:
    if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(d.node.expr), _hint(d) if isinstance(d, torch.SymInt) else None)
    return int(d)


def _value_key(v: Any) -> Any:
    """A hashable stand-in for one argument, equal exactly when a plan could not tell them apart."""
    if isinstance(v, torch.Tensor):
        try:
            strided = v.layout == torch.strided
            return ("tensor", tuple(_dim_key(d) for d in v.shape),
                    tuple(_dim_key(d) for d in v.stride()) if strided else None,
                    v.dtype, str(v.device), str(v.layout), _dim_key(v.storage_offset()) if strided else None)
        except Exception:  # a tensor subclass without strides or sizes: its description
            return (type(v).__qualname__, "repr", _safe_repr(v))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _dim_key(v)
    if v is None or isinstance(v, (bool, int, str, bytes)):
        return (type(v).__name__, v)  # the type too: 1, 1.0 and True compare equal
    if isinstance(v, (float, complex)):
        return (type(v).__name__, repr(v))  # repr: -0.0 and 0.0 apart, NaN equal to NaN
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(v).__name__, str(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, Mapping):
        return ("mapping", tuple(sorted(((_safe_repr(k), _value_key(x)) for k, x in v.items()), key=repr)))
    try:
        hash(v)
        return (type(v).__qualname__, "value", v)
    except Exception:
        return (type(v).__qualname__, "repr", _safe_repr(v))


def _safe_repr(v: Any) -> str:
    try:
        return repr(v)
    except Exception:
        return f"<{type(v).__qualname__} at {id(v):#x}>"


OverlapSpec = Union[str, Callable[[CallInfo], Union[Capability, Mapping[str, Any]]]]


@dataclasses.dataclass(frozen=True)
class _Declaration:
    capturable: bool
    overlap: OverlapSpec
    resources: tuple[str, ...]
    monolithic: bool = False
    collective: bool = False

    def digest(self) -> str:
        if callable(self.overlap):
            try:
                body = inspect.getsource(self.overlap)
            except (OSError, TypeError):
                body = getattr(self.overlap, "__qualname__", repr(type(self.overlap)))
        else:
            body = self.overlap
        return f"{self.capturable}|{body}|{self.resources}|{self.monolithic}|{self.collective}"


def op_qualname(op: Any) -> str:
    """The ``"ns::name"`` of an op given as a string, overload, packet or custom-op object."""
    if isinstance(op, str):
        if "::" not in op:
            raise CapabilityError(f"op name {op!r} must be qualified as 'namespace::name'")
        return op.split(".", 1)[0] if "." in op.split("::", 1)[1] else op
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    qualname = getattr(op, "_qualname", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(qualname, str):
        return qualname
    raise CapabilityError(
        f"cannot declare a capability for {op!r}: pass an op name 'ns::name', "
        "a torch.ops overload or packet, or a torch.library.custom_op"
    )


class CapabilityRegistry:
    """Op capabilities: declarations, defaults, and a per-signature cache."""

    def __init__(self) -> None:
        self._decls: dict[str, _Declaration] = {}
        # Declarations for every op of a namespace that declares none of its own.
        self._namespaces: dict[str, Callable[[fx.Node, str], Capability]] = {
            ns: collectives.capability for ns in collectives.NAMESPACES
        }
        self._learned: dict[str, str] = {}  # op -> why it failed under capture
        self._cache: dict[tuple, Capability] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def register(
        self,
        op: Any,
        *,
        capturable: bool = True,
        overlap: OverlapSpec = Overlap.SAFE,
        resources: tuple[str, ...] = (),
        monolithic: bool = False,
        collective: bool = False,
    ) -> None:
        """Declares the capability of ``op`` (replacing an earlier declaration)."""
        name = op_qualname(op)
        if not isinstance(capturable, bool):
            raise CapabilityError(f"capability of {name}: capturable must be a bool, got {capturable!r}")
        if not isinstance(monolithic, bool):
            raise CapabilityError(f"capability of {name}: monolithic must be a bool, got {monolithic!r}")
        if not isinstance(collective, bool):
            raise CapabilityError(f"capability of {name}: collective must be a bool, got {collective!r}")
        if monolithic and not capturable:
            raise CapabilityError(f"capability of {name}: an op that is not capturable cannot require a monolithic graph")
        if not callable(overlap) and overlap not in OVERLAP_CHOICES:
            raise CapabilityError(
                f"capability of {name}: overlap must be one of {', '.join(map(repr, OVERLAP_CHOICES))} "
                f"or a callable taking a CallInfo; got {overlap!r}"
            )
        with self._lock:
            level = overlap if callable(overlap) else Overlap(overlap)
            self._decls[name] = _Declaration(capturable, level, tuple(resources), monolithic, collective)
            self._cache = {k: v for k, v in self._cache.items() if k[0] != name}

    def declared(self, op: Any) -> bool:
        """Whether ``op`` has a declaration of its own."""
        name = op_qualname(op)
        with self._lock:
            return name in self._decls

    def unregister(self, op: Any) -> None:
        """Forgets the declaration of ``op``."""
        name = op_qualname(op)
        with self._lock:
            self._decls.pop(name, None)
            self._cache = {k: v for k, v in self._cache.items() if k[0] != name}

    def learn(self, op: Any, reason: str) -> bool:
        """Records that ``op`` failed under a real capture; returns whether it was news.

        Every later query of the op answers "not capturable" with ``reason``
        (source ``"capture"``), whatever was declared: the op has shown that it
        synchronizes with the host or otherwise breaks a capture.
        """
        name = op_qualname(op)
        with self._lock:
            new = name not in self._learned
            self._learned[name] = reason
            self._cache = {k: v for k, v in self._cache.items() if k[0] != name}
        return new

    def learned(self) -> dict[str, str]:
        """Ops learned not capturable (op name -> reason)."""
        with self._lock:
            return dict(self._learned)

    def forget_learned(self, op: Any | None = None) -> None:
        """Forgets what was learned about ``op`` (or about every op)."""
        with self._lock:
            if op is None:
                self._learned.clear()
            else:
                self._learned.pop(op_qualname(op), None)

    def key(self) -> str:
        """A digest of every declaration and learned fact, for cache keys: it changes when any
        capability does."""
        digest = hashlib.sha256()
        for name in sorted(self._decls):
            digest.update(f"{name}={self._decls[name].digest()};".encode())
        for name in sorted(self._learned):
            digest.update(f"{name}!capture;".encode())
        return digest.hexdigest()[:16]

    def query(self, node: fx.Node, graph_device: torch.device | None = None) -> Capability:
        """The capability of the op ``node`` calls, for this node's concrete arguments.

        A functionalization or effect wrapper (``auto_functionalized``,
        ``auto_functionalized_v2``, ``with_effects``) answers for the op it wraps,
        called with the arguments it passes on; a higher-order op with subgraphs
        (``cond``, ``while_loop``, ``invoke_subgraph``) answers for everything in them.
        """
        target = node.target
        if node.op != "call_function":
            return Capability(reason=f"{node.op} node")
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(node, graph_device)
        if target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
            return Capability(reason="no kernel")
        return self._op(node, target, node.args, node.kwargs, graph_device)

    def _op(
        self, node: fx.Node, target: torch._ops.OpOverload, args: tuple, kwargs: Mapping[str, Any],
        graph_device: torch.device | None,
    ) -> Capability:
        name = target._schema.name
        decl = self._decls.get(name)
        if decl is not None:
            cap = self._declared(node, name, decl, target, args, kwargs)
        else:
            cap = self._default(node, name, target, graph_device)
        learned = self._learned.get(name)
        if learned is not None and cap.capturable:
            cap = dataclasses.replace(cap, capturable=False, reason=learned, source="capture")
        return cap

    def _higher_order(self, node: fx.Node, graph_device: torch.device | None) -> Capability:
        wrapped = hops.wrapped_call(node)
        if wrapped is not None:
            return self._op(node, *wrapped, graph_device)
        name = hops.hop_name(node)
        modules = hops.subgraphs(node)
        if not modules:
            return Capability(reason="no kernel")
        inner = [
            (n, self.query(n, graph_device))
            for gm in modules for n in gm.graph.nodes if n.op == "call_function"
        ]
        cap = _combine(name, inner)
        sync = _host_sync(node, name, modules)
        if sync is not None and cap.capturable:
            cap = dataclasses.replace(cap, capturable=False, reason=sync)
        return cap

    def _declared(
        self, node: fx.Node, name: str, decl: _Declaration, target: torch._ops.OpOverload,
        args: tuple, kwargs: Mapping[str, Any],
    ) -> Capability:
        if not callable(decl.overlap):
            return Capability(
                capturable=decl.capturable,
                overlap=decl.overlap,
                reason=f"declared overlap={decl.overlap}" + ("" if decl.capturable else ", not capturable")
                + (", monolithic" if decl.monolithic else ""),
                resources=decl.resources,
                source="registry",
                monolithic=decl.monolithic,
                collective=decl.collective,
            )
        call = _call_info(name, target, args, kwargs)
        cache_key = call.key()
        with self._lock:
            hit = self._cache.get(cache_key)
        if hit is not None:
            return hit
        try:
            answer = decl.overlap(call)
        except Exception as exc:  # a user callable: name it, never guess
            if is_dynamo_signal(exc):
                raise
            raise CapabilityError(
                f"the launch-plan callable declared for {name} raised {type(exc).__name__}: {exc} "
                f"(node %{node.name}, shapes {call.shapes})"
            ) from exc
        cap = _to_capability(answer, name, decl)
        if call.dynamic and cap.overlap != Overlap.SERIALIZE:
            cap = dataclasses.replace(
                cap,
                overlap=Overlap.SERIALIZE,
                reason=f"{cap.reason}; serialized: the launch plan was asked at the traced sizes {call.shapes}, "
                "but the shape is dynamic (compile with static shapes, or declare the overlap directly)",
            )
        with self._lock:
            self._cache[cache_key] = cap
        return cap

    def _default(
        self, node: fx.Node, name: str, target: torch._ops.OpOverload, graph_device: torch.device | None
    ) -> Capability:
        tags = _tag_names(target)
        if "cudagraph_unsafe" in tags:
            return Capability(capturable=False, reason=f"{name} is tagged cudagraph_unsafe")
        if "data_dependent_output" in tags:
            return Capability(capturable=False, reason=f"host sync: {name} reads a tensor value on the host")
        if "dynamic_output_shape" in tags and _has_unbacked_size(node):
            return Capability(capturable=False, reason=f"host sync: the output size of {name} depends on data")
        val = node.meta.get("val")
        if name not in _METADATA_OPS and isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and any(
            isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in node.args
        ):
            return Capability(capturable=False, reason=f"host sync: {name} reads a tensor value on the host")
        if node.meta.get("unbacked_bindings"):
            # The op binds a size or value only known once it ran (a data-dependent output).
            return Capability(capturable=False, reason=f"host sync: an output size of {name} depends on data")
        dev = _first_tensor_device(node)
        if graph_device is not None and graph_device.type == "cuda":
            if dev is not None and dev.type == "cpu":
                return Capability(capturable=False, reason=f"CPU op {name} in a CUDA graph")
            crossing = _host_device_copy(node)
            if crossing is not None:
                return Capability(capturable=False, reason=f"{crossing} copy by {name}: pageable host memory "
                                  "cannot be copied inside a CUDA graph capture")
        ns = name.split("::", 1)[0]
        namespace_default = self._namespaces.get(ns)
        if namespace_default is not None:
            return namespace_default(node, name)
        if ns in _SAFE_NAMESPACES:
            return _ATEN_OP
        if name not in self._warned:
            self._warned.add(name)
            log.info(
                "capturepass: no capability declared for custom op %s; serializing it (the conservative "
                "answer). Declare it with capturepass.register_capability(%r, overlap='safe') if it may "
                "run beside other lanes.",
                name,
                name,
            )
        return Capability(overlap=Overlap.SERIALIZE, reason=f"undeclared custom op {name}", source="default")


# The default answer for most nodes: one shared record (records are frozen).
_ATEN_OP = Capability(reason="aten op")

# Higher-order ops that stand for the custom op in their first argument (a custom op with
# ``mutates_args`` reaches the functional graph wrapped in one).
def op_of(node: fx.Node) -> torch._ops.OpOverload | None:
    """The op overload ``node`` runs: its target, or the op a functionalization or effect
    wrapper calls (``auto_functionalized``, ``auto_functionalized_v2``, ``with_effects``)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target
    if isinstance(target, torch._ops.HigherOrderOperator):
        wrapped = hops.wrapped_call(node)
        if wrapped is not None:
            return wrapped[0]
    return None


def _host_device_copy(node: fx.Node) -> str | None:
    """``"host-to-device"`` / ``"device-to-host"`` when ``node`` moves a tensor between CPU and CUDA."""
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    ins = [v for v in ins if isinstance(v, torch.Tensor)]
    val = node.meta.get("val")
    outs = [v for v in (val if isinstance(val, (tuple, list)) else (val,)) if isinstance(v, torch.Tensor)]
    # A 0-dim CPU tensor beside CUDA tensors is a host scalar of the launch, not a copy.
    host_in = any(v.device.type == "cpu" and v.dim() > 0 for v in ins)
    device_in = any(v.device.type == "cuda" for v in ins)
    if host_in and any(v.device.type == "cuda" for v in outs):
        return "host-to-device"
    if device_in and any(v.device.type == "cpu" for v in outs):
        return "device-to-host"
    return None

# id(op) -> (op, its tag names); the op is kept so that its id is never reused meanwhile.
_TAG_NAMES: dict[int, tuple[torch._ops.OpOverload, frozenset[str]]] = {}


def _tag_names(target: torch._ops.OpOverload) -> frozenset[str]:
    """The names of ``target``'s tags (``"cudagraph_unsafe"``, ...), computed once per op."""
    entry = _TAG_NAMES.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    names = frozenset(str(t).rsplit(".", 1)[-1] for t in target.tags)
    _TAG_NAMES[id(target)] = (target, names)
    return names


def _has_unbacked_size(node: fx.Node) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    val = node.meta.get("val")
    if val is None:
        return True  # no metadata: assume the worst
    try:
        return bool(free_unbacked_symbols(val))
    except Exception:
        return True


def _first_tensor_device(node: fx.Node) -> torch.device | None:
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v.device
    v = node.meta.get("val")
    return v.device if isinstance(v, torch.Tensor) else None


def _hint(d: Any) -> int:
    if isinstance(d, torch.SymInt):
        return int(d.node.hint) if d.node.hint is not None else -1
    return int(d)


def _call_info(name: str, target: torch._ops.OpOverload, args: tuple, kwargs: Mapping[str, Any]) -> CallInfo:
    """The call of ``target`` with ``args``/``kwargs`` (graph nodes or values), in schema order."""
    values, kw = hops.as_values(args, kwargs)
    ordered: list[Any] = []
    names: list[str] = []
    for i, formal in enumerate(target._schema.arguments):
        if i < len(values) and not formal.kwarg_only:
            v = values[i]
        elif formal.name in kw:
            v = kw[formal.name]
        elif formal.has_default_value():
            v = formal.default_value
        else:
            v = None
        ordered.append(v)
        names.append(formal.name)
    tensors = [v for v in ordered if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else None
    sm_count = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return CallInfo(
        op=name,
        shapes=tuple(tuple(_hint(d) for d in t.shape) for t in tensors),
        dtypes=tuple(t.dtype for t in tensors),
        device=device,
        sm_count=sm_count,
        args=tuple(ordered),
        dynamic=any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols for t in tensors for d in t.shape),
        arg_names=tuple(names),
    )


_OVERLAP_RANK = {level: i for i, level in enumerate(Overlap)}


def _combine(hop: str | None, inner: list[tuple[fx.Node, Capability]]) -> Capability:
    """One answer for a higher-order op from the answers of the nodes of its subgraphs.

    It may do whatever any of them may: not capturable if one is not, the strictest
    overlap, every resource, a resident grid if one launches one.
    """
    if not inner:
        return Capability(reason=f"{hop}: empty subgraphs")
    capturable = all(c.capturable for _, c in inner)
    overlap = max((c.overlap for _, c in inner), key=_OVERLAP_RANK.__getitem__)
    resources: list[str] = []
    for _, c in inner:
        resources.extend(r for r in c.resources if r not in resources)
    resident = [c for _, c in inner if c.resident_grid]
    ctas = [c.ctas for c in resident if c.ctas is not None]
    decisive = [(n, c) for n, c in inner if not c.capturable or c.overlap == overlap and overlap != Overlap.SAFE]
    if decisive:
        n, c = decisive[0]
        reason, source = f"{hop} subgraph: %{n.name}: {c.reason}", c.source
    else:
        reason, source = f"{hop}: every op of its subgraphs may overlap", "default"
    return Capability(
        capturable=capturable,
        overlap=overlap,
        reason=reason,
        resources=tuple(resources),
        source=source,
        resident_grid=bool(resident),
        barrier_free=all(c.barrier_free for c in resident),
        ctas=max(ctas) if ctas else None,
        monolithic=any(c.monolithic for _, c in inner),
        collective=any(c.collective for _, c in inner),
    )


def _host_sync(node: fx.Node, hop: str | None, modules: list[fx.GraphModule]) -> str | None:
    """Why ``node`` reads a device value on the host (its control flow depends on one), if it does.

    NOTE: ``cond`` picks its branch and ``while_loop`` decides each iteration on the host
    (Inductor emits ``pred.item()``; eager does ``if pred``): a tensor predicate is a
    device-to-host copy, which a CUDA graph capture cannot contain.
    """
    if hop == "cond" and node.args:
        pred = node.args[0]
        if isinstance(pred, fx.Node) and not isinstance(pred.meta.get("val"), (bool, torch.SymBool)):
            return "host sync: cond reads its tensor predicate on the host"
    if hop == "while_loop" and modules:
        out = next((n for n in modules[0].graph.nodes if n.op == "output"), None)
        vals = [a.meta.get("val") for a in out.all_input_nodes] if out is not None else [None]
        if not vals or any(not isinstance(v, (bool, torch.SymBool)) for v in vals):
            return "host sync: while_loop reads its tensor condition on the host at every iteration"
    return None


def _to_capability(answer: Any, name: str, decl: _Declaration) -> Capability:
    if isinstance(answer, Capability):
        cap = answer
    elif isinstance(answer, Mapping):
        fields = {f.name for f in dataclasses.fields(Capability)}
        unknown = sorted(set(answer) - fields)
        if unknown:
            raise CapabilityError(
                f"the launch-plan callable of {name} returned unknown field(s) {unknown}; "
                f"valid fields are {sorted(fields)}"
            )
        cap = Capability(**{"capturable": decl.capturable, "resources": decl.resources,
                            "monolithic": decl.monolithic, "collective": decl.collective, **answer})
    else:
        raise CapabilityError(
            f"the launch-plan callable of {name} must return a Capability or a mapping, got {answer!r}"
        )
    if cap.overlap not in OVERLAP_CHOICES:
        raise CapabilityError(f"the launch-plan callable of {name} answered overlap={cap.overlap!r}")
    cap = dataclasses.replace(cap, overlap=Overlap(cap.overlap))
    if cap.resident_grid and not cap.barrier_free and cap.overlap != Overlap.SERIALIZE:
        # A grid barrier waits for every CTA; work on another lane holding multiprocessors
        # can keep some from ever starting, also work started after the launch ("join").
        # Never overlap it, whatever the plan claimed.
        cap = dataclasses.replace(cap, overlap=Overlap.SERIALIZE, reason=f"{cap.reason}; grid barrier: serialized")
    return dataclasses.replace(cap, source="launch-plan", reason=cap.reason or "launch plan")


REGISTRY = CapabilityRegistry()


def register_capability(
    op: Any,
    *,
    capturable: bool = True,
    overlap: OverlapSpec = Overlap.SAFE,
    resources: tuple[str, ...] = (),
    monolithic: bool = False,
    collective: bool = False,
) -> None:
    """Declares what ``op`` may do inside a capture and beside other lanes.

    Args:
        op: ``"ns::name"``, a ``torch.ops`` overload or packet, or a
            ``torch.library.custom_op`` object.
        capturable: whether the op may run inside a CUDA graph capture.
        overlap: ``"safe"``, ``"join"``, ``"serialize"`` (see the module doc), or
            a callable taking a :class:`CallInfo` and returning a ``Capability``
            (or a mapping of its fields) for that concrete call.
        resources: names of owner-bound resources (workspaces, channels) the
            op uses; ``bind_resources`` binds them to the capturing owner and lane.
        monolithic: the op needs the whole forward in one CUDA graph.
        collective: the op communicates with other ranks: it runs on the comm lane
            (a lane kind of its own) and starts as early as its inputs allow.

    Raises:
        CapabilityError: an invalid op or declaration.
    """
    REGISTRY.register(op, capturable=capturable, overlap=overlap, resources=resources, monolithic=monolithic,
                      collective=collective)


def capability(
    *,
    capturable: bool = True,
    overlap: OverlapSpec = Overlap.SAFE,
    resources: tuple[str, ...] = (),
    monolithic: bool = False,
    collective: bool = False,
) -> Callable[[Any], Any]:
    """Decorator form of :func:`register_capability`, for a ``torch.library.custom_op``."""

    def deco(op: Any) -> Any:
        register_capability(op, capturable=capturable, overlap=overlap, resources=resources, monolithic=monolithic,
                            collective=collective)
        return op

    return deco
