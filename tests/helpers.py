"""Shared test helpers: build annotated ATen graphs, run passes, dump them one way."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from capturepass.ir.capabilities import REGISTRY, CapabilityRegistry
from capturepass.ir import meta, printer
from capturepass.ir.meta import GraphInfo, OwnerId
from capturepass.ir.options import Options
from capturepass.passes.base import PassContext
from capturepass.backends import dynamo
from capturepass.backends.compile import compile_graph
from capturepass.testing.host_graphs import HostGraphCapture, replay_on_host
from capturepass.testing.models import MoEBlock

_owners = itertools.count(1000)


def aten_graph(
    fn: Callable,
    *inputs: Any,
    name: str = "inference",
    cudagraphs: str = "none",
    static_inputs: Iterable[int] = (),
    tracing_mode: str = "fake",
) -> fx.GraphModule:
    """Traces ``fn`` to a functional ATen graph with fake values and a graph record."""
    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(fn, tracing_mode=tracing_mode)(*inputs)
    meta.set_graph_info(
        gm,
        GraphInfo(
            name=name,
            owner=OwnerId(next(_owners)),
            cudagraphs=cudagraphs,
            static_inputs=frozenset(static_inputs),
        ),
    )
    return gm


def context(registry: CapabilityRegistry | None = None, **options: Any) -> PassContext:
    """A pass context with validated options (the eager inner compiler, and the per-lane regions a
    GPU runs: pass-level tests check the outer program CUDA gets, on the CPU)."""
    options.setdefault("inner", "eager")
    options.setdefault("regions", "lanes")
    return PassContext(options=Options.from_mapping(options), registry=registry or REGISTRY)


def run_passes(
    gm: fx.GraphModule,
    upto: str,
    ctx: PassContext | None = None,
    verify_each: bool = True,
    **options: Any,
) -> PassContext:
    """Runs the ATen-stage pipeline on ``gm`` through the compile driver, up to and including the
    pass named ``upto``; returns the pass context (``artifacts["program"]`` once ``emit`` ran)."""
    ctx = ctx or context(**options)
    compiled = compile_graph(
        gm, [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"], ctx.options,
        upto=upto, verify=verify_each, registry=ctx.registry, record=False,
    )
    return compiled.context


def dump(gm: fx.GraphModule, **settings: Any) -> str:
    """The canonical dump every golden test compares (no title, shapes on, owners numbered in
    print order: a test's graph owner id depends on what the process compiled before)."""
    settings.setdefault("canonical_owners", True)
    return printer.dump(gm, settings=printer.PrintSettings(**settings))


def nodes_named(gm: fx.GraphModule, prefix: str) -> list[fx.Node]:
    """Nodes whose name starts with ``prefix``."""
    return [n for n in gm.graph.nodes if n.name.startswith(prefix)]


def sync_nodes(gm: fx.GraphModule, effect: meta.Effect) -> list[fx.Node]:
    """Nodes with the given effect, in program order."""
    return [n for n in gm.graph.nodes if meta.effect_of(n) is effect]


def unneeded_waits(gm: fx.GraphModule) -> list[str]:
    """The waits of ``gm`` whose removal leaves a graph the verifier accepts (should be none)."""
    import copy

    from capturepass.errors import VerificationError
    from capturepass.ir.verify import verify

    unneeded = []
    for wait in sync_nodes(gm, meta.Effect.WAIT):
        trial = copy.deepcopy(gm)
        trial.graph.erase_node(next(n for n in trial.graph.nodes if n.name == wait.name))
        try:
            verify(trial)
        except VerificationError:
            continue
        unneeded.append(wait.name)
    return unneeded


class HostCapture(HostGraphCapture):
    """Stands in for the executor's capture class on a machine without CUDA: the real warm-up,
    capture bookkeeping and replay path over host graphs (``capturepass.testing.host_graphs``:
    a segment's replay runs its code again on the memory it was captured on and writes its
    results where the capture's outputs live); also checks that a replay sees the in-place
    inputs at their captured addresses, and logs ``("capture" | "replay", id)``."""

    log: list[tuple[str, int]] = []

    def run(self, args, real, before=None):
        HostCapture.log.append(("capture", id(self)))
        return super().run(args, real, before)

    def warm(self, args, real, before=None):
        HostCapture.log.append(("capture", id(self)))
        return super().warm(args, real, before)

    def replay(self, args, check=False):
        # The executor keys the capture on these addresses: a replay must never see another.
        assert {i: args[i].data_ptr() for i in self.in_place} == self.in_place_ptrs
        HostCapture.log.append(("replay", id(self)))
        return super().replay(args, check)


def capture_on_host(set_attr: Callable[[Any, str, Any], None] = setattr) -> list[tuple[str, int]]:
    """Makes the executors made from now on "capture" and "replay" on the host, as on a GPU, with
    :class:`HostCapture` (``capturepass.testing.host_graphs.replay_on_host``); ``set_attr`` makes
    the changes (``monkeypatch.setattr`` in a test, to undo them). Returns :attr:`HostCapture.log`,
    emptied."""
    replay_on_host(capture_class=HostCapture, set_attr=set_attr)
    HostCapture.log = []
    return HostCapture.log


@torch.library.custom_op("cptest::host_round", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def host_round(x: torch.Tensor) -> torch.Tensor:
    """A host round trip (rounding to 1/64 on the CPU): it synchronizes and cannot be captured, so
    a captured graph breaks around it and it runs between replays, in fresh memory."""
    return (torch.round(x.cpu() * 64.0) / 64.0).to(x.device)


@host_round.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def compiled_since(before: list) -> list:
    """The graphs ``last_compiled()`` holds now that were not in ``before`` (a list taken from it
    earlier: it keeps at most 32, so lengths cannot be compared)."""
    from capturepass.backends.compile import last_compiled

    seen = {id(g) for g in before}  # ``before`` holds them: their ids stay theirs
    return [g for g in last_compiled() if id(g) not in seen]


def load_script(relative: str) -> Any:
    """The module of the repository's script at ``relative`` (``"scripts/fusion_lanes.py"``), loaded
    from its file (scripts are not a package)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relative)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(script: str, *args: str, timeout: float = 120) -> "subprocess.CompletedProcess":
    """Runs ``bench/<script>`` with ``args`` in a fresh interpreter (the repository importable)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, os.path.join(root, "bench", script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def written_lanes(graph: fx.Graph) -> dict[fx.Node, int | None]:
    """Each node of a graph the pass route wrote to the lane it runs on: the lane of the last
    ``capturepass::lane_step`` before it (``None`` before the first)."""
    lane, lanes = None, {}
    for node in graph.nodes:
        if node.target is torch.ops.capturepass.lane_step.default:
            lane = node.args[3]
        lanes[node] = lane
    return lanes


def two_lanes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two chains of matmuls that read only ``x``, one hinted onto the lane ``aux``."""
    import capturepass

    a = torch.sin(x)
    with capturepass.lane("aux"):
        z = torch.exp(x) * 5
        for _ in range(4):
            z = z @ w
    for _ in range(4):
        a = a @ w
    return torch.tanh(a + z)


def profiled_kernels(call: Callable[[], object], times: int, tmp_path: Any) -> list[dict]:
    """The kernel events of the profiler's Chrome trace of ``times`` calls (on a GPU)."""
    import json

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            call()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]


def overlapping(kernels: list[dict]) -> int:
    """How many kernels start before an earlier-started one has ended (on one stream, none do)."""
    count, end = 0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels):
        count += start < end
        end = max(end, stop)
    return count


def moe_block_fn():
    """The showcase MoE block (its CPU size) as a function of its input and parameters, with them."""
    torch.manual_seed(0)
    model = MoEBlock()
    params = dict(model.named_parameters())

    def f(x, *ps):
        return torch.func.functional_call(model, dict(zip(params, ps)), (x,))

    return f, (torch.randn(16, 64), *params.values())


def candidates_of(fn, inputs, **options):
    """What the backend does for a captured CUDA graph, on the CPU: the cost model's graph compiled,
    the candidates derived from a pristine copy (eager regions, the per-lane regions a GPU runs)."""
    gm = aten_graph(fn, *inputs)
    pristine = dynamo._pristine_copy(gm)
    opts = Options.from_mapping({"inner": "eager", "regions": "lanes", "verify": True, **options})
    examples = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    compiled = compile_graph(gm, examples, opts, record=False)

    def plan_with(overrides):
        new = compile_graph(dynamo._pristine_copy(pristine), examples, dataclasses.replace(opts, **overrides),
                            regions=False, record=False, log_decisions=False)
        return new.graph, new.plan

    return compiled, pristine, opts, plan_with


class SlotCache(torch.nn.Module):
    """Writes ``t`` rows of a cache of ``slots`` where its counter points, then moves the counter
    on (a static KV cache's layer, as transformers writes one); two branches beside each other."""

    def __init__(self, slots: int = 4, d: int = 16) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(slots, d))
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, torch.arange(x.shape[0], device=x.device) + self.n, self.a(x) + self.b(x).relu())
        self.n.add_(x.shape[0])
        return self.cache.sum(0) * 2


class RunningSum(torch.nn.Module):
    """Adds to a buffer of ``rows`` at every call (a running sum, read back in part); two branches
    beside each other. Replays of its graph that were not undone would add again."""

    def __init__(self, rows: int, d: int = 64) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(rows, d))
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(self.a(x).sum(0))
        return self.acc[:4].sum(0) + self.b(x).relu()
