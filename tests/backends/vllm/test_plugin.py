"""The vLLM integration without vLLM: the plugin function, options from the environment,
the post-grad pass and the serializable backend result (torch's AOT compile, save and load)."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch._dynamo.backends import registry

import capturepass
from capturepass.backends.vllm import kernels
from capturepass.backends.vllm import plugin as vllm_plugin
from capturepass.backends import dynamo
from capturepass.errors import OptionError
from capturepass.ir.capabilities import REGISTRY
from capturepass.ir.options import Options


@pytest.fixture(autouse=True)
def _kernels_undeclared_after(monkeypatch):
    """The plugin declares vLLM's kernels in the process-wide registry and registers its backend
    under the name "capturepass": both undone after each test."""
    before = {name for name in kernels.SAFE_KERNELS if REGISTRY.declared(name)}
    monkeypatch.setattr(vllm_plugin, "_declared_kernels", False)
    yield
    for name in kernels.SAFE_KERNELS:
        if name not in before:
            REGISTRY.unregister(name)
    dynamo.register()  # the plain backend under the name "capturepass" again


@pytest.fixture(autouse=True)
def _inductor_options_back():
    """A pass called outside a compile leaves Inductor's lane-blind options off until the next
    graph it sees (within a compile, Dynamo's end restores them)."""
    yield
    from capturepass.backends import post_grad

    post_grad.restore_options()


def test_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"policy": "off", "capture_sizes": [4, 8]}')
    opts = Options.from_mapping(None)
    assert opts.policy == "off" and opts.capture_sizes == (8, 4)
    assert Options.from_mapping({"policy": "hints"}).policy == "hints"  # code wins
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", "{policy: off}")
    with pytest.raises(OptionError, match="CAPTUREPASS_OPTIONS"):
        Options.from_mapping(None)
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", "[1]")
    with pytest.raises(OptionError, match="JSON object"):
        Options.from_mapping(None)
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"polcy": "off"}')
    with pytest.raises(OptionError, match="polcy"):
        Options.from_mapping(None)


def test_top_level_names_vllm_resolves():
    # vLLM resolves inductor_passes with __import__(module).__dict__[name], and backends by attribute.
    assert capturepass.__dict__["post_grad_pass"] is vllm_plugin.post_grad_pass
    assert callable(capturepass.__dict__["backend"])


def test_import_capturepass_stays_light():
    code = "import sys, capturepass; print(sorted(m for m in ('vllm', 'capturepass.backends.vllm.compiled') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_plugin_registers_the_backend_idempotently():
    try:
        vllm_plugin.register()
        first = dict(registry._COMPILER_FNS)
        vllm_plugin.register()
        assert registry._COMPILER_FNS == first
        assert registry.lookup_backend("capturepass") is vllm_plugin.backend
    finally:
        dynamo.register()
    assert registry.lookup_backend("capturepass") is dynamo.capturepass_backend


def test_plugin_declares_vllms_plain_kernels():
    vllm_plugin.register()
    vllm_plugin.register()
    assert all(REGISTRY.declared(name) for name in kernels.SAFE_KERNELS)
    # Hidden state through vLLM's forward context, or communication: left serialized.
    for name in ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update", "vllm::moe_forward",
                 "vllm::all_reduce", "_C::cpu_fused_moe"):
        assert not REGISTRY.declared(name)


@torch.library.custom_op("cptest_vllm::norm", mutates_args=("out",))
def _norm(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x)


@torch.library.custom_op("cptest_vllm::act", mutates_args=("out",))
def _act(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x)


def test_declared_kernels_run_beside_other_lanes_and_a_users_own_declaration_is_kept(monkeypatch):
    from capturepass.ir import meta

    monkeypatch.setattr(kernels, "SAFE_KERNELS", ("cptest_vllm::norm", "cptest_vllm::act"))
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda out, x: (torch.ops.cptest_vllm.norm(out, x), torch.ops.cptest_vllm.act(out, x)))(
        torch.empty(2), torch.ones(2))
    norm, act = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert REGISTRY.query(act).overlap is meta.Overlap.SERIALIZE  # undeclared custom op
    REGISTRY.register("cptest_vllm::norm", overlap="serialize")  # the user's own
    try:
        assert kernels.declare() == ["cptest_vllm::act"]
        assert REGISTRY.query(norm).overlap is meta.Overlap.SERIALIZE
        assert REGISTRY.query(act).overlap is meta.Overlap.SAFE
    finally:
        REGISTRY.unregister("cptest_vllm::norm")
        REGISTRY.unregister("cptest_vllm::act")


