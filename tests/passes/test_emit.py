"""Tests of ``emit``: regions for the inner compiler, stitched by the outer program.

Each test checks the number of regions, that the emitted program run on real
tensors (host lanes, ``inner="eager"``) equals the traced function, and the
outer program's code as a golden string. Two regressions pin the order of the
outer program where the allocator's reuse depends on it: a value must not be
freed before the nodes that precede its free point on its allocating lane.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from expecttest import assert_expected_inline

import capturepass
from capturepass.runtime.program import describe as describe_program
from capturepass.runtime.executor import Executor
from tests.helpers import aten_graph
from tests.passes.cases import CASES, before_after, case_before_after

L = capturepass.lane


def _run(program, args):
    executor = Executor(program)
    try:
        return executor(list(args))
    finally:
        executor.close()


def _check_numerics(name: str, program) -> None:
    case = CASES[name]
    args = case.inputs(seed=1)
    torch.testing.assert_close(_run(program, args), case.fn(*args))


def _code_lines(program) -> list[str]:
    return [line.strip() for line in describe_program(program).splitlines()]


def _position(lines: list[str], prefix: str) -> int:
    (index,) = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    return index


def test_fork_join_emits_three_regions():
    _, before, after, ctx = case_before_after("fork_join", "emit")
    program = ctx.artifacts["program"]
    assert [(r.lane, r.segment, r.eager) for r in program.regions] == [(1, 0, False), (0, 0, False), (0, 0, False)]
    assert ctx.counters["emit"] == {"regions": 3, "regions_eager": 3}
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, x_1, w1_1, w2_1):
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_0 = capturepass_runtime_program_region_0(x_1, w1_1);  w1_1 = None
    getitem = region_0[0];  region_0 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    region_1 = capturepass_runtime_program_region_1(x_1, w2_1);  x_1 = w2_1 = None
    getitem_1 = region_1[0];  region_1 = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    region_2 = capturepass_runtime_program_region_2(getitem, getitem_1);  getitem = getitem_1 = None
    getitem_2 = region_2[0];  region_2 = None
    return (getitem_2,)""")
    _check_numerics("fork_join", program)
    assert after == before  # the annotated graph itself is left as it was


def test_host_break_runs_eagerly_between_two_segments():
    _, _, _, ctx = case_before_after("host_break", "emit")
    program = ctx.artifacts["program"]
    assert [(r.lane, r.segment, r.eager) for r in program.regions] == [
        (1, 0, False),
        (0, 0, False),
        (0, None, True),
        (1, 1, False),
        (0, 1, False),
    ]
    assert [p.kind for p in program.pieces] == ["segment", "break", "segment"]
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, y_1, x_1):
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_0 = capturepass_runtime_program_region_0(y_1);  y_1 = None
    getitem = region_0[0];  region_0 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    region_1 = capturepass_runtime_program_region_1(x_1);  x_1 = None
    getitem_1 = region_1[0];  region_1 = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    return (getitem, getitem_1)

# break (eager)
def forward(self, sum_1):
    region_2 = capturepass_runtime_program_region_2(sum_1);  sum_1 = None
    getitem = region_2[0];  region_2 = None
    return (getitem,)

# segment 1
def forward(self, y_1, _local_scalar_dense, cos):
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_3 = capturepass_runtime_program_region_3(y_1);  y_1 = None
    getitem = region_3[0];  region_3 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    region_4 = capturepass_runtime_program_region_4(getitem, _local_scalar_dense, cos);  getitem = _local_scalar_dense = cos = None
    getitem_1 = region_4[0];  region_4 = None
    return (getitem_1,)""")
    _check_numerics("host_break", program)


def test_regions_carry_no_capturepass_metadata():
    _, _, _, ctx = case_before_after("retention", "emit")
    program = ctx.artifacts["program"]
    for region in program.regions:
        for node in region.graph.graph.nodes:
            assert "capturepass" not in node.meta and "custom" not in node.meta
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, x_1, w1_1, w2_1):
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_0 = capturepass_runtime_program_region_0(x_1, w1_1)
    getitem = region_0[0];  region_0 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    region_1 = capturepass_runtime_program_region_1(x_1, w2_1);  x_1 = w2_1 = None
    getitem_1 = region_1[0];  region_1 = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    region_2 = capturepass_runtime_program_region_2(getitem, getitem_1);  getitem = getitem_1 = None
    getitem_2 = region_2[0];  region_2 = None
    retain = capturepass_runtime_owner_retain(0, (), w1_1);  w1_1 = retain = None
    return (getitem_2,)""")
    _check_numerics("retention", program)


