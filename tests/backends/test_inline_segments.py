"""One Inductor compile per capture segment, its lanes inline (``regions="segments"``).

On the host the lanes run in program order, so what these tests can see is the graph and the
code Inductor generates: each kernel between the two sync points of its lane (the code after a
point runs on the lane the point makes current; ``capturepass.runtime.inline``), the plan's
records and waits all run, nothing is copied to make the edges, and results equal eager. The
H200 tests (``tests/runtime/test_inline_gpu.py``) run the same route on streams.
"""

from __future__ import annotations

import collections
import logging
import re

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.errors import ResourceError
from capturepass.ir import analysis, meta
from capturepass.ir.plan import StepKind
from capturepass.testing import zoo
from capturepass.testing.models import MoEBlock

from capturepass.backends.inline_check import lane_violations, order_violations

pytestmark = pytest.mark.slow

L = capturepass.lane


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def _compile_and_code(fn, *args, **options):
    compiled = torch.compile(fn, backend="capturepass", options={"regions": "segments", "verify": True, **options})
    out, codes = torch._inductor.utils.run_and_get_code(compiled, *args)
    return compiled, out, codes


def _lane_of_lines(code: str, points) -> list[tuple[int, str]]:
    """Each line of the generated ``call`` with the lane it runs on (0 until the first point)."""
    body = code[code.index("def call("):]
    lane, out = 0, []
    for line in body.splitlines():
        line = line.strip()
        m = re.match(r"torch\.ops\.capturepass\.inline_step\.default\(\d+, (\d+),", line)
        if m:
            lane = points[int(m.group(1))].lane
            continue
        if line and not line.startswith("#"):
            out.append((lane, line))
    return out


def test_a_node_that_reads_only_graph_inputs_stays_on_its_lane():
    """The pattern Inductor moves when nothing orders it: ``exp(x)`` on a side lane reads only
    an input, and unpinned it fuses into the main lane's ``sin(x)`` kernel before the switch."""

    def f(x, w):
        a = torch.sin(x) * 2
        with L("aux"):
            z = torch.exp(x) * 5
            c = torch.cos(a) + 1
        return (torch.tanh(c) * 3) @ w, z

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    _, out, codes = _compile_and_code(f, x, w)
    torch.testing.assert_close(out, f(x, w))
    (region,) = last_compiled()[-1].program.regions
    assert region.inline is not None
    lines = _lane_of_lines(codes[0], region.inline.points)
    kernels = {op: {lane for lane, line in lines if re.match(rf"cpp_fused\w*_{op}_", line)}
               for op in ("sin", "exp", "cos", "tanh")}
    # tanh(c) * 3 fuses with its producer cos(a) + 1: on its lane.
    assert kernels == {"sin": {0}, "exp": {1}, "cos": {1}, "tanh": {1}}, lines


def test_a_segment_compiles_once_and_runs_every_sync_of_the_plan():
    torch.manual_seed(0)
    model, x = MoEBlock(), torch.randn(16, 64)
    with torch.no_grad():
        compiled, out, codes = _compile_and_code(model, x)
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(compiled(x * 2), model(x * 2))
    graph = last_compiled()[-1]
    assert len(meta.graph_info(graph.graph).lanes) > 1
    (region,) = graph.program.regions
    assert len(codes) == 1
    planned = [s.kind for s in graph.plan.steps if s.kind != StepKind.REGION]
    fused = [s.kind for p in region.inline.points for s in p.steps]
    assert fused == planned
    # Every point is in the code once, in order.
    calls = [int(m) for m in re.findall(r"inline_step\.default\(\d+, (\d+),", codes[0])]
    assert calls == list(range(len(region.inline.points)))


def _launches(code: str) -> collections.Counter:
    """How many kernel launches of the code compute each op (by the ops in a kernel's name)."""
    body = code[code.index("def call("):]
    out: collections.Counter = collections.Counter()
    for name in re.findall(r"^\s*(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+)\(", body, re.M):
        words = set(re.split(r"[_.]", name)) - {"cpp", "fused", "inline", "step", "extern", "kernels", "torch", "ops", "aten", "default"}
        out.update(w for w in words if not w.isdigit() and not _is_view(w))
    return out