def test_plugin_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "capturepass"]
    assert ep.load() is vllm_plugin.register


def _post_grad_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, w2):
        return torch.relu(x @ w1) + torch.sigmoid(x @ w2)

    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    return make_fx(f, tracing_mode="fake")(*args)


def test_post_grad_pass_dumps_and_leaves_a_host_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_DUMP_DIR", str(tmp_path))
    gm = _post_grad_graph()
    before = gm.code
    metas = [dict(n.meta) for n in gm.graph.nodes]
    capturepass.post_grad_pass(gm.graph)
    assert gm.code == before
    assert [dict(n.meta) for n in gm.graph.nodes] == metas
    (piece,) = [p for p in tmp_path.iterdir() if p.name.startswith("post_grad_")]
    names = sorted(p.name for p in piece.iterdir())
    assert "009_verify.txt" in names and "003_assign_streams.txt" in names and "010_emit.txt" in names
    assert "lane=s1" in (piece / "009_verify.txt").read_text()  # two independent matmuls, two lanes
    said = (piece / "post_grad.txt").read_text().splitlines()[0]
    assert said == '# left as it was: a host graph runs its lanes in program order (regions="segments" writes them anyway)'


def _lane_steps(graph):
    return [n for n in graph.nodes if n.target is torch.ops.capturepass.lane_step.default]


def test_post_grad_pass_writes_the_lanes_into_the_graph(tmp_path, monkeypatch, caplog):
    """With ``regions="segments"`` on the host: the graph Inductor would compile is the plan's
    order with a ``lane_step`` at each sync point, which carries its records and waits; it
    computes what the graph computed."""
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments", "verify": true}')
    monkeypatch.setenv("CAPTUREPASS_DUMP_DIR", str(tmp_path))
    gm = _post_grad_graph()
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    want = gm(*args)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        capturepass.post_grad_pass(gm.graph)
    gm.recompile()
    # Inductor lowers a post-grad graph by its nodes' fake values: the rewrite's own nodes have theirs.
    assert [n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta] == []
    calls = _lane_steps(gm.graph)
    assert len(calls) >= 2
    flags = [(n.args[0], n.args[1]) for n in calls]
    assert flags == [(True, False)] + [(False, False)] * (len(calls) - 2) + [(False, True)]
    steps = [n.args[2] for n in calls]
    assert all(len(s) % 3 == 0 and set(s[0::3]) <= {0, 1} for s in steps)
    records = [tuple(s[i + 1: i + 3]) for s in steps for i in range(0, len(s), 3) if s[i] == 0]
    waits = [s[i + 2] for s in steps for i in range(0, len(s), 3) if s[i] == 1]
    assert records and sorted(waits) == sorted(slot for _, slot in records)  # each event waited once
    assert {n.args[3] for n in calls} == {0, 1} and calls[-1].args[3] == 0
    torch.testing.assert_close(gm(*args), want)
    (piece,) = [p for p in tmp_path.iterdir() if p.name.startswith("post_grad_")]
    text = (piece / "post_grad.txt").read_text()
    assert text.startswith("# lanes written: 2\n") and "capturepass.lane_step" in text
    assert any("2 lanes" in r.getMessage() and "sync points written" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("factor, written", [(None, True), (1.2, True), (2.5, False)])
def test_post_grad_pass_writes_only_lanes_the_device_predicts_to_pay(factor, written, monkeypatch, caplog):
    """Nothing measures the pass route's lanes: with the device's lane factor (measured lanes
    against one lane, over the cost model's estimate), lanes predicted no faster than one lane
    are not written (the graph stays Inductor's own, one lane), and the log says why."""
    from capturepass.backends import dynamo

    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments", "pick_predict": true}')
    monkeypatch.setattr(dynamo, "lane_factor", lambda opts, device: factor)
    gm = _post_grad_graph()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        capturepass.post_grad_pass(gm.graph)
    assert bool(_lane_steps(gm.graph)) is written
    messages = [r.getMessage() for r in caplog.records]
    assert any("predicted no faster than one lane on this device (cost model" in m and "lane factor 2.500" in m
               for m in messages) is not written, messages


def test_post_grad_pass_guards_no_input_under_inductors_cudagraphs(monkeypatch):
    """Under ``mode="reduce-overhead"`` a graph that writes an input Inductor does not know as
    static is not captured: no sync point declares one written, and what reads only inputs runs
    first, on the main lane."""
    from capturepass.backends import post_grad

    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments"}')
    gm = _post_grad_graph()
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    want = gm(*args)
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert post_grad.unguarded_inputs(3) == {0, 1, 2}  # no tracing context: none known static
        capturepass.post_grad_pass(gm.graph)
    gm.recompile()
    calls = _lane_steps(gm.graph)
    assert calls
    assert not [g for n in calls for g in n.args[5] if g.op == "placeholder"]
    torch.testing.assert_close(gm(*args), want)


def test_pass_route_under_torch_compile_restores_inductors_options(monkeypatch, caplog):
    """Plain ``torch.compile`` with the pass as Inductor's post-grad custom pass: equal to eager,
    the lanes written once, and Inductor's lane-blind options back as they were after the compile."""
    from capturepass.testing.models import MoEBlock

    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments", "verify": true}')
    model = MoEBlock().eval()
    before = {k: getattr(torch._inductor.config, k) for k in ("allow_buffer_reuse", "inplace_buffers")}
    torch._dynamo.reset()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="capturepass"), \
            torch._inductor.config.patch(post_grad_custom_post_pass=capturepass.post_grad_pass):
        compiled = torch.compile(model, backend="inductor")
        for seed in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x), model(x))
    assert {k: getattr(torch._inductor.config, k) for k in before} == before
    assert len([r for r in caplog.records if "sync points written" in r.getMessage()]) == 1


