"""Lanes after fusion: the rewrite of Inductor's generated ``call`` (``backends.fused_lanes``).

The code here has the form torch 2.11 and 2.13 generate for a CUDA graph (Triton launches
behind ``get_raw_stream``, extern matrix products with ``out=``, planned reuses); the GPU tests
(``tests/runtime/test_fused_lanes_gpu.py``) run real compiles of it.
"""

from __future__ import annotations

import textwrap

import pytest
from expecttest import assert_expected_inline

from capturepass.backends import fused_inductor, fused_lanes

MODULE = textwrap.dedent('''\
    from torch._C import _cuda_getCurrentRawStream as get_raw_stream
    triton_poi_fused_mul_sin_0 = async_compile.triton('triton_poi_fused_mul_sin_0', """
    @triton.jit
    def triton_poi_fused_mul_sin_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')
    triton_poi_fused_add_1 = async_compile.triton('triton_poi_fused_add_1', """
    @triton.jit
    def triton_poi_fused_add_1(KIND_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')

    class Runner:
        def __init__(self, partitions):
            self.partitions = partitions

        def call(self, args):
            arg0_1, arg1_1, arg2_1 = args
            args.clear()
            assert_size_stride(arg0_1, (8, 64), (64, 1))
            with torch.cuda._DeviceGuard(0):
                torch.cuda.set_device(0)
                buf0 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
                # Topologically Sorted Source Nodes: [sin, mul], Original ATen: [aten.sin, aten.mul]
                stream0 = get_raw_stream(0)
                triton_poi_fused_mul_sin_0.run(arg0_1, buf0, 512, stream=stream0)
                buf1 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
                # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
                extern_kernels.mm(arg0_1, arg1_1, out=buf1)
                buf2 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
                # Topologically Sorted Source Nodes: [mm_1], Original ATen: [aten.mm]
                extern_kernels.mm(buf0, arg2_1, out=buf2)
                del buf0
                buf3 = buf1; del buf1  # reuse
                # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]
                stream0 = get_raw_stream(0)
                triton_poi_fused_add_1.run(buf3, buf2, 512, stream=stream0)
                del buf2
            return (buf3, )

    runner = Runner(partitions=[])
    call = runner.call
    ''')


def module(add_writes: str = "in_out_ptr0") -> str:
    return MODULE.replace("KIND_ptr0", add_writes)


def by_buffer(lanes: dict[str, int]):
    return lambda writes, sources: next((lanes[w] for w in writes if w in lanes), None)


def body(rewritten: fused_lanes.Rewritten) -> str:
    return textwrap.dedent("\n".join(rewritten.source.splitlines()[1:]))


def test_a_side_lane_waits_for_what_it_reads_and_main_for_the_side_lane():
    """``sin`` and ``mm_1`` on lane 1: it forks from the main lane's entry; the in-place ``add``
    (``in_out_ptr0``: buf3 is buf1's values, updated) waits for ``mm_1``'s buffer; buf2, made on
    lane 1 and read on the main one, is freed after the join."""
    done = fused_lanes.rewrite(module(), by_buffer({"buf0": 1, "buf2": 1}))
    assert_expected_inline(body(done), """\
arg0_1, arg1_1, arg2_1 = args
args.clear()
assert_size_stride(arg0_1, (8, 64), (64, 1))
with torch.cuda._DeviceGuard(0):
    torch.cuda.set_device(0)
    _cp_lanes.enter(0)
    _cp_lanes.record(0)
    _cp_lanes.switch(1)
    stream0 = get_raw_stream(0)
    _cp_lanes.wait(0)
    buf0 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [sin, mul], Original ATen: [aten.sin, aten.mul]
    stream0 = get_raw_stream(0)
    triton_poi_fused_mul_sin_0.run(arg0_1, buf0, 512, stream=stream0)
    _cp_lanes.switch(0)
    stream0 = get_raw_stream(0)
    buf1 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
    extern_kernels.mm(arg0_1, arg1_1, out=buf1)
    _cp_lanes.switch(1)
    stream0 = get_raw_stream(0)
    buf2 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [mm_1], Original ATen: [aten.mm]
    extern_kernels.mm(buf0, arg2_1, out=buf2)
    _cp_lanes.record(1)
    del buf0
    buf3 = buf1; del buf1  # reuse
    # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]
    stream0 = get_raw_stream(0)
    _cp_lanes.switch(0)
    stream0 = get_raw_stream(0)
    _cp_lanes.wait(1)
    triton_poi_fused_add_1.run(buf3, buf2, 512, stream=stream0)
    _cp_lanes.leave()
    del buf2
return (buf3, )""")
    assert done.held == ["buf2"] and done.lanes == [1] and (done.records, done.waits) == (2, 2)


