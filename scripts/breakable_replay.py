"""A mixture-of-experts stack with breaks, replayed in a loop: the heap abort's pattern, small.

The static-cache generations that abort with a corrupted host heap on torch 2.11
(RELIABILITY.md) all ran models whose experts go through an op that cannot be captured
(``transformers::grouped_mm_fallback``: it reads its offsets with ``.tolist()``), so their
graphs are breakable: captured segments replayed, that op run eagerly between them. This
script is that pattern without transformers: a stack of ``--layers`` expert layers (a router,
top-2 of ``--experts`` experts, a grouped matrix product through a custom op that reads its
offsets on the host, the weighted sum) called ``--calls`` times at alternating token counts,
every result compared with eager's. ``--mode`` says what runs it:

- ``capturepass``: ``torch.compile(backend="capturepass")`` with ``--options`` (and the
  switches of ``scripts/static_generations.py``: ``--declare``, ``--without``);
- ``torch``: the control, a breakable capture written by hand in plain torch: the code between
  two calls of the op captured with ``torch.cuda.graph`` (one pool for every graph of every
  shape), each call of the op run eagerly between the replays on the graphs' outputs, its
  result copied into the next graph's input buffer (CUDA only);
- ``segments``: the same segments and breaks run eagerly, without capture (what ``torch``
  replays, checked on any device);
- ``eager``: the model as it is.

    python3 scripts/breakable_replay.py --device cuda                 # capturepass
    python3 scripts/breakable_replay.py --device cuda --mode torch    # the hand-written control
    python3 scripts/breakable_replay.py --device cuda --without weak-args,let-go

Prints one line (``OK`` or ``FAIL``, the calls, the largest difference from eager) and exits 1
on a difference beyond the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENS = (8, 16)  # alternating: two captured shapes
TOP_K = 2


@torch.library.custom_op("breakable_replay::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[i-1]:offs[i]`` of ``x`` times ``w[i]``; the offsets are read on the host, as
    transformers' fallback reads them (one synchronization, no capture)."""
    out = torch.zeros(x.size(0), w.size(2), device=x.device, dtype=x.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[i], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), w.size(2))