def test_post_grad_pass_uuid_follows_options(monkeypatch):
    monkeypatch.delenv("CAPTUREPASS_OPTIONS", raising=False)
    first = capturepass.post_grad_pass.uuid()
    assert first == capturepass.post_grad_pass.uuid()
    monkeypatch.setenv("CAPTUREPASS_DUMP_DIR", "/tmp/elsewhere")  # dumps do not change code
    assert capturepass.post_grad_pass.uuid() == first
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"max_aux_lanes": 1}')
    assert capturepass.post_grad_pass.uuid() != first


def test_post_grad_pass_uuid_follows_the_cost_models_source(monkeypatch):
    """The lanes the route writes depend on ``ir/cost.py`` (estimates, what Inductor fuses)."""
    from capturepass.ir import cost

    monkeypatch.delenv("CAPTUREPASS_OPTIONS", raising=False)
    first = capturepass.post_grad_pass.uuid()
    real = inspect.getsource

    def edited(obj):
        text = real(obj)
        return text + "\n# edited\n" if obj is cost else text

    monkeypatch.setattr(inspect, "getsource", edited)
    assert capturepass.post_grad_pass.uuid() != first


@pytest.mark.slow
def test_aot_compile_saves_and_loads(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch, capturepass
        def f(x, w):
            return torch.relu(x @ w) + x.sum()
        x, w = torch.randn(4, 4), torch.randn(4, 4)
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(f, backend=capturepass.backend, fullgraph=True)
        fn = compiled.aot_compile(((x, w), {{}}))
        torch.testing.assert_close(fn(x, w), f(x, w))
        fn.save_compiled_function({str(tmp_path / "fn")!r})
        with open({str(tmp_path / "fn")!r}, "rb") as fh:
            loaded = torch.compiler.load_compiled_function(fh)
        inner = loaded._artifacts.compiled_fn
        print(type(inner).__name__, inner.loaded)
        inner.finalize_loading(None)
        x2 = torch.randn(4, 4)
        torch.testing.assert_close(loaded(x2, w), f(x2, w))
        print("equal")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["CapturePassFunction", "True", "equal"]


def test_post_grad_pass_says_once_that_it_writes_lanes(caplog, monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_said", threading.Event())
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments"}')
    lowers, _why = vllm_plugin.inductor_lowers_streams()
    from torch._inductor.graph import GraphLowering

    assert lowers == hasattr(GraphLowering, "_get_node_stream")
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        capturepass.post_grad_pass(_post_grad_graph().graph)
        capturepass.post_grad_pass(_post_grad_graph().graph)
    said = [r.getMessage() for r in caplog.records if "writes lanes into the pieces" in r.getMessage()]
    assert len(said) == 1 and "allow_buffer_reuse" in said[0]


def test_pass_route_checks_the_code_inductor_generates(monkeypatch):
    """The lane checks run on the code of every graph whose lanes were written; with Inductor's
    buffer reuse left on (lane-blind: a buffer freed on one lane is handed to another), they find
    the reuse and the compile fails, naming the piece, instead of running a race."""
    from capturepass.backends import inline_check, post_grad
    from capturepass.errors import VerificationError
    from capturepass.testing.models import MoEBlock

    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"regions": "segments"}')
    checked = []
    real = inline_check.findings

    def spy(codes, points, op="inline_step"):
        found = real(codes, points, op)
        checked.append((op, len(points), found))
        return found

    monkeypatch.setattr(inline_check, "findings", spy)
    model = MoEBlock().eval()
    x = torch.randn(16, 64)
    patch = torch._inductor.config.patch(post_grad_custom_post_pass=capturepass.post_grad_pass,
                                         fx_graph_cache=False)
    torch._dynamo.reset()
    with torch.no_grad(), patch:
        torch.testing.assert_close(torch.compile(model, backend="inductor")(x), model(x))
    assert [(op, found) for op, _n, found in checked] == [("lane_step", [])]

    checked.clear()
    monkeypatch.setattr(post_grad, "lane_blind_options", lambda: [])
    torch._dynamo.reset()
    with torch.no_grad(), patch, pytest.raises(Exception) as info:
        torch.compile(model, backend="inductor")(x)
    exc = info.value  # under Dynamo's and Inductor's wrappers
    while not isinstance(exc, VerificationError) and getattr(exc, "inner_exception", None) is not None:
        exc = exc.inner_exception
    assert isinstance(exc, VerificationError), repr(info.value)
    assert "fails the lane checks (reuse: " in str(exc) and "post-grad piece" in str(exc)
    assert checked and checked[0][2]


def test_post_grad_pass_schedules_with_the_devices_calibrated_model(monkeypatch, caplog):
    """Nothing measures the pass route's schedules: the device's calibrated cost model (made by
    the backend route's measured choices) prices them when there is one."""
    from capturepass.backends import compile as driver
    from capturepass.backends import dynamo
    from capturepass.ir import cost

    fitted = cost.DeviceModel(name="FakeGPU sm90", scale=0.25, launch_floor_s=2e-6, samples=3)
    monkeypatch.setattr(dynamo, "calibrated_model", lambda opts, device: fitted)
    seen = []
    real = driver.compile_graph

    def spy(*args, **kwargs):
        seen.append(cost.current_model())
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "compile_graph", spy)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        capturepass.post_grad_pass(_post_grad_graph().graph)
    assert seen == [fitted]
    assert any("post-grad piece" in r.getMessage() and fitted.describe() in r.getMessage() for r in caplog.records)
    assert cost.current_model() is cost.NOMINAL


def test_post_grad_pass_uuid_follows_the_devices_calibrated_model(monkeypatch):
    """The calibrated model and the lane factor change what the pass writes: Inductor's cache
    must not serve a piece compiled under others."""
    from capturepass.backends import dynamo
    from capturepass.ir import cost

    monkeypatch.delenv("CAPTUREPASS_OPTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    models = {"now": None, "factor": None}
    monkeypatch.setattr(dynamo, "calibrated_model", lambda opts, device: models["now"])
    monkeypatch.setattr(dynamo, "lane_factor", lambda opts, device: models["factor"])
    nominal = capturepass.post_grad_pass.uuid()
    models["now"] = cost.DeviceModel(name="FakeGPU sm90", scale=0.25, launch_floor_s=2e-6, samples=3)
    calibrated = capturepass.post_grad_pass.uuid()
    models["now"] = cost.DeviceModel(name="FakeGPU sm90", scale=0.5, launch_floor_s=2e-6, samples=4)
    again = capturepass.post_grad_pass.uuid()
    models["factor"] = 1.3  # decides whether lanes are written
    assert len({nominal, calibrated, again, capturepass.post_grad_pass.uuid()}) == 4