def test_an_in_place_update_on_another_lane_waits_for_the_values_it_updates():
    """``add`` on lane 1 updates buf3 in place, and buf3 is buf1, written by ``mm`` on the main
    lane: the reuse stays, and lane 1 waits for ``mm``."""
    done = fused_lanes.rewrite(module(), by_buffer({"buf0": 1, "buf2": 1, "buf3": 1}))
    lines = body(done).splitlines()
    mm = next(i for i, line in enumerate(lines) if "out=buf1" in line)
    assert lines[mm + 1].strip() == "_cp_lanes.record(1)"
    add = next(i for i, line in enumerate(lines) if "triton_poi_fused_add_1.run" in line)
    assert "buf3 = buf1; del buf1  # reuse" in [x.strip() for x in lines[mm:add]]
    assert "_cp_lanes.wait(1)" in [x.strip() for x in lines[mm:add]]


def test_a_reuse_that_only_writes_gets_its_own_block_on_another_lane():
    """The same reuse where ``add`` only writes buf3 (``out_ptr0``): memory reused, no values:
    on lane 1 it gets a block of its own, allocated as buf1 was, and lane 1 waits for nothing
    of the main lane's."""
    done = fused_lanes.rewrite(module("out_ptr0"), by_buffer({"buf0": 1, "buf2": 1, "buf3": 1}))
    text = body(done)
    assert "buf3 = empty_strided_cuda((8, 64), (64, 1), torch.float32)" in text and "# reuse" not in text
    assert done.waits == 1  # the fork from the main lane's entry


def test_one_lane_is_the_code_as_inductor_wrote_it():
    """Nothing on a side lane: no switch, record or wait; the module keeps one lane's body and
    runs it while no side stream is bound."""
    new, done = fused_lanes.rewrite_module(module(), by_buffer({}))
    assert (done.switches, done.records, done.waits, done.held, done.lanes) == (0, 0, 0, [], [])
    assert "def _cp_one_call(self, args):" in new and "if _cp_lanes.active():" in new
    compile(new, "<rewritten>", "exec")


def test_a_module_without_call_is_refused():
    with pytest.raises(fused_lanes.RewriteError, match="no `def call"):
        fused_lanes.rewrite("x = 1\n", by_buffer({}))


def test_the_order_check_finds_what_a_rewrite_must_not_leave_out():
    """:func:`fused_lanes.check` runs the lanes' calls on vector clocks, apart from the rewrite:
    a removed wait, a free moved before the join and a side lane that never forks are found."""
    done = fused_lanes.rewrite(module(), by_buffer({"buf0": 1, "buf2": 1}))
    assert fused_lanes.check(done.source, module()) == []
    no_wait = done.source.replace("    _cp_lanes.wait(1)\n", "")
    assert fused_lanes.check(no_wait, module()) == [
        "lane 0 uses buf2, written on lane 1 with no event after: "
        "triton_poi_fused_add_1.run(buf3, buf2, 512, stream=stream0)"]
    early = done.source.replace("    _cp_lanes.leave()\n            del buf2\n", "    del buf2\n            _cp_lanes.leave()\n")
    assert fused_lanes.check(early, module()) == [
        "buf2 freed before lane 1, which allocated it, waits for its use on lanes [0]"]
    no_fork = done.source.replace("    _cp_lanes.wait(0)\n", "")
    assert "lane 1 allocates before it waits for the main lane" in fused_lanes.check(no_fork, module())[0]


