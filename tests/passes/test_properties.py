"""Property tests of the whole ATen pipeline on random DAGs of real aten ops.

A strategy draws a small DAG of aten ops on float tensors (pointwise ops,
broadcasting binary ops, ``mm``, ``sum`` with ``keepdim``, views, and sometimes a
host synchronisation ``.item()`` whose value feeds back into the graph), with a
random lane hint per op, and random backend options. Some ops have storage
effects: in-place updates of inputs and of intermediates (``add_``, ``copy_``, and
``mul_`` through a view of the first row), and random draws (``rand_like``); the
graph may return views of its inputs. The DAG becomes a Python closure, is traced
to an ATen graph (with its in-place ops, or functionalized as AOT autograd does:
the inputs' updates become a write-back ``copy_``) and compiled with the eager
inner compiler. The oracles:

- the verifier accepts the annotated graph;
- the emitted program computes what the function computes eagerly, bit for bit
  (outputs, and the inputs it updated), with the generator seeded alike;
- the waits never outnumber the cross-lane data and storage-order edges plus one
  fork and one join per auxiliary lane per segment;
- every inserted wait is needed: dropping any single one makes the verifier fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx
from hypothesis import event, given, settings
from hypothesis import strategies as st

import capturepass
from capturepass.ir import analysis, effects, meta
from capturepass.ir.meta import MAIN_LANE, Effect
from capturepass.ir.verify import verify
from capturepass.runtime.executor import Executor
from tests.helpers import aten_graph, run_passes, sync_nodes, unneeded_waits

N = 4
LANE_POOL = (None, "a", "b", "c")
KINDS = ("add", "mul", "sin", "relu", "mm", "sum", "t", "view", "item", "add_", "copy_", "row_mul_", "rand")
# Ops that update their first argument in place (and return it).
IN_PLACE = frozenset({"add_", "copy_", "row_mul_"})
MAX_OPS = 9


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a drawn DAG: ``kind`` applied to earlier values ``args``, on ``lane``."""

    kind: str
    args: tuple[int, ...]
    lane: str | None
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class Dag:
    """Values 0..n_inputs-1 are the inputs; op i defines value n_inputs + i."""

    n_inputs: int
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]


def _broadcasts(src: torch.Size, dst: torch.Size) -> bool:
    """Whether a tensor of shape ``src`` can be copied into one of shape ``dst``."""
    return all(s in (1, d) for s, d in zip(reversed(src), reversed(dst))) and len(src) <= len(dst)


@dataclasses.dataclass(frozen=True)
class Case:
    dag: Dag
    policy: str
    max_aux_lanes: int
    cudagraphs: str
    static_inputs: frozenset[int]
    seed: int
    tracing_mode: str = "fake"
    functional: bool = False


def _apply(op: Op, args: list[torch.Tensor]) -> torch.Tensor:
    if op.kind == "add":
        return args[0] + args[1]
    if op.kind == "mul":
        return args[0] * args[1]
    if op.kind == "sin":
        return args[0].sin()
    if op.kind == "relu":
        return args[0].relu()
    if op.kind == "mm":
        return args[0] @ args[1]
    if op.kind == "sum":
        return args[0].sum(op.dim, keepdim=True)
    if op.kind == "t":
        return args[0].t()
    if op.kind == "view":
        rows, cols = args[0].shape
        return args[0].view(-1).view(cols, rows)
    if op.kind == "item":
        # A host synchronisation whose value flows back into the graph.
        return args[0] * args[1].sum().item()
    if op.kind == "add_":
        return args[0].add_(0.5)
    if op.kind == "copy_":
        return args[0].copy_(args[1])
    if op.kind == "row_mul_":
        args[0][:1].mul_(-2.0)  # an update through a view: the base sees it
        return args[0]
    if op.kind == "rand":
        return torch.rand_like(args[0]) + args[0]  # draws from the generator's hidden state
    raise AssertionError(op.kind)


