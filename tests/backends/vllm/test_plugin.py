"""The vLLM integration without vLLM: the plugin function, options from the environment,
the post-grad pass and the serializable backend result (torch's AOT compile, save and load)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch._dynamo.backends import registry

import capturepass
from capturepass.backends.vllm import plugin as vllm_plugin
from capturepass.backends import dynamo
from capturepass.errors import OptionError
from capturepass.ir.options import Options


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


def test_post_grad_pass_dumps_and_leaves_the_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_DUMP_DIR", str(tmp_path))
    gm = _post_grad_graph()
    before = gm.code
    metas = [dict(n.meta) for n in gm.graph.nodes]
    capturepass.post_grad_pass(gm.graph)
    assert gm.code == before
    assert [dict(n.meta) for n in gm.graph.nodes] == metas
    (piece,) = [p for p in tmp_path.iterdir() if p.name.startswith("post_grad_")]
    names = sorted(p.name for p in piece.iterdir())
    assert "009_verify.txt" in names and "003_assign_streams.txt" in names
    assert not any("emit" in n for n in names)
    assert "lane=s1" in (piece / "009_verify.txt").read_text()  # two independent matmuls, two lanes


def test_post_grad_pass_uuid_follows_options(monkeypatch):
    monkeypatch.delenv("CAPTUREPASS_OPTIONS", raising=False)
    first = capturepass.post_grad_pass.uuid()
    assert first == capturepass.post_grad_pass.uuid()
    monkeypatch.setenv("CAPTUREPASS_DUMP_DIR", "/tmp/elsewhere")  # dumps do not change code
    assert capturepass.post_grad_pass.uuid() == first
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", '{"max_aux_lanes": 1}')
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


def test_post_grad_pass_says_once_why_the_pieces_keep_one_stream(caplog, monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_said_unapplied", threading.Event())
    lowers, why = vllm_plugin.inductor_lowers_streams()
    from torch._inductor.graph import GraphLowering

    assert lowers == hasattr(GraphLowering, "_get_node_stream")
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        capturepass.post_grad_pass(_post_grad_graph().graph)
        capturepass.post_grad_pass(_post_grad_graph().graph)
    said = [r.getMessage() for r in caplog.records if "keep one stream" in r.getMessage()]
    assert len(said) == 1
    assert (why in said[0]) if not lowers else ("backend=\"capturepass\"" in said[0])