def _is_view(name: str) -> bool:
    """Whether aten op ``name`` returns a view (a kernel's name lists the views it reads through)."""
    packet = getattr(torch.ops.aten, name, None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    return any(r.alias_info is not None for o in overloads for r in o._schema.returns)


@pytest.mark.parametrize("which", ["moe", "chain"])
def test_the_edges_copy_and_recompute_nothing(which):
    """The points' declared writes are re-inplaced: no kernel copies a guarded value, and the
    one compile launches no more kernels than the lane regions compiled one by one (a value
    that Inductor could not re-inplace would be recomputed or cloned into a kernel of its own)."""
    torch.manual_seed(0)
    if which == "moe":
        fn, args = MoEBlock(), (torch.randn(16, 64),)
    else:
        def fn(x, w):
            a = torch.sin(x) * 2
            with L("aux"):
                z = torch.exp(x) * 5
                c = torch.cos(a) + 1
            return (torch.tanh(c) * 3) @ w, z + a
        args = (torch.randn(64, 64), torch.randn(64, 64))
    with torch.no_grad():
        _, _, codes = _compile_and_code(fn, *args)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="capturepass", options={"regions": "lanes"})
        _, region_codes = torch._inductor.utils.run_and_get_code(compiled, *args)
    (code,) = codes
    assert not re.search(r"clone|copy_", code[code.index("def call("):]), code
    assert len(region_codes) > 1
    fused = _launches(code)
    regions = sum((_launches(c) for c in region_codes), collections.Counter())
    extra = {op: n for op, n in fused.items() if n > regions[op]}
    assert not extra, (extra, fused, regions)


def test_a_constant_on_a_side_lane_moves_to_the_start_and_is_ordered():
    def f(x):
        s = x.sin()
        with L("aux"):
            t = torch.full((64, 64), 2.0) + torch.arange(64.0)
            y = (t * x) @ t
        return s + y

    x = torch.randn(64, 64)
    _, out, codes = _compile_and_code(f, x)
    torch.testing.assert_close(out, f(x))
    (region,) = last_compiled()[-1].program.regions
    assert region.inline is not None
    assert not re.search(r"clone|copy_", codes[0][codes[0].index("def call("):])


def test_random_numbers_on_a_side_lane_keep_the_lane_regions(caplog):
    def f(x):
        s = x.sin()
        with L("aux"):
            y = torch.rand(64, 64) @ x
        return s, y

    x = torch.randn(64, 64)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        compiled = torch.compile(f, backend="capturepass", options={"regions": "segments"})
        s, y = compiled(x)
    torch.testing.assert_close(s, x.sin())
    assert y.shape == (64, 64)
    assert len(last_compiled()[-1].program.regions) > 1
    assert "draws random numbers: it cannot move; compiled as lane regions" in caplog.text


def test_dynamic_sizes():
    def f(x, w):
        a = x.sin()
        with L("aux"):
            b = (x.cos() @ w).relu()
        return a.sum(-1, keepdim=True) + b

    compiled = torch.compile(f, backend="capturepass", dynamic=True, options={"regions": "segments", "verify": True})
    w = torch.randn(32, 32)
    for n in (3, 5, 9):
        x = torch.randn(n, 32)
        torch.testing.assert_close(compiled(x, w), f(x, w))
    assert any(r.inline is not None for r in last_compiled()[-1].program.regions)