def test_every_case_runs_like_the_traced_function():
    for name in ("chain", "diamond", "deferred_release", "cross_segment_release", "serialized", "auto_branches"):
        _, _, _, ctx = case_before_after(name, "emit")
        _check_numerics(name, ctx.artifacts["program"])


def test_policy_off_emits_one_region():
    _, _, _, ctx = case_before_after("fork_join", "emit", policy="off")
    program = ctx.artifacts["program"]
    assert len(program.regions) == 1
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, x_1, w1_1, w2_1):
    region_0 = capturepass_runtime_program_region_0(x_1, w1_1, w2_1);  x_1 = w1_1 = w2_1 = None
    getitem = region_0[0];  region_0 = None
    return (getitem,)""")
    _check_numerics("fork_join", program)


def _emit(fn) -> object:
    gm = aten_graph(fn, torch.randn(4, 4))
    _, _, ctx = before_after(gm, "emit", policy="hints")
    return ctx.artifacts["program"]


def _region_of(program, name: str) -> int:
    (index,) = [r.index for r in program.regions if any(n.name == name for n in r.inputs + r.outputs)]
    return index


def test_release_runs_after_the_region_before_it():
    """Regression: the release of ``%sin`` sits after ``%exp`` in the annotated graph.

    ``%exp`` is in main's open region when the release is reached; emit used to
    issue the release step at once, so ``%sin`` was freed before ``%exp`` ran,
    and ``%exp`` could allocate ``%sin``'s block while ``%cos`` (aux) still read it.
    """

    def fn(x):
        t = x.sin()
        with L("aux"):
            u = t.cos()
        v = x.exp()
        return u, v

    program = _emit(fn)
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, x_1):
    region_0 = capturepass_runtime_program_region_0(x_1)
    getitem = region_0[0];  region_0 = None
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_1 = capturepass_runtime_program_region_1(getitem)
    getitem_1 = region_1[0];  region_1 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    region_2 = capturepass_runtime_program_region_2(x_1);  x_1 = None
    getitem_2 = region_2[0];  region_2 = None
    release = capturepass_runtime_lanes_release(getitem);  getitem = release = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    return (getitem_1, getitem_2)""")
    lines = _code_lines(program)
    assert _position(lines, f"region_{_region_of(program, 'exp')} =") < _position(lines, "release =")


def test_allocating_lane_runs_before_a_reader_that_frees():
    """Regression: ``%sin`` (main) is last read by ``%cos`` (aux); ``%exp`` (main) comes before.

    The outer program frees ``%sin`` right after the region of ``%cos``. emit used
    to issue that region first and main's open region (``%exp``) only at the
    join, so ``%exp`` allocated after the free and could reuse ``%sin``'s block
    while ``%cos`` still read it. The verifier judged the free in program order,
    where ``%exp`` is already issued.
    """

    def fn(x):
        t = x.sin()
        v = x.exp()
        with L("aux"):
            u = t.cos()
        return u, v

    program = _emit(fn)
    assert_expected_inline(describe_program(program), """\
# segment 0
def forward(self, x_1):
    region_0 = capturepass_runtime_program_region_0(x_1)
    getitem = region_0[0];  region_0 = None
    record = capturepass_runtime_lanes_record(0, 0);  record = None
    wait = capturepass_runtime_lanes_wait(0, 1);  wait = None
    region_1 = capturepass_runtime_program_region_1(x_1);  x_1 = None
    getitem_1 = region_1[0];  region_1 = None
    region_2 = capturepass_runtime_program_region_2(getitem);  getitem = None
    getitem_2 = region_2[0];  region_2 = None
    record_1 = capturepass_runtime_lanes_record(1, 1);  record_1 = None
    wait_1 = capturepass_runtime_lanes_wait(1, 0);  wait_1 = None
    return (getitem_1, getitem_2)""")
    lines = _code_lines(program)
    assert _position(lines, f"region_{_region_of(program, 'exp')} =") < _position(
        lines, f"region_{_region_of(program, 'cos')} ="
    )


