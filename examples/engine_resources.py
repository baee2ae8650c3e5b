"""An engine's own device state, following graph ownership: channels, a profiling capture, an
external stream.

Run: ``python examples/engine_resources.py [--device cuda] [--dump DIR] [--inner eager]``

A toy serving engine owns three things the model graph does not show:

- an all-reduce *channel* (a staging buffer the collective kernel writes, and a sequence number
  it carries from call to call), registered as ``capturepass.resource_pool``: each graph owner
  (target model, draft model, a profiling capture, eager execution) gets its own, made on first
  use and released with the owner;
- the memory it can give to its KV cache, which it learns from ``capturepass.profiling_capture``:
  the graphs are captured once into throwaway owners, measured, released, and the pool rolled
  back, before the real captures;
- a weight-offload copy stream, declared with the option ``external_streams`` and bound with
  ``capturepass.external_stream``: capturepass joins it at every segment boundary, so each call
  reads the weights the stream just copied.

The script prints each owner's channel, what the profiling capture measured and released, the
joins in the dump, what capturepass did (``capturepass show`` of the dump), and checks every
result against eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch
import torch.nn as nn

import capturepass
from capturepass.backends.compile import last_compiled
from capturepass.show import summarize_dir
from capturepass.ir import printer


@dataclasses.dataclass
class Channel:
    """One owner's all-reduce staging area."""

    key: capturepass.ChannelKey
    staging: torch.Tensor
    calls: int = 0


def make_channel(key: capturepass.ChannelKey) -> Channel:
    return Channel(key, torch.zeros(1 << 12, device=DEVICE))


COMM = None
DEVICE = "cpu"


@capturepass.capability(overlap="safe", resources=("allreduce",))
@torch.library.custom_op("engine_example::allreduce", mutates_args=())
def allreduce(x: torch.Tensor) -> torch.Tensor:
    """A single-rank all-reduce: stages ``x`` in this owner's channel and reads it back."""
    ch = COMM.channel()
    ch.calls += 1
    n = x.numel()
    ch.staging[:n].copy_(x.reshape(-1))
    return ch.staging[:n].view_as(x).clone()


@allreduce.register_fake
def _(x):
    return torch.empty_like(x)


class Block(nn.Module):
    def __init__(self, d: int, device: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, device=device) / d**0.5, requires_grad=False)

    def forward(self, x):
        h = allreduce(x @ self.w)
        with capturepass.lane("aux"):
            g = torch.sigmoid(x @ self.w.t())
        return h * g


def main() -> None:
    global COMM, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--dump", default=None, help="dump directory (default: a temporary one)")
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    dump = args.dump or tempfile.mkdtemp(prefix="capturepass-")
    DEVICE = args.device
    torch.manual_seed(0)
    on_cuda = args.device == "cuda"
    released: list[str] = []
    COMM = capturepass.resource_pool("allreduce", make_channel, release=lambda ch: released.append(str(ch.key)))
    offload = torch.cuda.Stream() if on_cuda else None
    if on_cuda:
        capturepass.external_stream("offload", offload)
    options = {"inner": args.inner, "external_streams": {"offload": "before"}, "dump_dir": dump,
               "cudagraphs": "monolithic" if on_cuda else "breakable"}
    target, draft = Block(args.dim, args.device), Block(args.dim, args.device)
    ct = torch.compile(target, backend="capturepass", options=options)
    cd = torch.compile(draft, backend="capturepass", options=options)
    x = torch.randn(8, args.dim, device=args.device)

    with torch.no_grad():
        # 1. Size the KV cache: capture once into throwaway owners, measure, release, roll back.
        with capturepass.profiling_capture() as prof:
            ct(x), cd(x)
        print(f"profiling capture: {len(prof.owners)} throwaway owner(s) {', '.join(prof.owners)}; "
              f"{prof.graphs} graph(s), {prof.retained} retained object(s) released; "
              f"peak {prof.peak_bytes} B, pools {prof.pool_bytes} B, left allocated {prof.leaked_bytes} B")
        print(f"  channels released with them: {', '.join(released) or 'none'}; live now: "
              f"{', '.join(str(k) for k in COMM.channels()) or 'none'}")

        # 2. Serve: the offload stream writes the weights before each call; target and draft interleave.
        for step in range(3):
            new = torch.randn(args.dim, args.dim, device=args.device) / args.dim**0.5
            if on_cuda:
                with torch.cuda.stream(offload):
                    torch.cuda._sleep(2_000_000)
                    target.w.copy_(new)
            else:
                target.w.copy_(new)
            xt, xd = torch.randn(8, args.dim, device=args.device), torch.randn(8, args.dim, device=args.device)
            got_t, got_d = ct(xt), cd(xd)
            if on_cuda:
                torch.cuda.synchronize()
            torch.testing.assert_close(got_t, (xt @ new) * torch.sigmoid(xt @ new.t()))
            torch.testing.assert_close(got_d, draft(xd))
        channels = COMM.channels()
        print(f"channels: {len(channels)} live, one per owner and lane:")
        for key, ch in sorted(channels.items()):
            print(f"  {key}: {ch.calls} call(s), staging at {ch.staging.data_ptr():#x}")
        assert len({ch.staging.data_ptr() for ch in channels.values()}) == len(channels)
        graph = next(g for g in reversed(last_compiled()) if g.name == "inference").graph
        joins = [line.strip() for line in printer.dump(graph).splitlines() if "join_external" in line]
        print(f"external stream joins in the dump: {len(joins)}")
        for line in joins:
            print(f"  {line.split('  {')[0]}  ({line.split('why=')[-1].rstrip('}')})")
        print(summarize_dir(dump))
        print(f"result equals eager on {args.device} (target and draft interleaved, weights from the offload "
              "stream): OK")
        print(f"annotated IR per pass: {dump}")
    if on_cuda:
        capturepass.external_stream("offload", None)


if __name__ == "__main__":
    main()
