"""End-to-end: storage effects and hidden state keep program order through ``torch.compile``.

Each program writes a storage that another branch reads (an input, a view of one, a module
buffer, a KV cache) or draws random numbers on two branches. The branches are put on different
lanes (by hint, and by the automatic policy), and the compiled call must equal eager: its
outputs, and the inputs and buffers it updated, on two calls with new values. Before storage
effects were dependencies, the write ran first on these programs (wrong results), the verifier
did not object, and random draws came out swapped.
"""

from __future__ import annotations

import pytest
import torch

import capturepass
from capturepass.backends.compile import last_compiled

L = capturepass.lane
OPTIONS = [
    {"verify": True},
    {"verify": True, "max_aux_lanes": 1},
    {"verify": True, "max_aux_lanes": 4},
    {"verify": True, "policy": "hints"},
    {"verify": True, "inner": "eager"},
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _check(fn, make_args, options, calls=2):
    compiled = torch.compile(fn, backend="capturepass", options=options)
    for call in range(calls):
        args = make_args(call)
        eager_args = [a.clone() for a in args]
        out = compiled(*args)
        expected = fn(*eager_args)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(args, eager_args, msg=lambda m: f"inputs after call {call}: {m}")
    return last_compiled()[-1]


def _pair(call, n=16):
    gen = torch.Generator().manual_seed(call)
    return [torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)]


def read_then_write(x, w):
    with L("aux"):
        a = x @ w
    x.add_(1)
    return a


def read_then_write_unhinted(x, w):
    a = x @ w
    x.add_(1)
    return a


def write_reads_other_then_other_written(x, y):
    x.add_(y.sin())
    y.mul_(2)


def read_then_write_through_view(x, w):
    with L("aux"):
        a = x[:, :8].t() @ w
    x[:, :8].add_(1)
    return a


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize(
    "fn", [read_then_write, read_then_write_unhinted, write_reads_other_then_other_written, read_then_write_through_view]
)
def test_input_written_after_another_branch_reads_it(fn, options):
    compiled = _check(fn, _pair, options)
    assert meta_writes(compiled) == ["arg0_1"] if fn is not write_reads_other_then_other_written else True


def meta_writes(compiled) -> list[str]:
    from capturepass.ir import meta

    gi = meta.graph_info(compiled.graph)
    names = [n.name for n in compiled.graph.graph.nodes if n.op == "placeholder"]
    return [names[i] for i in sorted(gi.mutated_inputs)]


def test_the_write_waits_for_the_read_in_the_dump():
    compiled = _check(read_then_write, _pair, {"verify": True})
    whys = [
        capturepass.ir.meta.info(n).why for n in compiled.graph.graph.nodes
        if capturepass.ir.meta.effect_of(n) is capturepass.ir.meta.Effect.WAIT
    ]
    assert "%mm->%copy_ (war %arg0_1)" in whys, whys


class Counter(torch.nn.Module):
    """Reads a buffer on one branch, then increments it (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16, 16))
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        with L("aux"):
            a = self.state @ self.w
        self.state.add_(x)
        return a + x


def test_buffer_read_then_incremented():
    with torch.no_grad():
        model, ref = Counter(), Counter()
        ref.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend="capturepass", options={"verify": True})
        for call in range(3):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(call))
            torch.testing.assert_close(compiled(x), ref(x))
            torch.testing.assert_close(model.state, ref.state)


def kv_decode(cache, pos, k, q):
    """The decode pattern of engines: attention reads the cache while the new entry is written."""
    with L("aux"):
        old = (q @ cache.t()).softmax(-1) @ cache
    cache.index_copy_(0, pos, k)
    new = (q @ cache.t()).softmax(-1) @ cache
    return old, new


def kv_decode_put(cache, pos, k, q):
    with L("aux"):
        old = q @ cache.t()
    cache.index_put_((pos,), k)
    return old, q @ cache.t()


@pytest.mark.parametrize("fn", [kv_decode, kv_decode_put])
@pytest.mark.parametrize("options", OPTIONS[:3], ids=["default", "aux1", "aux4"])
def test_kv_cache_written_at_positions(fn, options):
    def make(call):
        gen = torch.Generator().manual_seed(10 + call)
        return [
            torch.randn(32, 8, generator=gen), torch.tensor([3 + call, 7]), torch.randn(2, 8, generator=gen),
            torch.randn(4, 8, generator=gen),
        ]

    _check(fn, make, options)


@torch.library.custom_op("cptest_effects::scale_", mutates_args=("buf",))
def scale_(buf: torch.Tensor, s: float) -> None:
    buf.mul_(s)


@scale_.register_fake
def _(buf: torch.Tensor, s: float) -> None:
    return None


def custom_write(x, w):
    with L("aux"):
        a = x @ w
    scale_(x, 3.0)
    return a + x


@pytest.mark.parametrize("options", OPTIONS[:3], ids=["default", "aux1", "aux4"])
def test_custom_op_mutates_args_after_a_read(options):
    _check(custom_write, _pair, options)


def only_writes(x, y):
    with L("aux"):
        x.mul_(2)
    y.add_(x)


def test_graph_that_only_writes_and_returns_none():
    _check(only_writes, _pair, {"verify": True})


def two_draws(x):
    a = torch.rand_like(x) * x
    b = torch.rand_like(x) + x.cos()
    return a, b


@pytest.mark.parametrize("policy", ["auto", "off"])
def test_random_draws_are_bit_exact_with_the_eager_inner_compiler(policy):
    """Random ops draw from the generator's hidden state in program order, on any lane: with
    ``inner="eager"`` the draws equal eager's bit for bit (they came out swapped before)."""
    compiled = torch.compile(two_draws, backend="capturepass", options={"inner": "eager", "policy": policy})
    for call in range(2):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(call))
        torch.manual_seed(call)
        out = compiled(x)
        torch.manual_seed(call)
        expected = two_draws(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_random_draws_follow_program_order_with_inductor_falling_back_to_aten_random():
    """Inductor draws with its own generator unless ``fallback_random`` is set; with it, each
    region calls ATen's random ops, in program order across lanes. (Inductor's own ``cos``
    rounds differently from ATen's: the draws are compared at float tolerance, where swapped
    draws would differ by O(1).)"""
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(two_draws, backend="capturepass")
        x = torch.randn(64, 64)
        torch.manual_seed(7)
        out = compiled(x)
        torch.manual_seed(7)
        expected = two_draws(x)
    torch.testing.assert_close(out, expected)