def build(dag: Dag) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The DAG as a Python function, with a lane hint around each hinted op."""

    def fn(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(inputs)
        for op in dag.ops:
            args = [values[i] for i in op.args]
            if op.lane is None:
                values.append(_apply(op, args))
            else:
                with capturepass.lane(op.lane):
                    values.append(_apply(op, args))
        return tuple(values[i] for i in dag.outputs)

    return fn


@st.composite
def dags(draw: st.DrawFn, max_ops: int = MAX_OPS) -> Dag:
    """Random DAGs over f32[N,N] inputs; shapes and contiguity are tracked on meta tensors."""
    n_inputs = draw(st.integers(1, 3))
    shapes = [torch.empty(N, N, device="meta") for _ in range(n_inputs)]
    roots = list(range(n_inputs))
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(KINDS))
        everything = range(len(shapes))
        lane = draw(st.sampled_from(LANE_POOL))
        if kind == "mm":
            lhs_ok = [i for i in everything if any(shapes[i].shape[1] == shapes[j].shape[0] for j in everything)]
            i = draw(st.sampled_from(lhs_ok))
            j = draw(st.sampled_from([j for j in everything if shapes[i].shape[1] == shapes[j].shape[0]]))
            args: tuple[int, ...] = (i, j)
        elif kind == "view":
            args = (draw(st.sampled_from([i for i in everything if shapes[i].is_contiguous()])),)
        elif kind in ("add", "mul", "item"):
            args = (draw(st.sampled_from(everything)), draw(st.sampled_from(everything)))
        elif kind == "copy_":
            dst = draw(st.sampled_from(everything))
            # A source that shares the destination's storage overlaps it: eager refuses that.
            fits = [
                j for j in everything if roots[j] != roots[dst] and _broadcasts(shapes[j].shape, shapes[dst].shape)
            ]
            if not fits:
                kind, args = "sin", (dst,)
            else:
                args = (dst, draw(st.sampled_from(fits)))
        else:
            args = (draw(st.sampled_from(everything)),)
        op = Op(kind, args, lane, dim=draw(st.integers(0, 1)) if kind == "sum" else 0)
        # The storage each value lives in: views and in-place results keep their argument's.
        roots.append(roots[args[0]] if kind in ("t", "view") or kind in IN_PLACE else len(roots))
        if kind == "item":
            shapes.append(shapes[args[0]] * 1.0)  # .item() cannot run on meta tensors
        else:
            shapes.append(_apply(op, [shapes[i] for i in args]))
        ops.append(op)
    defined = range(n_inputs, n_inputs + len(ops))
    used = {i for op in ops for i in op.args}
    sinks = [v for v in defined if v not in used]  # returning every sink leaves nothing dead
    extra = draw(st.lists(st.sampled_from(defined), max_size=2))
    outputs = tuple(dict.fromkeys(sinks + extra))
    return Dag(n_inputs, tuple(ops), outputs)


@st.composite
def cases(draw: st.DrawFn, policies: tuple[str, ...] = ("auto", "hints", "off"), min_aux_lanes: int = 0) -> Case:
    dag = draw(dags())
    return Case(
        dag=dag,
        policy=draw(st.sampled_from(policies)),
        max_aux_lanes=draw(st.integers(min_aux_lanes, 3)),
        cudagraphs=draw(st.sampled_from(("none", "monolithic", "breakable"))),
        static_inputs=frozenset(draw(st.sets(st.integers(0, dag.n_inputs - 1)))),
        seed=draw(st.integers(0, 2**16)),
        # Symbolic tracing adds host ints (sym_size) that cross lanes without events.
        tracing_mode=draw(st.sampled_from(("fake", "symbolic"))),
        # Functionalized as AOT autograd does: input updates become a write-back copy_.
        functional=draw(st.booleans()),
    )


def _inputs(case: Case, salt: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed + salt)
    # Entries in [-1, 1): a chain of at most MAX_OPS matmuls and products stays finite.
    return [torch.rand(N, N, generator=gen) * 2 - 1 for _ in range(case.dag.n_inputs)]


def _traced_fn(case: Case) -> Callable[..., tuple[torch.Tensor, ...]]:
    fn = build(case.dag)
    if case.functional:
        return torch.func.functionalize(fn, remove="mutations")
    return fn


def _compile(case: Case, upto: str) -> tuple[fx.GraphModule, object]:
    gm = aten_graph(
        _traced_fn(case),
        *_inputs(case),
        cudagraphs=case.cudagraphs,
        static_inputs=case.static_inputs,
        tracing_mode=case.tracing_mode,
    )
    ctx = run_passes(
        gm,
        upto=upto,
        policy=case.policy,
        max_aux_lanes=case.max_aux_lanes,
        cudagraphs=case.cudagraphs,
        inner="eager",
    )
    return gm, ctx


def _run(program, inputs: list[torch.Tensor], seed: int = 0) -> tuple:
    """Calls an emitted program the way the backend does, with the generator seeded."""
    executor = Executor(program)
    try:
        torch.manual_seed(seed)
        return tuple(executor(list(inputs)))
    finally:
        executor.close()


def _eager(case: Case, inputs: list[torch.Tensor]) -> tuple:
    torch.manual_seed(case.seed)
    return build(case.dag)(*inputs)


def _sync_bound(gm: fx.GraphModule) -> tuple[int, int]:
    """(cross-lane data edges, forks plus joins) of an annotated graph.

    An edge counts when a kernel's tensor is read on another lane. Reads of inputs
    are not edges: inputs are issued on the main lane before any segment's fork, so
    the fork already orders them.
    """
    edges = 0
    order = effects.order_deps(gm.graph.nodes)
    for node in gm.graph.nodes:
        if meta.effect_of(node) not in (Effect.COMPUTE, Effect.OUTPUT):
            continue
        for p in node.all_input_nodes:
            if meta.effect_of(p) is Effect.COMPUTE and analysis.carries_tensor(p):
                edges += meta.lane_of(p) != meta.lane_of(node)
        for dep in order.get(node, ()):
            if meta.effect_of(dep.earlier) is Effect.COMPUTE:
                edges += meta.lane_of(dep.earlier) != meta.lane_of(node)
    forks_joins = 0
    for segment in analysis.split_segments(gm.graph):
        aux = {
            meta.lane_of(n)
            for n in segment
            if meta.effect_of(n) is Effect.COMPUTE and meta.lane_of(n) != MAIN_LANE
        }
        forks_joins += 2 * len(aux)
    return edges, forks_joins


@settings(max_examples=200)
@given(case=cases())
def test_pipeline_is_verified_correct_and_bounded(case):
    gm, ctx = _compile(case, upto="emit")
    # (a) the verifier accepts the final graph, with every property established.
    verify(gm)
    gi = meta.graph_info(gm)
    assert {"synced", "leased", "retained", "partitioned", "verified", "emitted"} <= gi.properties
    if case.policy == "off":
        assert gi.lanes == ("main",)
    assert len(gi.lanes) - 1 <= case.max_aux_lanes
    # (b) the emitted program computes what the function computes eagerly, bit for bit (the
    # same aten kernels run), on values other than the traced ones.
    inputs = _inputs(case, salt=1)
    eager_inputs = [x.clone() for x in inputs]
    expected = _eager(case, eager_inputs)
    torch.testing.assert_close(_run(ctx.artifacts["program"], inputs, case.seed), expected, rtol=0, atol=0)
    # Updates of the inputs reach the caller, as eagerly.
    torch.testing.assert_close(inputs, eager_inputs, rtol=0, atol=0)
    # (c) no more waits than cross-lane data edges plus a fork and a join per aux lane per segment.
    waits = ctx.counters.get("insert_syncs", {}).get("waits", 0)
    assert waits == len(sync_nodes(gm, Effect.WAIT))
    edges, forks_joins = _sync_bound(gm)
    assert waits <= edges + forks_joins, (waits, edges, forks_joins)
    event(f"aux lanes: {len(gi.lanes) - 1}")
    event(f"segments: {len(gi.segments)}")
    event(f"host syncs: {sum(op.kind == 'item' for op in case.dag.ops)}")
    event(f"tracing: {case.tracing_mode}{' functional' if case.functional else ''}")
    event(f"storage effects: {sum(op.kind in IN_PLACE or op.kind == 'rand' for op in case.dag.ops)}")
    event(f"waits: {'0' if waits == 0 else '1-3' if waits <= 3 else '4+'}")


@settings(max_examples=100)
@given(case=cases(policies=("auto", "hints"), min_aux_lanes=1))
def test_every_inserted_wait_is_needed(case):
    gm, _ = _compile(case, upto="insert_syncs")
    verify(gm)
    waits = len(sync_nodes(gm, Effect.WAIT))
    event(f"waits: {'0' if waits == 0 else '1-3' if waits <= 3 else '4+'}")
    assert unneeded_waits(gm) == []


# -- regressions found by the properties above ----------------------------------------------------


def _scalar_from_item(x):
    s = x.sum().item()  # a host float, produced on the main lane
    y = x.cos() * s
    with capturepass.lane("a"):
        z = x.sin() * s  # read on lane a: a host float needs no event
    return y, z


def _scalar_from_size(x):
    y = x.cos() * x.shape[0]  # sym_size on the main lane
    with capturepass.lane("a"):
        z = x.sin() * x.shape[0]  # read on lane a: a host int needs no event
    return y, z


def test_host_scalar_read_on_another_lane_runs_after_its_producer():
    """A host value (a scalar from ``.item()``, a dynamic size) crosses lanes without a
    record/wait pair. Emit cuts regions at sync points only, so the producer's region on the
    main lane was still open when the reader's region on lane ``a`` was closed by its join
    record, and the outer program called the reader first (KeyError on the scalar). Emit now
    closes a producer's open region before another lane's node reads from it."""
    for fn, mode in ((_scalar_from_item, "fake"), (_scalar_from_size, "symbolic")):
        x = torch.randn(N, N)
        gm = aten_graph(fn, x, tracing_mode=mode)
        ctx = run_passes(gm, upto="emit", policy="hints", max_aux_lanes=1, cudagraphs="none", inner="eager")
        assert meta.graph_info(gm).lanes == ("main", "a")
        x2 = torch.randn(N, N)
        torch.testing.assert_close(_run(ctx.artifacts["program"], [x2]), fn(x2), rtol=0, atol=0)
