"""A real resident-grid op: a persistent Triton kernel with a grid-wide barrier.

``capturepass_examples::global_normalize(x)`` returns ``x / ||x||_2`` (the norm
over the whole tensor). On CUDA it runs one persistent Triton kernel: each CTA
sums the squares of its tiles, adds them to a global accumulator, waits at a
grid-wide barrier (an atomic counter every CTA must reach), then scales its
tiles. The barrier needs every CTA resident at once: if work on another stream
occupies the multiprocessors, late CTAs cannot start and the early ones spin
forever. Whether a launch has a barrier depends on the shape, so the op
declares its capability with a launch-plan callable:

- small inputs (at most ``SMALL_NUMEL`` elements): one CTA does everything;
  the launch is resident-grid but barrier-free, so work on other lanes may run
  beside it (and is enqueued before it);
- larger inputs: one CTA per multiprocessor with the grid barrier; nothing may
  run beside it, so capturepass serializes it.

Off CUDA (or without Triton) the op computes the same function with torch ops.
"""

from __future__ import annotations

import math

import torch

import capturepass
from capturepass.ir.capabilities import CallInfo

SMALL_NUMEL = 1 << 16
BLOCK = 1024
DEFAULT_SMS = 132  # an H100/H200, when the call is planned without a device

try:  # Triton is optional: it is present wherever CUDA PyTorch is.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only machines
    triton = None


def launch_plan(numel: int, sm_count: int | None) -> dict:
    """The launch of ``global_normalize`` for ``numel`` elements on ``sm_count`` multiprocessors."""
    sms = sm_count or DEFAULT_SMS
    if numel <= SMALL_NUMEL:
        return {"ctas": 1, "barrier": False}
    return {"ctas": min(sms, max(1, math.ceil(numel / BLOCK))), "barrier": True}


def capability_of(call: CallInfo) -> dict:
    """The launch-plan callable registered for ``global_normalize``."""
    numel = math.prod(call.shapes[0]) if call.shapes else 0
    plan = launch_plan(numel, call.sm_count)
    if plan["barrier"]:
        return {
            "overlap": "serialize",
            "resident_grid": True,
            "barrier_free": False,
            "ctas": plan["ctas"],
            "reason": f"persistent grid of {plan['ctas']} CTAs with a grid barrier",
        }
    return {
        "overlap": "safe",
        "resident_grid": True,
        "barrier_free": True,
        "ctas": plan["ctas"],
        "reason": f"persistent grid of {plan['ctas']} CTA(s), barrier-free",
    }


if triton is not None:

    @triton.jit
    def _normalize_kernel(x_ptr, y_ptr, acc_ptr, count_ptr, n, num_ctas, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        partial = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, num_ctas * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            partial += v * v
        tl.atomic_add(acc_ptr, tl.sum(partial, axis=0))
        # Grid-wide barrier: spins until every CTA has arrived, so every CTA must be resident.
        tl.atomic_add(count_ptr, 1)
        arrived = tl.atomic_add(count_ptr, 0)
        while arrived < num_ctas:
            arrived = tl.atomic_add(count_ptr, 0)
        total = tl.atomic_add(acc_ptr, 0.0)
        inv = 1.0 / tl.sqrt(total + 1e-12)
        for start in range(pid * BLOCK, n, num_ctas * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs, (v * inv).to(y_ptr.dtype.element_ty), mask=offs < n)


def _reference(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / torch.sqrt(x.float().pow(2).sum() + 1e-12)).to(x.dtype)


@torch.library.custom_op("capturepass_examples::global_normalize", mutates_args=())
def global_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / ||x||_2`` over the whole tensor (one persistent kernel on CUDA)."""
    if x.device.type != "cuda" or triton is None:
        return _reference(x)
    x = x.contiguous()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    plan = launch_plan(x.numel(), sms)
    # The accumulator and the barrier counter are scratch bound to the running graph
    # owner and lane: two owners (or lanes) never share one, and inside a capture the
    # buffers stay where the captured kernel expects them.
    acc = capturepass.workspace("global_normalize.acc", (1,), torch.float32, x.device)
    count = capturepass.workspace("global_normalize.count", (1,), torch.int32, x.device)
    acc.zero_()
    count.zero_()
    y = torch.empty_like(x)
    _normalize_kernel[(plan["ctas"],)](x, y, acc, count, x.numel(), plan["ctas"], BLOCK=BLOCK)
    return y


@global_normalize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


capturepass.register_capability(global_normalize, overlap=capability_of)


class NormalizedMoE(torch.nn.Module):
    """A shared expert beside a routed branch that ends in the resident-grid op.

    Args:
        d: model width; the op's input is the routed branch's ``[tokens, d]`` output.
        shared: the shared expert's hidden width.
    """

    def __init__(self, d: int = 256, shared: int = 512, device=None, dtype=torch.float32) -> None:
        super().__init__()
        g = lambda *s: torch.nn.Parameter(torch.randn(*s, device=device, dtype=dtype) * s[-1] ** -0.5,  # noqa: E731
                                          requires_grad=False)
        self.wg, self.wu, self.wd = g(shared, d), g(shared, d), g(d, shared)
        self.wr = g(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written routed-first, as MoE layers usually are: capturepass moves the shared
        # expert's launches before a barrier-free resident launch on its own.
        routed = torch.ops.capturepass_examples.global_normalize(torch.nn.functional.linear(x, self.wr).relu())
        shared = torch.nn.functional.linear(
            torch.nn.functional.silu(torch.nn.functional.linear(x, self.wg)) * torch.nn.functional.linear(x, self.wu),
            self.wd,
        )
        return shared + routed