CHAIN = textwrap.dedent('''\
    triton_poi_fused_sin_0 = async_compile.triton('triton_poi_fused_sin_0', """
    @triton.jit
    def triton_poi_fused_sin_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')

    def call(args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
            # Topologically Sorted Source Nodes: [sin], Original ATen: [aten.sin]
            stream0 = get_raw_stream(0)
            triton_poi_fused_sin_0.run(arg0_1, buf0, 512, stream=stream0)
            buf1 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
            # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
            extern_kernels.mm(buf0, arg1_1, out=buf1)
            del buf0
            buf2 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
            # Topologically Sorted Source Nodes: [mm_1], Original ATen: [aten.mm]
            extern_kernels.mm(buf1, arg2_1, out=buf2)
            del buf1
            buf3 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
            # Topologically Sorted Source Nodes: [sin_1], Original ATen: [aten.sin]
            stream0 = get_raw_stream(0)
            triton_poi_fused_sin_0.run(arg0_1, buf3, 512, stream=stream0)
        return (buf2, buf3, )
    ''')


def test_a_block_read_on_another_lane_is_freed_once_its_lane_waits_for_that_read():
    """Lanes take turns, as layers do: ``sin`` on lane 1 makes buf0, ``mm`` on the main lane reads
    it, ``mm_1`` on lane 1 reads ``mm``'s result. buf0 goes back to lane 1's stream right after
    lane 1 waits for ``mm`` (every later use of the block on lane 1 is then after the read), not
    at the join. buf1, made on the main lane and read on lane 1, waits for the join: the main
    lane never waits for ``mm_1`` before it. ``sin_1``, on the main lane, may take neither."""
    done = fused_lanes.rewrite(CHAIN, by_buffer({"buf0": 1, "buf2": 1}))
    assert_expected_inline(body(done), """\
arg0_1, arg1_1, arg2_1 = args
args.clear()
with torch.cuda._DeviceGuard(0):
    torch.cuda.set_device(0)
    _cp_lanes.enter(0)
    _cp_lanes.record(0)
    _cp_lanes.switch(1)
    stream0 = get_raw_stream(0)
    _cp_lanes.wait(0)
    buf0 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [sin], Original ATen: [aten.sin]
    stream0 = get_raw_stream(0)
    triton_poi_fused_sin_0.run(arg0_1, buf0, 512, stream=stream0)
    _cp_lanes.record(1)
    _cp_lanes.switch(0)
    stream0 = get_raw_stream(0)
    buf1 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
    _cp_lanes.wait(1)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    _cp_lanes.record(2)
    _cp_lanes.switch(1)
    stream0 = get_raw_stream(0)
    buf2 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [mm_1], Original ATen: [aten.mm]
    _cp_lanes.wait(2)
    del buf0
    extern_kernels.mm(buf1, arg2_1, out=buf2)
    _cp_lanes.switch(0)
    stream0 = get_raw_stream(0)
    buf3 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [sin_1], Original ATen: [aten.sin]
    stream0 = get_raw_stream(0)
    triton_poi_fused_sin_0.run(arg0_1, buf3, 512, stream=stream0)
    _cp_lanes.leave()
    del buf1
return (buf2, buf3, )""")
    assert (done.held, done.moved) == (["buf1"], 1)
    assert fused_lanes.check(done.source, CHAIN) == []
    # The same free before lane 1's wait: lane 1 could hand buf0 to an allocation that runs while
    # ``mm`` still reads it.
    early = done.source.replace("_cp_lanes.wait(2)\n        del buf0\n", "del buf0\n        _cp_lanes.wait(2)\n")
    assert early != done.source and fused_lanes.check(early, CHAIN) == [
        "buf0 freed before lane 1, which allocated it, waits for its use on lanes [0]"]