# -- higher-order ops: their subgraphs travel with the region ----------------------------------------


def _cond_fn(x, y):
    def true_fn(x):
        return x.sin() + 1

    def false_fn(x):
        return x.cos() - 1

    return torch.cond(x.sum() > 0, true_fn, false_fn, (x,)) * y


def _while_fn(x, n):
    from torch._higher_order_ops import while_loop

    def cond_fn(i, acc):
        return i < n.sum()

    def body_fn(i, acc):
        return i + 1, acc * 1.5 + 1

    i, acc = while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))
    return acc + i


def _nested_region_fn():
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        pytest.skip("this torch has no torch.compiler.nested_compile_region")

    @region
    def block(x, w):
        return torch.relu(x @ w) + 1

    def fn(x, w):
        return block(block(x, w), w) * 2

    return fn


def _hop_calls(name: str):
    """The function and two calls with different inputs (for cond: one per branch)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    if name == "cond":
        return _cond_fn, [(x.abs() + 0.1, y), (-x.abs() - 0.1, y)]
    if name == "while_loop":
        return _while_fn, [(x[0], torch.tensor([2])), (x[1], torch.tensor([5]))]
    return _nested_region_fn(), [(x, y), (y, x)]


_SUBGRAPH_OP = {"cond": "cond", "while_loop": "while_loop", "nested_compile_region": "invoke_subgraph"}


@pytest.mark.parametrize("inner", ["inductor", "eager"])
@pytest.mark.parametrize("hop", ["cond", "while_loop", "nested_compile_region"])
def test_higher_order_op_subgraphs_reach_the_inner_compiler(hop, inner):
    """Regression: regions took a HOP's subgraph modules as runtime arguments without an
    example value, and Inductor failed with ``'NoneType' object is not callable``."""
    from tests.backends.e2e_util import new_compiles

    fn, calls = _hop_calls(hop)
    compiled = torch.compile(fn, backend="capturepass", options={"inner": inner})
    with new_compiles() as records:
        for args in calls:
            torch.testing.assert_close(compiled(*args), fn(*args))
    (record,) = records  # one graph: the second call ran it again, without a recompile
    (region,) = [r for r in record.program.regions
                 if any(str(n.target) == _SUBGRAPH_OP[hop] for n in r.graph.graph.nodes
                        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator))]
    assert region.compiler == inner
    attrs = [n for n in region.graph.graph.nodes if n.op == "get_attr"]
    assert attrs and all(isinstance(region.graph.get_submodule(n.target), torch.fx.GraphModule) for n in attrs)
    assert not [n for n in region.inputs if n.op == "get_attr"]  # no module is a runtime argument


def _inner_failure(kind: str) -> Exception:
    if kind == "inductor_error":
        # How Inductor reports its own failures: one of Dynamo's formatted errors.
        from torch._inductor.exc import InductorError

        return InductorError(ValueError("simulated: the argument '-((0))' is not comparable."), inspect.currentframe())
    return RuntimeError("simulated inner compiler failure")


@pytest.mark.parametrize("kind", ["runtime_error", "inductor_error"])
def test_a_region_the_inner_compiler_fails_on_runs_eagerly_unless_it_is_the_whole_graph(monkeypatch, caplog, kind):
    """A region cut out of the graph (a plan of several regions) can meet an inner-compiler
    error the whole graph does not: it runs its FX graph eagerly, logged, at the first compile
    as at a rebuild. The only region of a plan is the graph the inner compiler would see
    without capturepass: its error is reported (Inductor's own unwrapped, for Dynamo to
    format), except at a rebuild at run time, where an error would end the call."""
    from torch._dynamo.exc import ShortenTraceback

    from capturepass.backends import compile as driver
    from capturepass.backends import inner
    from capturepass.errors import EmitError
    from capturepass.ir import meta
    from tests.passes.cases import CASES

    real = inner.compile_region

    def flaky(gm, example, compiler):
        if compiler == "inductor":
            raise _inner_failure(kind)
        return real(gm, example, compiler)

    monkeypatch.setattr(inner, "compile_region", flaky)
    case = CASES["fork_join"]
    vals = lambda gm: [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]  # noqa: E731
    inputs = case.inputs(seed=2)

    gm = case.trace()
    expected = (ShortenTraceback, "not comparable") if kind == "inductor_error" else \
        (EmitError, "the inductor compiler failed on region 0")
    with pytest.raises(expected[0], match=expected[1]):
        driver.compile_graph(gm, vals(gm), {"policy": "off"}, record=False)

    for options, not_capturable in (({"policy": "hints", "regions": "lanes"}, None),
                                    ({"policy": "off"}, {"nothing": "test"})):
        gm = case.trace()
        caplog.clear()
        with caplog.at_level("WARNING", logger="capturepass"):
            compiled = driver.compile_graph(gm, vals(gm), options, not_capturable=not_capturable, record=False)
        regions = compiled.program.regions
        assert len(regions) == (1 if options["policy"] == "off" else 3)
        assert caplog.text.count("the region runs its graph eagerly instead") == len(regions), caplog.text
        # The dump and `show` list it among the graph's decisions.
        eager = [d for d in meta.graph_info(compiled.graph).decisions if "runs its graph eagerly" in d]
        assert len(eager) == len(regions) and all("the inductor compiler failed on region" in d for d in eager)
        torch.testing.assert_close(Executor(compiled.program)(list(inputs)), case.fn(*inputs))


def test_a_whole_call_runs_one_generated_function_equal_to_threading_the_pieces():
    """The outer program's whole call (host lanes) is one generated function, the pieces' code
    copied into it: it calls every region itself, in program order, and no piece. Captures and
    replays thread an environment through the pieces instead. Both give the same values; a call
    with another number of arguments takes the environment path."""
    from capturepass.runtime.owner import GraphOwner

    _, _, _, ctx = case_before_after("cross_segment_release", "emit")
    program = ctx.artifacts["program"]
    assert [p.kind for p in program.pieces] == ["segment", "break", "segment"]
    owner = GraphOwner("test.whole", len(program.info.lanes), None, captured=False)
    try:
        bound = program.bind(owner, owner.lanes("eager"))
        args = CASES["cross_segment_release"].inputs(seed=2)
        env = bound.initial_env(args)
        for p in range(len(program.pieces)):
            bound.run_piece(p, env)
        threaded = bound.result(env)
        whole = bound(*args)
        assert isinstance(whole, tuple) and len(whole) == len(threaded) == 2
        assert torch.equal(whole[0], threaded[0]) and whole[1] == threaded[1]  # a tensor, and the .item()
        extra = bound(*args, torch.zeros(1))  # not the program's arity: the environment path
        assert torch.equal(extra[0], threaded[0]) and extra[1] == threaded[1]
        for got, want in zip(whole, CASES["cross_segment_release"].fn(*args)):
            torch.testing.assert_close(got, want)
        code = bound._whole.__self__.code  # the generated function itself
        calls = [line.split(" = ")[0].strip() for line in code.splitlines() if "= capturepass_runtime_program_region_" in line]
        assert calls == [f"region_{r.index}" for r in program.regions] and len(calls) == 6
        assert "piece" not in code
    finally:
        owner.close()
