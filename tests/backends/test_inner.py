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