def test_a_free_moves_within_its_block_of_code_with_dynamic_shapes():
    """With dynamic shapes Inductor binds the sizes (``s0 = arg3_1``) before the device's block:
    the lanes' entry then stands outside that block, and a free inside it still moves to its
    lane's wait, inside it too. A wait in another block (after the code left the del's) never
    takes a free: there it may not run."""
    dynamic = CHAIN.replace("arg0_1, arg1_1, arg2_1 = args\n    args.clear()\n",
                            "arg0_1, arg1_1, arg2_1, arg3_1 = args\n    args.clear()\n    s0 = arg3_1\n")
    assert dynamic != CHAIN
    done = fused_lanes.rewrite(dynamic, by_buffer({"buf0": 1, "buf2": 1}))
    static = fused_lanes.rewrite(CHAIN, by_buffer({"buf0": 1, "buf2": 1}))
    assert (done.held, done.moved) == (static.held, static.moved) == (["buf1"], 1)
    assert fused_lanes.check(done.source, dynamic) == []
    lines = [x.strip() for x in body(done).splitlines()]
    assert lines.index("del buf0") == lines.index("_cp_lanes.wait(2)") + 1
    # The second product in a block of its own: lane 1's wait there cannot free buf0.
    split = CHAIN.replace("        buf2 = empty_strided_cuda", "    with torch.cuda._DeviceGuard(0):\n        buf2 = empty_strided_cuda")
    split = split.replace("        extern_kernels.mm(buf1, arg2_1, out=buf2)\n",
                          "        extern_kernels.mm(buf1, arg2_1, out=buf2)\n    with torch.cuda._DeviceGuard(0):\n")
    assert split.count("_DeviceGuard") == 3
    done = fused_lanes.rewrite(split, by_buffer({"buf0": 1, "buf2": 1}))
    assert (sorted(done.held), done.moved) == (["buf0", "buf1"], 0)
    assert fused_lanes.check(done.source, split) == []


def _inductor_code(dynamic: bool = False) -> str:
    """The output code of a host compile with two chains of products, in-place updates and
    planned reuses (the host's code has the same lines around its C++ kernels); with
    ``dynamic``, the sizes bound from the arguments first."""
    import torch

    from capturepass.backends.inline_check import CodeCapture

    def f(x, w, v):
        a = torch.relu(x @ w)
        b = torch.sigmoid(x @ v)
        for _ in range(2):
            a = torch.tanh(a @ w) + a
            b = (b @ v) * b
        return a.sum(0) + b.mean(0), a - b

    torch._dynamo.reset()
    with CodeCapture() as code, torch.no_grad():
        torch.compile(f, backend="inductor", dynamic=dynamic, options={"fx_graph_cache": False})(
            torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32))
    torch._dynamo.reset()
    (text,) = [c for c in code.codes if "def call(" in c]
    return text


@pytest.fixture(scope="module", params=[False, True], ids=["static", "dynamic"])
def inductor_code(request) -> str:
    return _inductor_code(request.param)


def test_every_lane_assignment_of_real_inductor_code_checks_clean(inductor_code):
    """Whatever lane each buffer's launch takes (three lanes, drawn), the rewrite of a real
    Inductor compile's ``call`` passes the order check, frees every name the code frees (where
    Inductor did, at a later wait or after the join), and the module it makes compiles. It
    passes the check too with its lanes merged onto fewer streams, as the measured choice's
    lane-map candidates run it (two lanes that share a stream share its free list: a rewrite
    that allocated a buffer on another lane than its first user's raced there on a GPU)."""
    import re

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    buffers = sorted(set(re.findall(r"\bbuf\d+\b", inductor_code)))

    def freed(code: str) -> list[str]:
        return sorted(n.strip() for m in re.finditer(r"\bdel ([\w, ]+?)\s*(?:#.*)?$", code, re.MULTILINE)
                      for n in m.group(1).split(",") if n.strip())

    original = freed("\n".join(fused_lanes.call_body(inductor_code)[2]))
    assert original

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.integers(0, 2), min_size=len(buffers), max_size=len(buffers)))
    def run(lanes):
        lane = dict(zip(buffers, lanes))
        new, done = fused_lanes.rewrite_module(inductor_code, by_buffer(lane))
        assert fused_lanes.check(done.source, inductor_code) == []
        for merged in ({1: 0}, {2: 0}, {2: 1}, {1: 0, 2: 0}):
            on_streams = re.sub(r"_cp_lanes\.switch\((\d+)\)",
                                lambda m: f"_cp_lanes.switch({merged.get(int(m.group(1)), int(m.group(1)))})",
                                done.source)
            assert fused_lanes.check(on_streams, inductor_code) == [], merged
        assert freed(done.source) == original
        compile(new, "<rewritten>", "exec")

    run()