class Experts(torch.nn.Module):
    """``layers`` residual expert layers (no attention: the breaks are what matters)."""

    def __init__(self, hidden: int, inter: int, experts: int, layers: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / shape[-2] ** 0.5, requires_grad=False)

        self.experts = experts
        self.router = torch.nn.ParameterList(param(hidden, experts) for _ in range(layers))
        self.up = torch.nn.ParameterList(param(experts, hidden, inter) for _ in range(layers))
        self.down = torch.nn.ParameterList(param(experts, inter, hidden) for _ in range(layers))

    # The layer in steps: ``steps()`` lists them, marking the op's calls (the breaks).
    def route(self, i: int, st: dict[str, torch.Tensor]) -> None:
        x = st["x"]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        topw, topi = (h @ self.router[i]).softmax(-1).topk(TOP_K)
        flat = topi.flatten()
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts - 1)
        st.update(xs=h[order // TOP_K], offs=counts.cumsum(0).to(torch.int32), order=order, topw=topw)

    def expert_up(self, i: int, st: dict[str, torch.Tensor]) -> None:
        st["up"] = grouped_mm(st["xs"], self.up[i], st["offs"])

    def activate(self, i: int, st: dict[str, torch.Tensor]) -> None:
        st["act"] = torch.nn.functional.silu(st["up"])

    def expert_down(self, i: int, st: dict[str, torch.Tensor]) -> None:
        st["down"] = grouped_mm(st["act"], self.down[i], st["offs"])

    def combine(self, i: int, st: dict[str, torch.Tensor]) -> None:
        down = st["down"]
        out = torch.zeros_like(down).index_copy(0, st["order"], down)
        x = st["x"]
        st["x"] = x + (out.view(x.size(0), TOP_K, -1) * st["topw"].unsqueeze(-1)).sum(1)

    def steps(self) -> list[tuple[bool, Callable[[dict[str, torch.Tensor]], None]]]:
        """``(is_break, step)`` in order; a step reads and writes the state by name."""
        out: list[tuple[bool, Callable[[dict[str, torch.Tensor]], None]]] = []
        for i in range(len(self.up)):
            for brk, fn in ((False, self.route), (True, self.expert_up), (False, self.activate),
                            (True, self.expert_down), (False, self.combine)):
                out.append((brk, lambda st, fn=fn, i=i: fn(i, st)))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = {"x": x}
        for _, step in self.steps():
            step(st)
        return st["x"]


def _groups(model: Experts) -> list[tuple[bool, list[Callable[[dict[str, torch.Tensor]], None]]]]:
    """The steps grouped: consecutive steps that are not breaks make one segment."""
    groups: list[tuple[bool, list[Callable[[dict[str, torch.Tensor]], None]]]] = []
    for brk, step in model.steps():
        if brk or not groups or groups[-1][0]:
            groups.append((brk, [step]))
        else:
            groups[-1][1].append(step)
    return groups


def _run(groups: list[tuple[bool, list[Callable[[dict[str, torch.Tensor]], None]]]],
         st: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs every step of ``groups`` eagerly on the state ``st``; returns it."""
    for _, steps in groups:
        for step in steps:
            step(st)
    return st


class Segments:
    """The model run as its segments and breaks, each segment captured in a CUDA graph (``capture``)
    or run eagerly; one graph pool for every segment of every shape."""

    def __init__(self, model: Experts, capture: bool) -> None:
        self.groups = _groups(model)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.shapes: dict[tuple[int, ...], Any] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.capture:
            return _run(self.groups, {"x": x})["x"]
        plan = self.shapes.get(tuple(x.shape))
        if plan is None:
            plan = self.shapes[tuple(x.shape)] = self._capture(x)
        static_x, parts = plan
        static_x.copy_(x)
        for brk, thing in parts:
            if brk:
                # thing: (steps, the state the graph captured, the next graph's buffers by name)
                steps, state, buffers = thing
                fresh = dict(state)
                for step in steps:
                    step(fresh)
                for name, buf in buffers.items():
                    buf.copy_(fresh[name])
            else:
                thing.replay()
        return parts[-1][1].outputs["x"].clone()

    def _capture(self, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[bool, Any]]]:
        # Warm-up on a side stream (cuBLAS's handles, first-call caches), as torch's docs do.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _run(self.groups, {"x": x.clone()})
        torch.cuda.current_stream().wait_stream(side)
        static_x = x.clone()
        st = {"x": static_x}  # the values the next segment reads: graph outputs or buffers
        parts: list[tuple[bool, Any]] = []
        for brk, steps in self.groups:
            if brk:
                fresh = dict(st)
                for step in steps:
                    step(fresh)  # on values the graphs computed (each is replayed once below)
                buffers = {k: v.clone() for k, v in fresh.items() if k not in st or v is not st[k]}
                parts.append((True, (steps, dict(st), buffers)))
                st.update(buffers)
                continue
            graph = torch.cuda.CUDAGraph()
            before = dict(st)
            with torch.cuda.graph(graph, pool=self.pool):
                for step in steps:
                    step(st)
            graph.outputs = {k: v for k, v in st.items() if k not in before or v is not before[k]}
            graph.replay()  # the values the next break runs on at capture
            parts.append((False, graph))
        return static_x, parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="capturepass", choices=("capturepass", "torch", "segments", "eager"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--options", default="{}", help="capturepass's options, a JSON object")
    p.add_argument("--declare", action="store_true", help="declare the op not capturable before the compile")
    p.add_argument("--without", default="", help="static_generations.py's switches (comma-separated)")
    args = p.parse_args()
    if args.mode == "torch" and args.device != "cuda":
        p.error("--mode torch captures CUDA graphs: it needs --device cuda")
    if args.mode != "capturepass" and (args.declare or args.without or args.options != "{}"):
        p.error("--options, --declare and --without are capturepass's")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    model = Experts(args.hidden, 2 * args.hidden, args.experts, args.layers).to(device)
    if args.mode == "capturepass":
        import capturepass
        from static_generations import _without

        if args.declare:
            capturepass.register_capability(grouped_mm, capturable=False)
        _without(list(filter(None, args.without.split(","))))
        run: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
            model, backend="capturepass", options=json.loads(args.options))
    elif args.mode == "eager":
        run = model
    else:
        run = Segments(model, capture=args.mode == "torch")
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for call in range(args.calls):
            x = torch.randn(TOKENS[call % len(TOKENS)], args.hidden, generator=g).to(device)
            got = run(x)
            want = model(x)
            worst = max(worst, (got - want).abs().max().item())
    ok = worst <= 1e-4
    print(f"{'OK  ' if ok else 'FAIL'} {args.mode} {args.options}"
          f"{' --declare' if args.declare else ''}{f' --without {args.without}' if args.without else ''}: "
          f"{args.calls} calls, largest difference from eager {worst:.2e}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
