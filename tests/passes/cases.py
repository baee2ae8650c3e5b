"""Small annotated graphs shared by the golden pass tests and the verifier tests.

Each :class:`Case` is a function traced with :func:`tests.helpers.aten_graph`
(fake tensors, 4x4 shapes) plus the options it runs under. The golden tests of
``tests/passes`` run them through the pipeline and compare dumps; the verifier
tests of ``tests/ir`` check that every one of them verifies, and break them one
thing at a time.

The custom ops live in the test-private ``cptest_passes`` namespace:

- ``cptest_passes::fused`` declares a ``workspace`` resource while the
  :func:`fused_declared` context manager is active (and only then);
- ``cptest_passes::opaque`` is never declared, so the registry serializes it
  (the default answer for an unknown custom op).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

import capturepass
from capturepass.ir import collectives
from capturepass.ir.capabilities import REGISTRY
from capturepass.passes.base import PassContext
from capturepass.backends.compile import compile_graph
from capturepass.passes.pipeline import ATEN
from tests.helpers import aten_graph, context, dump, run_passes

N = 4
L = capturepass.lane


@torch.library.custom_op("cptest_passes::fused", mutates_args=())
def fused(x: torch.Tensor) -> torch.Tensor:
    """A custom op that needs an owner-bound workspace once declared."""
    return x * 2


@fused.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cptest_passes::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An undeclared custom op: serialized by default."""
    return x + 1


@opaque.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@contextlib.contextmanager
def fused_declared() -> Iterator[None]:
    """Declares ``cptest_passes::fused`` with a workspace for the duration of the block."""
    key = REGISTRY.key()
    capturepass.register_capability(fused, resources=("workspace",))
    try:
        yield
    finally:
        REGISTRY.unregister(fused)
        assert REGISTRY.key() == key


# -- the traced functions -------------------------------------------------------------------


def fork_join(x, w1, w2):
    """Two independent matmuls, one hinted onto ``aux``, joined by an add."""
    with L("aux"):
        a = torch.mm(x, w1)
    b = torch.mm(x, w2)
    return a + b


def chain(x):
    """main -> aux -> main -> aux: every crossing is a true dependency."""
    a = x.sin()
    with L("aux"):
        b = a.cos()
    c = b.exp()
    with L("aux"):
        d = c.neg()
    return d


def diamond(x):
    """``a1`` feeds ``a2`` and both feed main: main's read of ``%sin`` is implied by ``%cos``."""
    with L("a1"):
        a = x.sin()
    with L("a2"):
        b = a.cos()
    return a + b


def deferred_release(x):
    """``%sin`` is allocated on main, last read on aux, and main keeps issuing work."""
    t = x.sin()
    with L("aux"):
        u = t.cos()
    v = x.exp()
    return u + v


def host_break(x, y):
    """A host sync (``.item()``) between two pieces of aux work."""
    with L("aux"):
        a = y.cos()
    s = x.sum().item()
    with L("aux"):
        b = y.sin()
    return a + b * s


def cross_segment_release(x, y):
    """``%cos`` is allocated on aux in k0, read on main in k1 while aux allocates again."""
    with L("aux"):
        a = y.cos()
    s = x.sum().item()
    b = a * 2
    with L("aux"):
        c = y.sin()
    return b + c, s


def serialized(x, y):
    """An undeclared custom op on main, with aux work before and after it."""
    with L("aux"):
        a = y.cos()
    s = opaque(x)
    with L("aux"):
        c = a.sin()
    return s + c


def two_joins(x, w1, w2):
    """Two aux lanes whose results main reads together: both join events are live at once."""
    with L("a1"):
        a = torch.mm(x, w1)
    with L("a2"):
        b = torch.mm(x, w2)
    return a + b


def with_resources(x, y):
    """``fused`` on aux and on main: one workspace binding per lane."""
    with L("aux"):
        a = fused(y)
    b = fused(x)
    return a + b


def branches(x, w1, w2):
    """Unhinted independent matmuls, for the automatic policy."""
    a = torch.mm(x, w1)
    b = torch.mm(x, w2)
    return a + b


def single_lane(x, w):
    """No hints and one dependency chain: nothing to synchronise."""
    return torch.mm(x, w).relu() + x


def write_after_read(x, w):
    """``%mm`` reads ``x`` on aux; main then updates ``x`` in place: the write waits for the read."""
    with L("aux"):
        a = torch.mm(x, w)
    x.add_(1)
    return a


def read_after_write(x, w):
    """main updates ``x`` through a view of its first row; aux then reads ``x``: the read waits."""
    with L("aux"):
        b = w.cos()
    x[0].mul_(2)
    with L("aux"):
        a = torch.mm(x, b)
    return a + 1


def random_order(x):
    """Two random draws on two lanes: the generator's hidden state orders them as written."""
    with L("aux"):
        a = torch.rand_like(x) * x
    b = torch.rand_like(x) + x.cos()
    return a, b