def test_on_the_host_the_fused_route_runs_its_lanes_body_in_program_order(monkeypatch):
    """``regions="fused"`` on the host: one Inductor compile whose code has the lanes written in;
    the owner binds its lanes' body (the lanes' calls do nothing there), and every call equals
    eager with new inputs. The rewrite's summary is one of the graph's decisions."""
    import torch

    from capturepass.backends.compile import last_compiled
    from capturepass.ir import meta
    from capturepass.runtime import code_lanes
    from tests.helpers import two_lanes

    entered: list[int] = []
    real = code_lanes.enter
    monkeypatch.setattr(code_lanes, "enter", lambda device: (entered.append(device), real(device))[1])
    # float64: in float32 Inductor's vectorized sin and exp differ from ATen's by an ulp, which the
    # four products amplify past float32's tolerance for about one input in twelve (plain Inductor
    # as much as this route).
    w = torch.randn(64, 64, dtype=torch.float64) / 8
    compiled = torch.compile(two_lanes, backend="capturepass", options={"regions": "fused", "verify": True})
    for _ in range(3):
        x = torch.randn(64, 64, dtype=torch.float64)
        torch.testing.assert_close(compiled(x, w), two_lanes(x, w))
    graph = last_compiled()[-1]
    assert graph.program.fused and graph.program.code_lanes == 2 == len(meta.graph_info(graph.graph).lanes)
    assert entered == [fused_lanes.HOST] * 3
    (decision,) = [d for d in meta.graph_info(graph.graph).decisions
                   if isinstance(d, str) and d.startswith("one Inductor compile with lanes after fusion")]
    assert "on side lanes" in decision


def test_a_compile_served_from_inductors_cache_keeps_its_lanes(monkeypatch):
    """Inductor's FX graph cache stays on: the post-fusion pass's key covers the lanes, a second
    compile of the same graph loads the rewritten module from the cache, its first line tells
    what the rewrite wrote, and its lanes' body runs. A different lane map is another key."""
    import torch
    from torch._dynamo.utils import counters

    from capturepass.backends.compile import last_compiled
    from capturepass.runtime import code_lanes
    from tests.helpers import two_lanes

    if fused_inductor._scheduler_pass_base() is None:
        pytest.skip("this torch's FX graph cache key takes no scheduler pass: the cache is off for these compiles")
    entered: list[int] = []
    real = code_lanes.enter
    monkeypatch.setattr(code_lanes, "enter", lambda device: (entered.append(device), real(device))[1])
    w = torch.randn(64, 64, dtype=torch.float64) / 8  # float64: see the test above
    x = torch.randn(64, 64, dtype=torch.float64)
    first = None
    for _ in range(2):
        torch._dynamo.reset()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        compiled = torch.compile(two_lanes, backend="capturepass", options={"regions": "fused"})
        torch.testing.assert_close(compiled(x, w), two_lanes(x, w))
        summary = meta_decision(last_compiled()[-1])
        if first is None:
            first = summary
        else:
            assert counters["inductor"]["fxgraph_cache_hit"] > hits
            assert summary == first
        assert last_compiled()[-1].program.code_lanes == 2
    assert entered == [fused_lanes.HOST] * 2
    a, b = fused_inductor.Compiling({"mm": 1, "sin": 0}), fused_inductor.Compiling({"mm": 0, "sin": 0})
    assert a.key() != b.key() and a.key() == fused_inductor.Compiling({"sin": 0, "mm": 1}).key()


def meta_decision(graph) -> str:
    from capturepass.ir import meta

    (decision,) = [d for d in meta.graph_info(graph.graph).decisions
                   if isinstance(d, str) and d.startswith("one Inductor compile with lanes after fusion")]
    return decision


VIEW_REUSE = textwrap.dedent('''\
    triton_poi_a_0 = async_compile.triton('triton_poi_a_0', """
    def triton_poi_a_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')
    def call(args):
        arg0_1, = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((2, 8, 64), (512, 64, 1), torch.float32)
            stream0 = get_raw_stream(0)
            triton_poi_a_0.run(arg0_1, buf0, 1024, stream=stream0)
            buf1 = reinterpret_tensor(buf0, (16, 64), (64, 1), 0); del buf0  # reuse
            stream0 = get_raw_stream(0)
            triton_poi_a_0.run(arg0_1, buf1, 1024, stream=stream0)
            buf2 = buf1; del buf1  # reuse
            stream0 = get_raw_stream(0)
            triton_poi_a_0.run(arg0_1, buf2, 1024, stream=stream0)
        return (buf2, )
    ''')