def test_a_constant_sized_by_a_tensor_of_the_segment_moves_to_the_start():
    """``arange(t.numel())`` on a side lane, ``t`` computed in the segment: the size is computed
    again from the inputs that bind its symbols, and the constant moves to the start with it
    (before, such a run kept its lane regions: MoE routing under ``dynamic=True``)."""
    def f(x, w):
        a = x.sin()
        with L("aux"):
            t = (x.cos() @ w).flatten()
            b = t + torch.arange(t.numel(), dtype=t.dtype, device=t.device)
        return a.sum() + b

    compiled = torch.compile(f, backend="capturepass", dynamic=True, options={"regions": "segments", "verify": True})
    w = torch.randn(32, 32)
    for n in (3, 5, 9):
        x = torch.randn(n, 32)
        torch.testing.assert_close(compiled(x, w), f(x, w))
    (region,) = last_compiled()[-1].program.regions
    assert region.inline is not None and len({p.lane for p in region.inline.points}) == 2
    nodes = list(region.graph.graph.nodes)
    first_point = next(i for i, n in enumerate(nodes) if n.target is torch.ops.capturepass.inline_step.default)
    assert any(n.target is torch.ops.prims.iota.default for n in nodes[:first_point])


def test_a_size_read_from_a_tensor_of_the_segment_is_computed_from_the_inputs():
    """MoE routing's shape under ``dynamic=True`` (as in Qwen2-MoE): a buffer sized by
    ``sym_size`` of a view computed in the segment; the fused graph computes that size from the
    graph's inputs, and the buffer moves to the start with it."""
    def f(x, w):
        a = x.sin()
        with L("aux"):
            idx = torch.topk(x @ w, 2).indices.view(-1)
            ones = torch.ones_like(idx, dtype=x.dtype)
            counts = torch.zeros(idx.shape[0], dtype=x.dtype).index_add_(0, idx % idx.shape[0], ones)
        return a.sum() + counts.sum()

    compiled = torch.compile(f, backend="capturepass", dynamic=True, options={"regions": "segments", "verify": True})
    w = torch.randn(32, 32)
    for n in (3, 5, 9):
        x = torch.randn(n, 32)
        torch.testing.assert_close(compiled(x, w), f(x, w))
    graph = last_compiled()[-1]
    read = [n for n in graph.graph.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert read and all(n.args[0].op != "placeholder" for n in read)  # the case: a size of a segment's tensor
    (region,) = graph.program.regions
    assert region.inline is not None
    sizes = [n for n in region.graph.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert all(n.args[0].op == "placeholder" for n in sizes)


def test_the_op_refuses_to_run_outside_its_runner():
    with pytest.raises(ResourceError, match="ran outside its runner"):
        torch.ops.capturepass.inline_step(12345, 0, [], [torch.empty(0)])


def _points_of(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.capturepass.inline_step.default]


def _no_view_crosses_a_point(gm: torch.fx.GraphModule) -> list[str]:
    """Views read after a sync point that follows them (functionalization would rebuild them
    from the written base, with copies Inductor places on either lane)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    points = [order[p] for p in _points_of(gm)]
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or analysis.aliases_input(node) is None:
            continue
        nxt = next((p for p in points if p > order[node]), None)
        late = [u.name for u in node.users if nxt is not None and order[u] > nxt]
        if late:
            out.append(f"%{node.name} read after the point that follows it by {late}")
    return out


def _read_later_is_guarded(gm: torch.fx.GraphModule) -> list[str]:
    """Values computed between two points and read after the second that it does not guard."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    points = _points_of(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in points or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        closing = next((p for p in points if order[p] > order[node]), None)
        if closing is None or not any(order[u] > order[closing] for u in node.users if u.op != "output"):
            continue
        storage = StorageWeakRef(node.meta["val"].untyped_storage())
        if not any(StorageWeakRef(g.meta["val"].untyped_storage()) == storage
                   for g in closing.args[3] if isinstance(g.meta.get("val"), torch.Tensor)):
            out.append(f"%{node.name}")
    return out


@pytest.mark.parametrize("name", ["qwen3", "mistral", "phi", "gemma2"])
def test_zoo_code_reads_after_writes_and_frees_nothing_another_lane_uses(name):
    """On the generated code of transformers decoders (Qwen3 and Mistral, whose captured inline
    replays were wrong on the H200; Phi and Gemma2, where two of the causes showed on the host;
    the zoo's "segments" set checks the other models' results): the segment is fused, every
    cross-lane read is ordered after its write by the plan's events, no buffer another lane uses
    is freed before the segment ends, no view crosses a sync point, every value read after its
    block's closing point is guarded there, and the results equal eager."""
    model, make_inputs = zoo.build(name)
    compiled = torch.compile(model, backend="capturepass", options={"regions": "segments"})
    with torch.no_grad():
        want = zoo.output_tensors(model(**make_inputs(1)))
        out, codes = torch._inductor.utils.run_and_get_code(lambda: compiled(**make_inputs(1)))
    got = zoo.output_tensors(out)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **zoo.TOLERANCE["cpu"])
    fused = [r for r in last_compiled()[-1].program.regions if r.inline is not None]
    inline_codes = [c for c in codes if "inline_step.default(" in c]
    assert fused and len(inline_codes) == len(fused)
    for region, code in zip(fused, inline_codes):
        assert lane_violations(code, region.inline.points) == []
        assert order_violations(code, region.inline.points) == []
        assert _no_view_crosses_a_point(region.graph) == []
        assert _read_later_is_guarded(region.graph) == []


def test_the_op_takes_any_layout():
    """Held to its fake values' strides, a guard Inductor had laid out otherwise was written in
    one layout and read in the other (Gemma2's repeated keys, wrong by 0.03 on the host)."""
    if not hasattr(torch.Tag, "flexible_layout"):
        pytest.skip("this torch has no flexible_layout tag")
    assert torch.Tag.flexible_layout in torch.ops.capturepass.inline_step.default.tags


def test_inputs_that_share_a_storage_are_not_guarded():
    """A write declared on one of two inputs that share a storage makes AOT autograd merge them
    into a synthetic base rebuilt at every call (a captured Mistral broke on it on the H200)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from capturepass.backends.inline import _Roots

    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        base = mode.from_tensor(torch.zeros(4, 8))
        a, b, c = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("c")
        a.meta["val"], b.meta["val"], c.meta["val"] = base[0], base[1:], torch.empty(3)
        d = graph.call_function(torch.ops.aten.sin.default, (c,))
        d.meta["val"] = torch.empty(3)
    roots = _Roots([a, b, c, d], {a, b, c})
    assert roots.is_shared(a) and roots.is_shared(b) and not roots.is_shared(c) and not roots.is_shared(d)
    assert roots(b) is a and roots(d) is d


def test_the_code_checks_find_what_they_look_for():
    """Synthetic code: a buffer written on lane 1 and read on lane 0 with no event between, then
    freed before the last point."""
    from capturepass.ir.plan import SyncPoint

    points = [SyncPoint((), 1, ()), SyncPoint((), 0, ()), SyncPoint((), 0, ())]
    code = """def call(self, args):
        buf0 = empty_strided_cuda((0, ), (1, ), torch.uint8)
        torch.ops.capturepass.inline_step.default(7, 0, [], [buf0])
        buf1 = empty_strided_cuda((4, ), (1, ), torch.float32)
        triton_poi_fused_sin_0.run(arg0_1, buf1, 4, stream=stream0)
        torch.ops.capturepass.inline_step.default(7, 1, [], [buf0, buf1])
        buf2 = empty_strided_cuda((4, ), (1, ), torch.float32)
        triton_poi_fused_cos_1.run(buf1, buf2, 4, stream=stream0)
        del buf1
        torch.ops.capturepass.inline_step.default(7, 2, [], [buf0])
        return (buf2, )
"""
    assert len(order_violations(code, points)) == 1
    assert lane_violations(code, points) == ["buf1 allocated on s1, used on s[0], freed at line 8 before the last point"]


_SORTED = """def call(self, args):
        buf0 = empty_strided_cuda((0, ), (1, ), torch.uint8)
        torch.ops.capturepass.inline_step.default(7, 0, [], [buf0])
        buf5 = torch.ops.aten.sort.stable(arg0_1, stable=False, dim=0, descending=False)
        buf6 = buf5[0]
        buf7 = buf5[1]
        del buf5
        triton_poi_fused_index_0.run(buf7, buf8, 4, stream=stream0)
        torch.ops.capturepass.inline_step.default(7, 1, [], [buf0, buf6, buf7])
        triton_poi_fused_cos_1.run(buf6, buf9, 4, stream=stream0)
        torch.ops.capturepass.inline_step.default(7, 2, [], [buf0])
        del FREED
        torch.ops.capturepass.inline_step.default(7, 3, [buf6], [buf0])
        return (buf9, )
"""


def test_the_items_of_an_op_with_several_new_results_are_buffers_of_their_own():
    """``aten.sort`` on lane 1 returns values and indices, two new tensors (the code Inductor
    generated for Qwen2-MoE's router at a dynamic prefill shape on the H200): the values are read
    on lane 0, the indices only on lane 1. Freeing the indices before the last point frees nothing
    lane 0 reads, and dropping the tuple frees nothing at all; freeing the values would."""
    from capturepass.ir.plan import SyncPoint

    points = [SyncPoint((), 1, ()), SyncPoint((), 0, ()), SyncPoint((), 1, ()), SyncPoint((), 0, ())]
    assert lane_violations(_SORTED.replace("FREED", "buf7"), points) == []
    assert lane_violations(_SORTED.replace("FREED", "buf6"), points) == [
        "buf6 allocated on s1, used on s[0], freed at line 11 before the last point"]
    # An op whose results may alias its input: an item stays a view of the whole result.
    split = _SORTED.replace("torch.ops.aten.sort.stable(arg0_1, stable=False, dim=0, descending=False)",
                            "torch.ops.aten.split.Tensor(arg0_1, 2)")
    assert lane_violations(split.replace("FREED", "buf7"), points) == [
        "buf5 allocated on s1, used on s[0], freed at line 11 before the last point"]


def test_a_sort_whose_values_and_indices_go_to_two_lanes_compiles_once(caplog):
    """Through Inductor: ``sort`` on a side lane, its values read on the main lane, then its
    indices used and freed on the side lane before the run ends. Taking the two items for one
    buffer made this a lane finding and six lane regions (Qwen2-MoE's router: 60 on the H200)."""

    def f(x, w):
        with L("aux"):
            v, i = torch.sort(x.flatten())
        a = (v.view(16, 16) @ w).sin()
        with L("aux"):
            j = i.view(16, 16).remainder(7).float() * a
            k = (j @ w).relu()
        b = (a @ w).cos()
        return b @ w + k

    x, w = torch.randn(16, 16), torch.randn(16, 16)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        _, out, codes = _compile_and_code(f, x, w)
    torch.testing.assert_close(out, f(x, w))
    assert "lane regions" not in caplog.text
    (region,) = last_compiled()[-1].program.regions
    assert len({p.lane for p in region.inline.points}) == 2
    assert re.search(r"(buf\d+) = torch\.ops\.aten\.sort\.\w+\(", codes[0])


_FIRST_PIECE = """
def partition_0(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cuda((0, ), (1, ), torch.uint8)
    torch.ops.capturepass.lane_step.default(True, False, [], 1, [], [buf0])
    buf1 = empty_strided_cuda((4, ), (1, ), torch.float32)
    triton_poi_fused_sin_0.run(arg0_1, buf1, 4, stream=stream0)
    torch.ops.capturepass.lane_step.default(False, False, [0, 1, 0], 0, [], [buf0, buf1])
    buf2 = empty_strided_cuda((4, ), (1, ), torch.float32)
    triton_poi_fused_cos_1.run(READ, buf2, 4, stream=stream0)
"""
_LAST_POINT = """    torch.ops.capturepass.lane_step.default(False, True, [], 0, [buf1], [buf0])
"""
_RUNNER = """    return (buf0, buf1, buf2, )


class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, = args
        args.clear()
        partition0_args = [arg0_1, ]
        del arg0_1
        (buf0, buf1, buf2, ) = self.partitions[0](partition0_args)
        del partition0_args
CALLS        return (buf2, )


runner = Runner(partitions=[PARTITIONS])
call = runner.call
"""


def test_the_code_checks_read_the_pieces_inductor_captures_apart():
    """Under Inductor's CUDA graphs (``mode="reduce-overhead"``) the code is partitioned: ``call``
    calls ``self.partitions[N]``, whose bodies hold the sync calls (the layout of
    ``torch/_inductor/codegen/wrapper.py``). The checks follow the calls into them; points split
    over two partitions, each captured on its own, are a finding."""
    from capturepass.backends.inline_check import findings
    from capturepass.ir.plan import SyncPoint

    points = [SyncPoint((), 1, ()), SyncPoint((), 0, ()), SyncPoint((), 0, ())]
    one = (_FIRST_PIECE + _LAST_POINT + _RUNNER).replace("CALLS", "").replace("PARTITIONS", "partition_0,")
    assert findings([one.replace("READ", "arg0_1")], points, op="lane_step") == []
    # Lane 0 reads what lane 1 wrote, and no point waits for it: seen inside the partition.
    assert findings([one.replace("READ", "buf1")], points, op="lane_step") == [
        "line 13 on s0 reads buf1, written on s1 with no event after: "
        "triton_poi_fused_cos_1.run(buf1, buf2, 4, stream=stream0)"]
    second = "\n\ndef partition_1(args):\n    buf0, buf1 = args\n    args.clear()\n" + _LAST_POINT + "    return ()\n"
    calls = "        partition1_args = [buf0, buf1]\n        () = self.partitions[1](partition1_args)\n"
    split = (_FIRST_PIECE + _RUNNER.replace("\n\nclass", second + "\n\nclass")).replace("CALLS", calls)
    split = split.replace("PARTITIONS", "partition_0, partition_1").replace("READ", "arg0_1")
    assert findings([split], points, op="lane_step") == [
        "Inductor's generated code splits the sync points over 2 pieces it captures apart (partition_0, partition_1)"]


def test_a_fused_segment_whose_code_fails_the_lane_checks_keeps_its_lane_regions(caplog, monkeypatch):
    """The driver's answer to a finding (the checks stand in for a miscompile here: the ones they
    found, on Phi and on the H200, are fixed): the lane regions, compiled one by one, equal to
    eager, and the finding in the log."""
    import capturepass.backends.compile as driver

    monkeypatch.setattr(driver, "findings", lambda codes, points: ["line 7 on s1 reads buf3, written on s0"])
    model, make_inputs = zoo.build("qwen3")
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        compiled = torch.compile(model, backend="capturepass", options={"regions": "segments"})
        with torch.no_grad():
            got = zoo.output_tensors(compiled(**make_inputs(1)))
            want = zoo.output_tensors(model(**make_inputs(1)))
    for key in want:
        torch.testing.assert_close(got[key], want[key], **zoo.TOLERANCE["cpu"])
    assert "fails its lane checks (line 7 on s1 reads buf3, written on s0); compiled as lane regions instead" \
        in caplog.text
    regions = last_compiled()[-1].program.regions
    assert len(regions) > 1 and all(r.inline is None for r in regions)


def test_a_view_whose_base_a_release_reads_is_not_guarded(caplog):
    """After a break, a region reads a view made before it while the base's own lane releases
    the base: the view and the base are two inputs of the fused graph over one storage. A guard
    on the view made AOT autograd merge them into a synthetic base, which failed under dynamic
    shapes on torch 2.11 (DeBERTa-v2's keys on the H200); the run keeps its lane regions."""

    def f(x, w):
        with L("aux0"):
            a = (x @ w).relu()
        v = a.view(-1, 4)
        s = x.abs().mean().item()  # a host read: a break between two segments
        out = (v * torch.full_like(v, s)).sin()
        with L("aux0"):
            b = (x @ w).cos()  # the base's lane works on after the view's last read: a release
        return out, b

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), caplog.at_level("INFO", logger="capturepass"):
        compiled = torch.compile(f, backend="capturepass", options={
            "regions": "segments", "cudagraphs": "breakable", "policy": "hints", "verify": True})
        for seed in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x, w), f(x, w))
    plan = last_compiled()[-1].plan
    assert any(s.kind == StepKind.RELEASE for s in plan.steps)
    assert "%view shares its storage with another input of the run and cannot be guarded" in caplog.text