def collective(x, w1, w2, w3):
    """An all-reduce of one matmul beside an independent branch, its wait right after it (as AOT
    autograd traces ``dist.all_reduce``): the collective goes to the comm lane, the wait after the
    branch."""
    r = torch.ops._c10d_functional.all_reduce(torch.mm(x, w1), "sum", "0")
    r = torch.ops._c10d_functional.wait_tensor(r)
    y = torch.mm(torch.relu(torch.mm(x, w2)), w3)
    return r + y


@dataclasses.dataclass(frozen=True)
class Case:
    """A traced function and the options it runs under.

    Attributes:
        fn: the function to trace.
        arity: how many ``N x N`` inputs it takes.
        cudagraphs: the graph's capture mode.
        static_inputs: input positions whose storage the caller keeps fixed.
        options: pass options (``policy`` and the like).
        needs_fused: whether ``cptest_passes::fused`` must be declared.
        needs_world: whether running it needs a process group (its collectives name the
            world group ``"0"``): :func:`world_for` makes a gloo world of one rank.
    """

    fn: Callable
    arity: int
    cudagraphs: str = "none"
    static_inputs: tuple[int, ...] = ()
    options: tuple[tuple[str, Any], ...] = (("policy", "hints"),)
    needs_fused: bool = False
    needs_world: bool = False

    def inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Real inputs (deterministic), for running emitted programs."""
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(N, N, generator=gen) for _ in range(self.arity))

    def trace(self) -> fx.GraphModule:
        """The functional ATen graph of ``fn`` with its graph record."""
        return aten_graph(
            self.fn, *self.inputs(), cudagraphs=self.cudagraphs, static_inputs=self.static_inputs
        )


CASES: dict[str, Case] = {
    "fork_join": Case(fork_join, 3),
    "chain": Case(chain, 1),
    "diamond": Case(diamond, 1),
    "deferred_release": Case(deferred_release, 1),
    "host_break": Case(host_break, 2, cudagraphs="breakable"),
    "cross_segment_release": Case(cross_segment_release, 2, cudagraphs="breakable"),
    "serialized": Case(serialized, 2),
    "two_joins": Case(two_joins, 3),
    "retention": Case(fork_join, 3, cudagraphs="monolithic", static_inputs=(1,)),
    "resources": Case(with_resources, 2, cudagraphs="monolithic", needs_fused=True),
    "auto_branches": Case(branches, 3, options=(("policy", "auto"),)),
    "single_lane": Case(single_lane, 2),
    "write_after_read": Case(write_after_read, 2),
    "read_after_write": Case(read_after_write, 2),
    "random_order": Case(random_order, 1),
}
if collectives.WAIT_TENSOR is not None:  # a torch built with distributed
    CASES["collective"] = Case(collective, 4, options=(("policy", "auto"),), needs_world=True)


@contextlib.contextmanager
def world_for(*names: str) -> Iterator[None]:
    """A one-rank gloo world while the block runs cases ``names`` if any of them needs one
    (their collectives then run for real: on one rank, the identity); skips the test where gloo
    is unavailable."""
    if not any(CASES[n].needs_world for n in names):
        yield
        return
    import pytest

    from capturepass.testing import parallel

    reason = parallel.gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with parallel.one_rank_world():
        yield


def build(name: str, upto: str, **options: Any) -> tuple[fx.GraphModule, PassContext]:
    """Traces case ``name`` and runs the pipeline up to and including ``upto`` (verifying each pass)."""
    case = CASES[name]
    gm = case.trace()
    opts = {**dict(case.options), **options}
    with fused_declared() if case.needs_fused else contextlib.nullcontext():
        ctx = run_passes(gm, upto=upto, **opts)
    return gm, ctx


def before_after(gm: fx.GraphModule, name: str, **options: Any) -> tuple[str, str, PassContext]:
    """Runs the ATen pipeline up to the pass before ``name``, then ``name`` alone, through the
    compile driver, verifying after every pass.

    Returns:
        The dump before ``name``, the dump after it, and the pass context.
    """
    ctx = context(**options)
    classes = list(ATEN)
    index = [cls.name for cls in classes].index(name)
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if index:
        compile_graph(gm, vals, ctx.options, upto=classes[index - 1].name, verify=True, registry=ctx.registry, record=False)
    before = dump(gm)
    compiled = compile_graph(
        gm, vals, ctx.options, passes=[classes[index]], verify=True, registry=ctx.registry, record=False
    )
    return before, dump(gm), compiled.context


def run_one(gm: fx.GraphModule, name: str, **options: Any) -> tuple[str, PassContext]:
    """Runs the single ATen-stage pass ``name`` on ``gm`` (verifying); returns the dump after it."""
    ctx = context(**options)
    (cls,) = [cls for cls in ATEN if cls.name == name]
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    compiled = compile_graph(gm, vals, ctx.options, passes=[cls], verify=True, registry=ctx.registry, record=False)
    return dump(gm), compiled.context


def case_before_after(name: str, pass_name: str, **options: Any) -> tuple[fx.GraphModule, str, str, PassContext]:
    """:func:`before_after` on a traced case, under the case's options."""
    case = CASES[name]
    gm = case.trace()
    opts = {**dict(case.options), **options}
    with fused_declared() if case.needs_fused else contextlib.nullcontext():
        before, after, ctx = before_after(gm, pass_name, **opts)
    return gm, before, after, ctx
