"""A custom op whose captured kernel bakes in a scratch binding, kept alive by ``capturepass.retain``.

Run: ``python examples/custom_op_retention.py [--device cuda] [--inner eager] [--dump DIR]``

``retention_example::banded_sum`` builds a *binding* on each call: an object
that owns a scratch buffer and that the kernel addresses directly (as a
cuBLASLt plan or a NCCL window would). In a CUDA graph the kernel's pointer to
that scratch is frozen at capture time; if the binding were collected after the
capture, a replay would write into freed memory (or another tensor's). So the
op calls ``capturepass.retain(binding)``: while capturepass captures, the
binding then lives exactly as long as the graph's owner.

On a GPU (``cudagraphs="monolithic"``) the call returns ``True`` during the
capture and the owner's retained count includes the binding. On the CPU
nothing is captured: ``capturepass.retain`` returns ``False`` and does nothing,
while capturepass's own retention still runs as bookkeeping (the first run
stands for the capture), so the owner lists the static inputs the segment
reads. The script prints both, what capturepass did, and the result check.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn as nn

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.show import summarize_dir
from capturepass.runtime.owner import retained_kind

RETAIN_CALLS: list[bool] = []


class ScratchBinding:
    """Owns the scratch a kernel addresses directly (its pointer is what a capture freezes)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.scratch = torch.empty(numel, dtype=dtype, device=device)

    @property
    def address(self) -> int:
        return self.scratch.data_ptr()


@capturepass.capability(overlap="safe")
@torch.library.custom_op("retention_example::banded_sum", mutates_args=())
def banded_sum(x: torch.Tensor, band: int) -> torch.Tensor:
    """``x[i] + x[i+1] + ... + x[i+band-1]`` along dim 0 (zero past the end), via a scratch binding."""
    binding = ScratchBinding((x.shape[0] + band) * x.shape[1], x.dtype, x.device)
    RETAIN_CALLS.append(capturepass.retain(binding))
    padded = binding.scratch.view(x.shape[0] + band, x.shape[1])
    padded.zero_()
    padded[: x.shape[0]].copy_(x)
    out = torch.zeros_like(x)
    for k in range(band):
        out += padded[k : k + x.shape[0]]
    return out


@banded_sum.register_fake
def _(x, band):
    return torch.empty_like(x)


class Smoother(nn.Module):
    """A projection, the banded sum, and a second projection beside an independent branch."""

    def __init__(self, d: int = 64, device=None) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, device=device)
        self.side = nn.Linear(d, d, device=device)
        self.out = nn.Linear(d, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.retention_example.banded_sum(torch.relu(self.inp(x)), 3)
        return self.out(h) + torch.tanh(self.side(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--dump", default=None, help="dump directory (default: a temporary one)")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Smoother(device=args.device)
    dump = args.dump or tempfile.mkdtemp(prefix="capturepass-")
    options = {"dump_dir": dump, "inner": args.inner, "cudagraphs": "monolithic"}
    compiled = torch.compile(model, backend="capturepass", options=options)
    x = torch.randn(args.tokens, 64, device=args.device)
    with torch.no_grad():
        for _ in range(3):  # the first call captures (or stands for the capture), later calls replay
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
            x = torch.randn_like(x)
    print(summarize_dir(dump))
    (graph,) = [g for g in last_compiled() if g.dump_dir and g.dump_dir.startswith(dump)]
    for owner in graph.executor.owners:
        # Static inputs are retained by their storage (the model can still be collected).
        print(f"owner {owner.name}: {owner.num_retained} object(s) retained: "
              + ", ".join(sorted({retained_kind(o) for objs in owner.retained.values() for o in objs})))
    retained_by_op = sum(RETAIN_CALLS)
    print(f"capturepass.retain called {len(RETAIN_CALLS)} time(s) by the op (compiled and eager calls), "
          f"returned True {retained_by_op} time(s)")
    if args.device == "cuda":
        assert retained_by_op >= 1, "the op's binding was not retained during the capture"
        print("the binding created during the capture is retained by the capture owner: OK")
    else:
        assert retained_by_op == 0
        print("on the CPU nothing is captured, so capturepass.retain is a no-op (returns False); the owner's "
              "count above is capturepass's own retention of the static inputs, done as bookkeeping on the "
              "first run, which stands for the capture")
    print(f"result equals eager on {args.device} (three calls, new input values): OK")
    print(f"annotated IR per pass: {dump}")


if __name__ == "__main__":
    main()