def test_a_reuse_of_a_view_keeps_the_block_it_cannot_size():
    """``buf2 = buf1`` reuses a view of buf0's block ((16, 64) over a (2, 8, 64) allocation): a
    block of its own would have to be sized as buf1, which no allocation line gives, so the
    reuse stays (found by the architecture sweep: xglm's ``addmm(..., out=buf30)`` resized a
    block allocated as the view's base) and lane 1 waits for it."""
    done = fused_lanes.rewrite(VIEW_REUSE, by_buffer({"buf2": 1}))
    text = body(done)
    assert "buf2 = buf1; del buf1  # reuse" in text and text.count("empty_strided_cuda") == 1
    assert fused_lanes.check(done.source, VIEW_REUSE) == []


def test_a_reuse_of_a_reuse_gets_its_own_block_on_another_lane():
    """``buf2 = buf1`` where buf1 is itself a reuse of buf0 (same sizes and strides, as Inductor
    chains a matmul's outputs): on lane 1 buf2 gets a block allocated as buf0 was, so lane 1
    waits only for its fork, not for the main lane's last use of the block (a wait there
    serialises two lanes of matmul chains)."""
    chained = VIEW_REUSE.replace("reinterpret_tensor(buf0, (16, 64), (64, 1), 0)", "buf0").replace(
        "(2, 8, 64), (512, 64, 1)", "(16, 64), (64, 1)")
    done = fused_lanes.rewrite(chained, by_buffer({"buf2": 1}))
    text = body(done)
    assert "buf2 = empty_strided_cuda((16, 64), (64, 1), torch.float32)" in text
    assert "buf2 = buf1" not in text and done.waits == 1  # the fork from the main lane's entry
    assert fused_lanes.check(done.source, chained) == []


def test_a_rewritten_module_states_its_summary_wherever_inductor_puts_it():
    new, done = fused_lanes.rewrite_module(module(), by_buffer({"buf0": 1, "buf2": 1}))
    want = done.summary()
    assert (want.launches, want.side, want.lanes) == (4, 2, [1])
    assert fused_lanes.Summary.of_module(new) == want
    # Inductor's compile-time tuning block goes before the module's text.
    assert fused_lanes.Summary.of_module('r"""\ntuning\n"""\n' + new) == want
    assert fused_lanes.Summary.of_module(module()) is None


def test_a_compile_with_nothing_on_a_side_lane_keeps_inductors_code():
    """No fused kernel on a side lane: the module is written as Inductor made it (no second
    body, no lanes' calls), and its summary still counts its launches."""
    import torch

    from capturepass.backends.inline_check import CodeCapture

    from torch._inductor import utils as inductor_utils

    # A fresh cache: a compile served by AOT autograd's or Inductor's cache writes no module.
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    torch._dynamo.reset()
    with fresh(), fused_inductor.Compiling({}, host=True) as rewriting, CodeCapture() as code, torch.no_grad():
        torch.compile(lambda x, w: torch.relu(x @ w) + 1, backend="inductor")(torch.randn(8, 8), torch.randn(8, 8))
    torch._dynamo.reset()
    (text,) = [c for c in code.codes if "def call(" in c]
    assert fused_lanes.RUNTIME not in text and fused_lanes.MARK not in text
    (summary,) = rewriting.summaries
    assert summary.side == 0 and summary.launches >= 1


def test_code_the_rewrite_cannot_read_is_compiled_as_written(monkeypatch):
    """A rewrite that raises leaves the module as Inductor wrote it, with the reason among the
    findings the compile logs: the compile does not fail for it."""
    import torch

    def broken(*args, **kwargs):
        raise ValueError("an unexpected line")

    monkeypatch.setattr(fused_inductor, "rewrite_module", broken)
    torch._dynamo.reset()
    with fused_inductor.Compiling({}, host=True) as rewriting, torch.no_grad():
        x, w = torch.randn(8, 8), torch.randn(8, 8)
        got = torch.compile(lambda x, w: torch.relu(x @ w) + 1, backend="inductor",
                            options={"fx_graph_cache": False})(x, w)
    torch._dynamo.reset()
    torch.testing.assert_close(got, torch.relu(x @ w) + 1)
    assert rewriting.findings == ["the rewrite could not read the code (ValueError: an unexpected line)"]
    assert rewriting.summaries == []



