"""The uncaptured call's short path: a model instance run before, no instrumentation, nothing
to capture or release first. It must do what the general path does (the executing owner set
for the call and put back, the compiled regions called in program order, equal to eager) and
step aside whenever the general path has work: instrumentation, a closed callable."""

from __future__ import annotations

import contextlib

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.errors import CapturePassError
from capturepass.runtime import context
from capturepass.runtime.executor import Executor

OWNERS: list[object] = []


@torch.library.custom_op("cptest::note_owner", mutates_args=())
def note_owner(x: torch.Tensor) -> torch.Tensor:
    """``x * 2``, noting the thread's executing owner (read by ``capturepass.retain`` and
    ``capturepass.workspace`` in real ops)."""
    OWNERS.append(context.current_owner())
    return x * 2


@note_owner.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    with capturepass.lane("aux"):
        b = note_owner(x) @ w
    return a + b


@pytest.fixture
def general_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls that take the general path (``Executor._call``)."""
    calls: list[int] = []
    real = Executor._call

    def counted(self: Executor, args: list) -> object:
        calls.append(1)
        return real(self, args)

    monkeypatch.setattr(Executor, "_call", counted)
    return calls


def test_a_repeated_call_takes_the_short_path_with_its_owner_set(general_calls):
    compiled = torch.compile(_f, backend="capturepass")
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = _f(x, w)
    OWNERS.clear()
    for _ in range(3):
        torch.testing.assert_close(compiled(x, w), expected)
    executor = last_compiled()[-1].executor
    (owner,) = executor.owners
    # The first call made the instance's owner on the general path; the next two took the short one.
    assert len(general_calls) == 1
    assert OWNERS == [owner] * 3
    assert context.current_owner() is None


@pytest.mark.parametrize("regions", ["auto", "lanes"])
def test_the_short_path_calls_each_compiled_region_itself(regions):
    compiled = torch.compile(_f, backend="capturepass", options={"regions": regions})
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled(x, w)
    executor = last_compiled()[-1].executor
    bound = executor._eager_owners[executor._instance([x, w])].program
    # Once the first call found every output as compiled for, no layout check is left either.
    checked = [spec.fn for spec in executor.program.regions if hasattr(spec.fn, "settled")]
    assert len(checked) == len(executor.program.regions) and all(fn.settled is not None for fn in checked)
    if regions == "auto":
        # On the host the lanes are one region: the direct call is its compiled function.
        assert len(checked) == 1 and bound.direct is checked[0].settled
        return
    direct = bound.direct.__self__.code
    # Every region runs on the current stream on the host: none goes through its RegionCall.
    assert len(checked) == 3
    assert "capturepass_runtime_program_region_" not in direct and "layouts" not in direct
    assert bound._whole.__self__.code.count("capturepass_runtime_program_region_") == 3
    torch.testing.assert_close(bound.direct(x, w), (_f(x, w),))


def _bound(args: list) -> object:
    executor = last_compiled()[-1].executor
    return executor, executor._eager_owners[executor._instance(args)].program


@pytest.mark.parametrize("case", ["two_outputs", "two_inputs"])
def test_a_lone_region_whose_results_are_the_outputs_is_the_direct_call(case):
    def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2

    def two_inputs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w @ x).relu()

    fn, args = (two_outputs, [torch.randn(4, 4)]) if case == "two_outputs" else (two_inputs, [torch.randn(4, 4), torch.randn(4, 4)])
    compiled = torch.compile(fn, backend="capturepass")
    compiled(*args)
    torch.testing.assert_close(compiled(*args), fn(*args))
    executor, bound = _bound(args)
    (spec,) = executor.program.regions
    assert bound.direct is spec.fn.settled
    torch.testing.assert_close(tuple(bound.direct(*args)), tuple(bound._whole(*args)))


def test_a_lone_region_is_not_the_direct_call_when_an_input_is_an_output():
    # A training graph's forward returns what backward saves, here the input itself: the
    # whole call returns more than the region does.
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled = torch.compile(linear, backend="capturepass")
    compiled(x)
    torch.testing.assert_close(compiled(x), linear(x))
    executor, bound = _bound([linear.weight, linear.bias, x])
    (spec,) = executor.program.regions
    assert bound.direct is not spec.fn.settled
    assert "return (getitem, primals_3)" in bound.direct.__self__.code
    compiled(x).sum().backward()
    assert linear.weight.grad is not None


def test_instrumentation_takes_the_general_path(general_calls):
    compiled = torch.compile(_f, backend="capturepass")
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled(x, w)
    regions: list[int] = []
    inst = context.Instrumentation(region=lambda spec: regions.append(spec.index) or contextlib.nullcontext())
    with context.instrumented(inst):
        torch.testing.assert_close(compiled(x, w), _f(x, w))
    assert len(general_calls) == 2 and len(regions) == len(last_compiled()[-1].executor.program.regions)


def test_a_closed_callable_refuses_after_short_calls():
    compiled = torch.compile(_f, backend="capturepass")
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled(x, w)
    compiled(x, w)
    last_compiled()[-1].executor.close()
    with pytest.raises(CapturePassError, match="was closed"):
        compiled(x, w)
