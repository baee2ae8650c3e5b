"""The backend is found through the ``torch_dynamo_backends`` entry point, without importing capturepass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch._dynamo.backends import registry

from capturepass.backends import dynamo


def test_backend_works_without_importing_capturepass():
    code = textwrap.dedent(
        """
        import sys
        import torch
        imported_by_torch = "capturepass" in sys.modules
        m = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)
        out = torch.compile(m, backend="capturepass")(x)  # the defaults: Inductor regions
        torch.testing.assert_close(out, m(x))
        print(out.shape)
        print("imported before compile:", imported_by_torch)
        print("imported by the entry point:", "capturepass.backends.dynamo" in sys.modules)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == [
        "torch.Size([2, 4])",
        "imported before compile: False",
        "imported by the entry point: True",
    ], proc.stdout


def test_a_fresh_process_traces_decompositions_that_ask_inductors_lowerings():
    # max_pool2d's decomposition consults ``torch._inductor.lowering``; in a process where nothing
    # compiled through Inductor yet, that module is imported by the backend or not at all.
    code = textwrap.dedent(
        """
        import torch
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.MaxPool2d(3, 2, 1)).eval()
        x = torch.randn(2, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(m, backend="capturepass")(x), m(x))
        print("equal")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["equal"], proc.stdout


def test_entry_point_names_the_backend():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "capturepass"]
    assert ep.value == "capturepass.backends.dynamo:capturepass_backend"
    assert ep.load() is dynamo.capturepass_backend


def test_register_is_idempotent():
    dynamo.register()
    first = dict(registry._COMPILER_FNS)
    dynamo.register()
    dynamo.register()
    assert registry._COMPILER_FNS == first
    assert registry._COMPILER_FNS["capturepass"] is dynamo.capturepass_backend
    assert registry.lookup_backend("capturepass") is dynamo.capturepass_backend
    assert "capturepass" in registry.list_backends()
    out = torch.compile(lambda x: x * 2, backend="capturepass", options={"inner": "eager"})(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_register_replaces_a_lazily_announced_name():
    # The entry point may have put a placeholder under the name; register() loads the real backend.
    saved = registry._COMPILER_FNS.get("capturepass")
    try:
        registry._COMPILER_FNS["capturepass"] = lambda gm, example_inputs: gm
        dynamo.register()
        assert registry._COMPILER_FNS["capturepass"] is dynamo.capturepass_backend
    finally:
        if saved is None:
            registry._COMPILER_FNS.pop("capturepass", None)
        else:
            registry._COMPILER_FNS["capturepass"] = saved