def _lanes_of_launches(code: str, launch: str) -> list[int]:
    """The lane current at each line of ``code`` (a lanes' body) that contains ``launch``."""
    lane, found = 0, []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith(f"{fused_lanes.RUNTIME}.switch("):
            lane = int(line[len(f"{fused_lanes.RUNTIME}.switch("):-1])
        elif launch in line:
            found.append(lane)
    return found


def _moe_lanes_code(dump_dir) -> str:
    """The MoE block compiled with lanes after fusion on the host (equal to eager): the lanes'
    body of its one compiled region."""
    import torch

    from capturepass.backends.compile import last_compiled
    from capturepass.testing.models import MoEBlock

    torch.manual_seed(0)
    model = MoEBlock().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="capturepass", options={"regions": "fused", "dump_dir": str(dump_dir)})
    with torch.no_grad():
        x = torch.randn(16, 64)
        torch.testing.assert_close(compiled(x), model(x))
    (code,) = last_compiled()[-1].program.lanes_code
    return code


def test_the_lanes_body_is_in_the_dump_fresh_or_from_inductors_cache(tmp_path):
    """What the GPU runs on the default route is the lanes' body of Inductor's code: the dump shows
    it after the outer program, and a compile served from Inductor's cache shows the same body."""
    bodies = []
    for run in range(2):  # the second compile is served from Inductor's cache, where it has one
        code = _moe_lanes_code(tmp_path / str(run))
        assert code.startswith("def call(") and f"{fused_lanes.RUNTIME}.switch(" in code, code
        (emit,) = (tmp_path / str(run)).glob("*_inference/*_emit.txt")
        text = emit.read_text()
        assert text.index("# outer program") < text.index("# lanes after fusion: compiled region 0's code") \
            and code in text
        bodies.append(code)
    assert bodies[0] == bodies[1]


def test_a_kernel_reading_a_view_of_another_lanes_value_stays_on_its_own_lane(tmp_path):
    """The MoE block's routed experts (up projection, activation, down projection) are one lane in
    the plan; the plan reads the up projection's ``split`` on the main lane, and Inductor lists that
    view among the origins of the activation's kernel and the down projection's. A view launches
    nothing and has no say: both batched products run on the experts' lane (the down projection
    ran on the main lane before)."""
    code = _moe_lanes_code(tmp_path)
    lanes = _lanes_of_launches(code, "extern_kernels.bmm(")
    assert len(lanes) == 2 and lanes[0] == lanes[1] != 0, code


def test_a_library_call_runs_on_the_lane_of_the_op_it_computes():
    """Inductor lists the producers of a library call's inputs among its origins (Qwen2-MoE's
    shared expert projections list the main lane's RMS norm): the call takes the lane of the op
    its IR node computes (``origin_node``), not the vote of its origins, which put the shared
    expert's products on the main lane. A fused kernel of two lanes' nodes still runs on main, and
    a call whose op has no lane (a fallback with several outputs) still takes the vote."""
    import types

    from torch._inductor import ir

    class op:  # an FX node, as far as the lanes read it
        def __init__(self, name):
            self.name = name

    def scheduler_node(buffer, inner_node):
        return types.SimpleNamespace(get_nodes=lambda: [types.SimpleNamespace(node=inner_node)],
                                     get_buffer_names=lambda: [buffer])

    def library_call(origin, origins):
        call = ir.ExternKernel.__new__(ir.ExternKernel)
        object.__setattr__(call, "origin_node", origin)
        object.__setattr__(call, "origins", origins)
        return call

    norm = [op("mean"), op("rsqrt"), op("mul")]
    lanes = {"mean": 0, "rsqrt": 0, "mul": 0, "mm": 2, "bmm": 1, "sin": 1, "topk": 0}
    compiling = fused_inductor.Compiling(lanes)
    compiling._user = None
    pointwise = types.SimpleNamespace(origins={op("mul"), op("sin")})
    nodes = [
        scheduler_node("buf0", library_call(op("mm"), {op("mm"), *norm})),
        scheduler_node("buf1", pointwise),
        scheduler_node("buf2", library_call(None, {op("bmm"), op("sin")})),
        scheduler_node("buf3", library_call(op("getitem"), {op("bmm")})),
    ]
    compiling.after_fusion(nodes)
    assert compiling._buffers == {"buf0": 2, "buf1": 0, "buf2": 1, "buf3": 1}
