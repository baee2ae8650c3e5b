"""Each region is compiled with Inductor's configuration as ``torch.compile`` would use it.

``torch._inductor.standalone_compile`` turns ``triton.autotune_at_compile_time`` on for the
artifacts it saves: every Triton kernel is then tuned during the compile on random tensors as
large as its arguments, which on the H200 put a random [32000, 2048] weight and the benchmark's
cache flush buffer beside a Llama's weights (a compile's peak memory twice
``mode="reduce-overhead"``'s). The inner compiler passes the user's own setting back in.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import capturepass  # noqa: F401 - registers the backend
from capturepass.backends import inner


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Seen(CustomGraphPass):
    """A post-grad pass that records the tuning setting in force while Inductor compiles."""

    def __init__(self) -> None:
        self.values: list[object] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.values.append(torch._inductor.config.triton.autotune_at_compile_time)

    def uuid(self) -> None:
        return None  # no cache entry: every compile runs the pass


def _compile_with(setting: object) -> list[object]:
    seen = _Seen()
    with torch._inductor.config.patch({"post_grad_custom_post_pass": seen,
                                       "triton.autotune_at_compile_time": setting}):
        fn = torch.compile(lambda x, y: (x @ y).relu() + 1, backend="capturepass")
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        torch.testing.assert_close(fn(x, y), (x @ y).relu() + 1)
    return seen.values


@pytest.mark.skipif(not inner._takes_options(), reason="this torch's standalone_compile takes no options")
@pytest.mark.parametrize("setting", [None, False, True])
def test_regions_are_tuned_when_the_user_set_it_not_at_every_compile(setting):
    values = _compile_with(setting)
    assert values and set(values) == {setting}


def test_standalone_compile_still_forces_compile_time_tuning_on_its_own():
    """The override is needed: without options ``standalone_compile`` tunes at compile time."""
    seen = _Seen()
    gm = torch.fx.symbolic_trace(lambda x: (x.relu() + 1,))
    with torch._inductor.config.patch({"post_grad_custom_post_pass": seen,
                                       "triton.autotune_at_compile_time": None}):
        torch._inductor.standalone_compile(gm, [torch.randn(4)], dynamic_shapes="from_example_inputs")
    assert seen.values == [True]


def _wrapped_regions():
    from capturepass.backends.compile import last_compiled

    return [getattr(r.fn, "fn", r.fn) for r in last_compiled()[-1].program.regions if r.compiler == "inductor"]


def _step(x, cache, pos):
    cache.index_copy_(0, pos, x)
    return (cache.sum(0) * 2 + x).relu()


def _check_writes_inputs() -> None:
    compiled = torch.compile(_step, backend="capturepass")
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x, cache, pos = torch.randn(2, 8, generator=g), torch.randn(6, 8, generator=g), torch.tensor([1, 4])
        want_cache = cache.clone()
        want = _step(x, want_cache, pos)
        torch.testing.assert_close(compiled(x, cache, pos), want)
        torch.testing.assert_close(cache, want_cache)


@pytest.mark.skipif(inner._forward_compiler() is None, reason="this torch has no compile_fx_forward to call")
def test_a_region_is_compiled_by_inductors_forward_compile_without_a_second_aot_trace(monkeypatch):
    """The region graph is already AOT autograd's: Inductor compiles it as it is (no
    ``standalone_compile``), and what the region writes to its inputs (a KV cache written at
    positions, kept by AOT autograd as a copy into the input) is still written."""

    def no_standalone(*args, **kwargs):
        raise AssertionError("standalone_compile called")

    monkeypatch.setattr(torch._inductor, "standalone_compile", no_standalone)
    _check_writes_inputs()
    fns = _wrapped_regions()
    assert fns and all(f.__qualname__ == "_forward_compiler.<locals>.compile_forward.<locals>.call" for f in fns)


@pytest.mark.skipif(inner._forward_compiler() is None, reason="this torch has no compile_fx_forward to call")
def test_kernels_are_named_by_their_aten_ops():
    """Inductor names kernels after the ATen ops they fuse (what a profiler trace shows)."""

    def f(x):
        return (x.sin() * 2,)

    x = torch.randn(16, 16)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = torch._inductor.utils.run_and_get_code(torch.compile(f, backend="capturepass"), x)
    assert "cpp_fused_mul_sin_0(" in codes[0], codes[0]


def test_without_a_forward_compile_a_region_is_called_through_aot_autograds_runtime_wrapper(monkeypatch):
    """Where torch has no ``compile_fx_forward`` to call, ``standalone_compile`` compiles a
    region; it is called through AOT autograd's runtime wrapper inside the artifact, which
    still applies what the region writes to its inputs."""
    monkeypatch.setattr(inner, "_forward_compiler", lambda: None)
    _check_writes_inputs()
    fns = _wrapped_regions()
    assert fns and all(f.__qualname__ == "_runtime_wrapper.<locals>.call" for f in fns)


def test_an_artifact_built_otherwise_is_called_as_it_is():
    """An artifact without the layers the unwrapping expects is kept whole."""

    class Artifact:
        def __call__(self, *args):
            return args

    art = Artifact()
    assert inner._runtime_wrapper(art) is None
    assert inner._runtime_wrapper(object()) is None
