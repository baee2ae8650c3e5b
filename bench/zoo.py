"""The zoo's decoders at realistic sizes on a GPU: capturepass against what a user would pick instead.

Models (transformers, random weights, bf16, ``attn_implementation="sdpa"``, or ``"eager"`` for
Mamba, which has no attention): the zoo's catalogue entries (``capturepass.testing.zoo``) rebuilt
with hidden sizes of 1024 to 2048 and two to four layers; the MoE models at the layer shapes of
released checkpoints (Qwen2-MoE at Qwen1.5-MoE-A2.7B's: 60 experts top-4 beside a 5632-wide
shared expert). Shapes: a decode-like
batch (``--decode B``: B sequences of one token) and a prefill (``--prefill B,S``). Also, by name,
models whose branches are wide (``bench/branch_models.py``: torchvision's GoogLeNet and Inception
v3, diffusers' Flux and SD3 transformers), each at two shapes of its own.

Variants, each in its own process (so that no compile cache or pool of one variant helps
another; processes start together, and on a GPU their compiles and first calls run one process
at a time under a file lock, as their timings do: capturepass's measured choice takes the same
lock, through ``CAPTUREPASS_PICK_LOCK``, while it times its candidates inside the first call, and
another process's compile on the GPU at that time (Inductor's tuning, reduce-overhead's warm-up
and recording) slows the candidates it times, unevenly, so that processes chose unlike schedules):

- ``eager``;
- ``inductor``: ``torch.compile(model)``;
- ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``;
- ``capturepass``: ``torch.compile(model, backend="capturepass")`` (default options);
- ``capturepass-off``: the same with ``policy="off"`` (one lane);
- ``capturepass-uncaptured``: the same with ``cudagraphs="none"`` (with ``inductor``, the table
  reads it against Inductor's default compile: the uncaptured bar, at most 1.10);
- named only: ``capturepass-lanes`` / ``capturepass-segments`` (``regions="lanes"`` /
  ``"segments"``: one compile per lane region, or per capture segment with its lanes inline),
  ``capturepass-segments-off`` (segments, one lane); ``reduce-overhead+pass``: reduce-overhead
  with ``capturepass.post_grad_pass`` as Inductor's post-grad custom pass (the pass route: the
  lanes written into the graph Inductor compiles, captured by PyTorch's cudagraph trees).

Per model, shape and variant: milliseconds per call (median over repetitions of the mean of
many calls, CUDA events; the calls take turns over ``--inputs`` token sets, the same for every
variant: an MoE model's time depends on its routing, which a kernel's rounding can flip where
random weights leave the router's scores near ties), compile time (the first call, cold caches: every run uses a fresh
``TORCHINDUCTOR_CACHE_DIR``; in brackets the first three calls, by which every variant has
captured: cudagraph trees warm up at a shape's first call and record at its second, capturepass
captures at the first), and peak memory above the weights over the compile and the first
calls (``--memory-sites``: the blocks live at the peak, by where they were allocated, by stream
and the largest of them, into each worker's log, and the variant's own peak: the most that the blocks its calls allocated held at
once, without the bench's references and copies, the figure the memory bars compare). The table gives capturepass default against the faster of reduce-overhead and
capturepass ``policy="off"`` (the never-slower bar: at most 1.01) and against reduce-overhead.
Below it, for the capturepass variants on a GPU, each capture's graphs replayed alone and the
schedule chosen for it, beside the whole call timed on the same inputs (what the whole call adds
to the replay is the host's share; the table's time takes turns over token sets, whose routing
moves an MoE model's time), and each
variant's time per call on the host alone (wall clock, no synchronisation: where it exceeds the
CUDA-event time, the host paces the call: the median of five loops; each process so paced is
listed with its slowest loop, the involuntary context switches while it timed and the cores it
ran on). With ``--out``, each worker's log is kept in
``DIR/logs``.

Each cell is the median over ``--procs`` processes (three by default), with their range: a
single process per cell swung by 2 to 5% on Qwen2-MoE at decode on the H200, more than the
never-slower bar's 1%, and two captures of one program over the very same weights differed by
-0.2% to +2.9% on Mixtral's decode (where the grouped GEMM's buffers lie; ``bench/same_weights.py``
compares variants in one process).

Run: ``python bench/zoo.py --out DIR`` (``--models``, ``--variants``, ``--jobs``, ``--procs``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import branch_models  # noqa: E402
from branch_models import Workload  # noqa: E402
from timing import fresh_caches, peak_blocks, peak_sites, save, timed  # noqa: E402

VARIANTS = ("eager", "inductor", "reduce-overhead", "capturepass", "capturepass-off", "capturepass-uncaptured")
# Not run unless named: the two routes side by side, whichever is the default; the default with
# its outputs returned as they are (no aliases, and captures keep their memory: no let-go).
ROUTES = {
    "capturepass-static": {"static_outputs": True},
    "capturepass-lanes": {"regions": "lanes"},
    "capturepass-segments": {"regions": "segments"},
    "capturepass-segments-off": {"regions": "segments", "policy": "off"},
    "reduce-overhead+pass": None,
}

# Config overrides per zoo model: realistic widths, few layers (the per-layer schedule repeats).
SIZES: dict[str, dict] = {
    "llama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "qwen2_moe": dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                      num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, intermediate_size=5632, vocab_size=32000),
    "mixtral": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=16,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000),
    "qwen3_moe": dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, num_local_experts=32, num_experts_per_tok=4, moe_intermediate_size=768,
                      vocab_size=32000),
    "deepseek_v3": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
                        num_key_value_heads=16, moe_intermediate_size=512, n_routed_experts=16,
                        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=384,
                        kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                        vocab_size=32000,
                        # Derived from the two above when a config is made; the catalogue's stale
                        # values would otherwise be carried over.
                        head_dim=32, qk_head_dim=96),
    "gpt2": dict(n_embd=1024, n_inner=4096, n_layer=4, n_head=16, vocab_size=32000),
    # A state-space decoder: no attention, no KV cache; its cache is the convolution and SSM states.
    "mamba": dict(hidden_size=1024, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4, vocab_size=32000),
}
SHARED_EXPERT = ("qwen2_moe", "deepseek_v3")


def build(name: str, device: str, sizes: str = "real"):
    """The zoo model ``name`` rebuilt at :data:`SIZES` in bf16 (``sizes="real"``), or as the
    catalogue builds it in float32 (``"zoo"``: tiny, where the host's share of a call shows), on
    ``device``; and its vocabulary size."""
    import torch
    import transformers

    from capturepass.testing import zoo

    if sizes == "zoo":
        model, _ = zoo.build(name, device=None if device == "meta" else device)
        return model, zoo.VOCAB
    small, _ = zoo.build(name)
    fields = small.config.to_dict()
    fields.update(SIZES[name])
    fields.pop("layer_types", None)  # derived from the layer count when the config is made
    for key in ("max_position_embeddings", "n_positions"):
        if key in fields:
            fields[key] = max(fields[key], 4096)
    config = type(small.config)(**fields)
    kwargs = {"experts_implementation": "grouped_mm"} if hasattr(config, "num_experts_per_tok") else {}
    torch.manual_seed(0)
    attn = "sdpa" if small._supports_sdpa else "eager"  # a model without attention takes "eager" only
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, **kwargs)
    return model.to(dtype=torch.bfloat16).eval(), config.vocab_size


def compiled(model, variant: str):
    import torch

    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    import capturepass  # noqa: F401 - registers the backend where no entry point is installed

    if variant == "reduce-overhead+pass":
        torch._inductor.config.post_grad_custom_post_pass = capturepass.post_grad_pass
        return torch.compile(model, mode="reduce-overhead")

    opts = {"capturepass-off": {"policy": "off"}, "capturepass-uncaptured": {"cudagraphs": "none"}, **ROUTES}.get(variant, {})
    return torch.compile(model, backend="capturepass", options=opts)


def compile_turn(cuda: bool) -> contextlib.AbstractContextManager:
    """A worker's turn for its compiles and first calls: on a GPU the lock its timings and
    capturepass's measured choice take (see the module doc); on the CPU none, where compiles
    overlap (no choice is measured there)."""
    if not cuda:
        return contextlib.nullcontext()
    from capturepass.runtime.pick import measuring_turn

    return measuring_turn()


@contextlib.contextmanager
def turn(lock_path: str):
    """Holds the GPU timing lock once every process has compiled: timings neither overlap each
    other nor a compile (CPU contention slows the host side of a call)."""
    from capturepass.runtime.pick import measuring_turn

    # The same turn as capturepass's measured choice (``CAPTUREPASS_PICK_LOCK`` names this file
    # in every worker): a timed call that captures a new shape measures its candidates inside
    # it, where a lock of its own on the file would wait on this one forever.
    assert os.environ.get("CAPTUREPASS_PICK_LOCK") == lock_path, "the worker's timing lock is not its pickers'"
    _arrive(lock_path, "ready", "go")
    with measuring_turn():
        yield
    # A process that exits tears down its CUDA context and compile workers: not while another
    # process is timing.
    _arrive(lock_path, "done", "exit")


def _arrive(lock_path: str, reached: str, release: str) -> None:
    """Says this process reached a barrier of :func:`wave`, and waits for its release."""
    open(f"{lock_path}.{reached}.{os.getpid()}", "w").close()
    while not os.path.exists(f"{lock_path}.{release}"):
        time.sleep(0.2)


def run_variant(fn, inputs: dict):
    """One call of the variant under test. Its name marks, in a memory history, the blocks the
    variant allocated (:func:`own_peak`) apart from the bench's own (references, copies)."""
    return fn(**inputs)


def workload(args: argparse.Namespace) -> Workload:
    """The model of ``args`` with its shapes: a decoder of :data:`SIZES` at ``--decode`` and
    ``--prefill`` (token ids, no KV cache), or one of ``branch_models.MODELS`` at its own."""
    import torch

    if args.model in branch_models.MODELS:
        return branch_models.build(args.model, args.device, args.sizes)
    model, vocab = build(args.model, args.device, args.sizes)
    prefill_b, prefill_s = (int(v) for v in args.prefill.split(","))

    def tokens(b: int, s: int) -> Callable[[int], dict]:
        def make(seed: int) -> dict:
            g = torch.Generator(device=args.device)
            g.manual_seed(seed)
            return dict(input_ids=torch.randint(0, vocab, (b, s), device=args.device, generator=g), use_cache=False)
        return make

    shapes = {f"decode[{args.decode},1]": tokens(args.decode, 1),
              f"prefill[{prefill_b},{prefill_s}]": tokens(prefill_b, prefill_s)}
    return Workload(model, shapes, lambda out: out.logits)


def worker(args: argparse.Namespace) -> None:
    """One model and variant in this process: prints one JSON line per shape."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("capturepass").setLevel(logging.INFO)  # its choices and fallbacks, into DIR/logs
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's request at its timeout
    dev = args.device
    cuda = dev == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    model, shapes, output = workload(args)
    weights = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        if args.memory_sites:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    fn = compiled(model, args.variant)
    results, timed_calls, same_inputs, steady, owners = {}, {}, {}, {}, {}
    replays = [] if cuda and args.variant.startswith("capturepass") else None
    gpu_turn = contextlib.ExitStack()  # closed before the timed turn, which takes the lock again
    gpu_turn.enter_context(compile_turn(cuda))
    with torch.no_grad():
        for label, make in shapes.items():
            inputs = [make(seed) for seed in range(4)]
            ref = output(model(**inputs[3])).float()
            made = capture_owners()
            start = time.perf_counter()
            run_variant(fn, inputs[0])
            if cuda:
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            for x in inputs[1:3]:
                run_variant(fn, x)
            if cuda:
                torch.cuda.synchronize()
            ready_s = time.perf_counter() - start
            got = output(run_variant(fn, inputs[3])).float()
            err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            results[label] = dict(compile_s=compile_s, ready_s=ready_s, rel_err=err)
            owners[label] = serving(made, set())
            # The timed calls take turns over --inputs token sets, the same for every variant: an
            # MoE model's time depends on where its router sends the tokens, and with random
            # weights its scores are near ties that a kernel's rounding flips (one token set
            # against another moved DeepSeek-V3's decode by up to 1.7% on the H200).
            rotation = inputs[1:3]
            rotation += [make(seed) for seed in range(4, 4 + max(0, args.inputs - 2))]
            rotation = rotation[:max(1, args.inputs)]
            timed_calls[label] = (lambda turn=itertools.cycle(rotation): run_variant(fn, next(turn)))
            same_inputs[label] = (lambda x=rotation[0]: run_variant(fn, x))
            # The rotation's last set: the first timed call then finds its inputs elsewhere than
            # the call before it. Two calls in a row on the same tensors make capturepass capture
            # them in place, and the next set moved them again: two captures in the timed calls.
            steady[label] = (lambda x=rotation[-1]: run_variant(fn, x))
        # Dynamo tries its newest graph first: once a later shape made it compile a dynamic graph,
        # an earlier shape that graph admits too runs through it from then on (a DiT's token
        # count; not a batch of one, which Dynamo specialises), and capturepass captures that
        # shape anew there. One more call of every shape before the memory is read and the calls
        # are timed: both are of the steady state, not of the graphs the shapes met first.
        for label, call in steady.items():
            made = capture_owners()
            call()
            owners[label] = serving(made, owners[label])
        if cuda:
            torch.cuda.synchronize()
        gpu_turn.close()
        peak = (torch.cuda.max_memory_allocated() - weights) / 2**20 if cuda else 0.0
        own = None
        if cuda and args.memory_sites:
            snapshot = torch.cuda.memory._snapshot()
            own = own_peak(snapshot) / 2**20
            print(f"memory of {args.model} {args.variant} over its compiles and first calls (above the "
                  f"weights):\n{peak_sites(snapshot)}", file=sys.stderr, flush=True)
            torch.cuda.memory._record_memory_history(enabled=None)
        with turn(args.lock):
            for label, call in timed_calls.items():
                collections = sum(st["collections"] for st in gc.get_stats())
                mallocs = device_mallocs(dev)
                before = resource.getrusage(resource.RUSAGE_SELF)
                cpus = {current_cpu()}
                results[label]["ms"] = timed(call, iters=args.iters, device=dev)
                results[label]["gc_runs"] = sum(st["collections"] for st in gc.get_stats()) - collections
                results[label]["device_mallocs"] = device_mallocs(dev) - mallocs
                host = [host_time(call, iters=args.iters, device=dev) for _ in range(HOST_REPS)]
                results[label]["host_ms"] = statistics.median(host)
                results[label]["host_ms_max"] = max(host)
                cpus.add(current_cpu())
                after = resource.getrusage(resource.RUSAGE_SELF)
                # A process the kernel took off its core while it timed (involuntary switches), or
                # moved to another core, has a host share that says little about the variant.
                results[label]["preempted"] = after.ru_nivcsw - before.ru_nivcsw
                results[label]["cpus"] = sorted(c for c in cpus if c is not None)
                results[label]["syncs"] = host_syncs(call, dev)
                if args.profile:
                    print(f"profile of {args.model} {args.variant} {label}, {args.iters} calls:\n"
                          f"{host_profile(call, args.iters)}", file=sys.stderr, flush=True)
                if replays is not None:
                    # The replay alone repeats one input set; so does this whole call: an MoE
                    # model's time depends on its routing, and the rotation's other token sets
                    # would count as the host's share (+2% on Qwen2-MoE at decode on an H100).
                    one = same_inputs[label]
                    made = capture_owners()
                    same = timed(one, iters=args.iters, device=dev)
                    # The same tensors call after call are captured in place (a capture that
                    # replaces the one that copied them): the replay alone is of what these calls ran.
                    owners[label] = serving(made, owners[label])
                    replays += [dict(rep, shape=label, call_ms=same)
                                for rep in replay_times(args.iters, owners[label], one)]
    graphs = capture_summary() if args.variant.startswith("capturepass") else None
    for label, r in results.items():
        print(json.dumps(dict(model=args.model, variant=args.variant, shape=label, device=dev, peak_mib=peak,
                              own_peak_mib=own, graphs=graphs, replays=replays, **r)), flush=True)


def device_mallocs(device: str) -> int:
    """cudaMalloc and cudaFree calls of the caching allocator so far (a call that makes any
    pays the driver, and cudaFree waits for the device)."""
    import torch

    if device != "cuda":
        return 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


# The warning ``set_sync_debug_mode("warn")`` gives at each synchronising call. Its first use in a
# process also warns, once, that the mode "does not yet detect all synchronizing operations":
# not a synchronisation, and counted as one at the first shape before this matched the text.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs(messages) -> int:
    """How many of ``messages`` (warnings' texts) report a synchronising CUDA call."""
    # Warnings raised in C++ reach Python with where they were raised appended
    # (" (Triggered internally at ...)").
    return sum(str(m).startswith(SYNC_WARNING) for m in messages)


def host_syncs(call, device: str) -> int:
    """Synchronising CUDA calls one call makes (``torch.cuda.set_sync_debug_mode``'s warnings)."""
    import warnings

    import torch

    if device != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return count_syncs(w.message for w in caught)


# Loops of ``--iters`` calls timed on the host alone; the median is the table's host time.
HOST_REPS = 5
# A process whose host time per call is at least this fraction of its CUDA-event time is listed
# below the table as paced by its host.
HOST_PACED = 0.9


def current_cpu() -> int | None:
    """The core this process last ran on (``/proc/self/stat``'s 39th field; ``None`` off Linux)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def host_time(call, iters: int, device: str) -> float:
    """Milliseconds per call on the host alone (the wall clock, no synchronisation inside the loop):
    where it is above the CUDA-event time, the host paces the call."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    host = (time.perf_counter() - start) * 1e3 / iters
    if device == "cuda":
        torch.cuda.synchronize()
    return host


def own_peak(snapshot: dict, marker: str = "run_variant") -> int:
    """The most memory the variant itself held at once over a memory history: the blocks
    allocated under a call of ``marker`` (:func:`run_variant`: its compile, captures, calls and
    the outputs it returned), not the bench's references and copies nor the weights.

    The peak above the weights (``peak_mib``) falls wherever the bench's own tensors and the
    variant's meet, which differs between variants (a reference held during one variant's
    capture, during another's warm-up); this is the figure the memory bars compare."""
    return peak_blocks(e for trace in snapshot.get("device_traces", []) for e in trace
                       if e["action"] != "alloc" or any(f["name"] == marker for f in e.get("frames") or []))[0]


def host_profile(call, iters: int, top: int = 30) -> str:
    """The functions ``iters`` calls spend their host time in (cProfile, by own time): where a
    variant's host time per call differs from another's, the difference shows here."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        call()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def capture_owners() -> set[str]:
    """The names of the capture owners every graph compiled in this process holds now."""
    from capturepass.backends.compile import last_compiled

    return {o.name for rec in last_compiled() if rec.executor is not None for o in rec.executor.owners}


def serving(before: set[str], kept: set[str]) -> set[str]:
    """The capture owners a shape's calls run after calls that began with ``before`` (the
    :func:`capture_owners` then): those the calls made (a first capture, a graph that now serves
    the shape, inputs captured in place), else those of ``kept`` still held."""
    now = capture_owners()
    return (now - before) or (kept & now)


def replay_times(iters: int, owners: set[str], call: Callable[[], object]) -> list[dict]:
    """The captures named in ``owners`` (those one shape's calls run), each one's graphs replayed
    alone (milliseconds per replay), with the schedules chosen for its graph: the whole call's
    time less this is the host's share. A call of that shape comes first, each time: a capture's
    input buffers and temporaries are blocks of its model's pool, which another shape's replays
    write (the copy into them is the call's, before its replay)."""
    from capturepass.backends.compile import last_compiled

    out = []
    for rec in last_compiled():
        ex = rec.executor
        if ex is None or not any(o.name in owners for o in ex.owners):
            continue
        choices = [c.text() for c in ex.schedule_choices]
        if not choices:
            # Compiled with one lane without measuring: from an earlier process's choice, or
            # predicted by the device's lane factor (the graph record's decision says which).
            from capturepass.ir import meta

            choices = [d for d in meta.graph_info(rec.graph).decisions if isinstance(d, str) and (
                d.startswith("lanes predicted no faster") or d.startswith("schedule one_lane from the schedule cache"))]
        for owner in ex.owners:
            graphs = list(owner.graphs.values())
            if graphs and owner.name in owners:
                call()
                ms = timed(lambda gs=graphs: [g.replay() for g in gs], iters=iters, device="cuda")
                out.append({"owner": owner.name, "replay_ms": ms, "choices": choices})
    return out


def capture_summary() -> list[dict]:
    """How capturepass ran each graph it compiled in this process (scripts/zoo_table.py's summary)."""
    import importlib.util

    from capturepass.backends.compile import last_compiled

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "zoo_table.py")
    spec = importlib.util.spec_from_file_location("zoo_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table._capture_summary(last_compiled())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SIZES), help="comma-separated zoo names (default: all in SIZES)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sizes", default="real", choices=("real", "zoo"),
                   help="real: SIZES in bf16; zoo: the catalogue's tiny float32 configs (host overhead)")
    p.add_argument("--decode", type=int, default=8, help="decode batch (sequences of one token)")
    p.add_argument("--prefill", default="2,128", help="prefill batch,sequence")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--inputs", type=int, default=8,
                   help="token sets the timed calls take turns over (the same for every variant; the first "
                        "two are the warm-up calls' own)")
    p.add_argument("--jobs", type=int, default=4,
                   help="processes at once (they start together; on a GPU they compile one by one; they time one by one)")
    p.add_argument("--procs", type=int, default=3,
                   help="processes per model and variant (median of medians; each cell also shows their range)")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--profile", action="store_true",
                   help="also profile each variant's calls on the host (cProfile) into its worker log")
    p.add_argument("--memory-sites", action="store_true",
                   help="on a GPU, also record the allocations over the compiles and first calls: the "
                        "variant's own peak goes into the table, the blocks live at the peak, by allocation "
                        "site, into each worker's log")
    p.add_argument("--out", default=None, help="directory for zoo-bench.json and zoo-bench.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--lock", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    from capturepass.testing import zoo as catalogue

    known = list(SIZES) if args.sizes == "real" else [m for m, f in catalogue.FAMILIES.items() if f == "decoder"]
    known += branch_models.MODELS
    unknown = [m for m in models if m not in known] + [v for v in variants if v not in VARIANTS and v not in ROUTES]
    if unknown:
        p.error(f"unknown model or variant: {', '.join(unknown)} (models: {', '.join(known)}; "
                f"variants: {', '.join(VARIANTS)})")
    jobs = [(m, v) for _ in range(args.procs) for m in models for v in variants]
    rows: list[dict] = []
    failures: list[str] = []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for first in range(0, len(jobs), args.jobs):
        rows_, fails_ = wave(jobs[first:first + args.jobs], args)
        rows += rows_
        failures += fails_
        if args.out:  # what finished survives a run cut short
            with open(os.path.join(args.out, "zoo-bench.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows_)
    save(args.out, "zoo-bench", rows, failures, report(rows, models, variants))


def wave(jobs: list[tuple[str, str]], args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Runs ``jobs`` at once: they start together (on a GPU each compiles in its turn of the lock), then
    time one at a time once all are ready."""
    lock = tempfile.NamedTemporaryFile(prefix="zoo-bench-lock-", delete=False).name
    procs = []
    for m, v in jobs:
        # capturepass's measured choice times its candidates under the timing lock too: a choice
        # timed beside another worker's kernels is noise.
        env = fresh_caches(CAPTUREPASS_PICK_LOCK=lock)
        cmd = [sys.executable, __file__, "--worker", "--model", m, "--variant", v, "--lock", lock,
               "--device", args.device, "--sizes", args.sizes,
               "--decode", str(args.decode), "--prefill", args.prefill, "--iters", str(args.iters),
               "--inputs", str(args.inputs)] + \
            (["--profile"] if args.profile else []) + (["--memory-sites"] if args.memory_sites else [])
        procs.append(((m, v), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    start = time.time()
    # Two barriers: all compiled (then they time, one by one), all timed (then they exit).
    for reached, release in (("ready", "go"), ("done", "exit")):
        while time.time() - start < args.timeout:
            if all(os.path.exists(f"{lock}.{reached}.{p.pid}") or p.poll() is not None for _, p in procs):
                break
            time.sleep(0.5)
        open(f"{lock}.{release}", "w").close()
    rows, failures = [], []
    for (m, v), proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1, args.timeout - (time.time() - start)))
        except subprocess.TimeoutExpired:
            # Its threads' Python stacks first (``faulthandler``, registered by the worker), into
            # its log: where a worker that runs out of time was waiting.
            proc.send_signal(signal.SIGUSR1)
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            failures.append(f"{m} {v}: timed out after {args.timeout} s")
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if args.out:  # the worker's log (capturepass's choices, warnings), for the reader of the table
            logs = os.path.join(args.out, "logs")
            os.makedirs(logs, exist_ok=True)
            with open(os.path.join(logs, f"{m}-{v}-{proc.pid}.log"), "w") as f:
                f.write(err)
        rows += got
        if proc.returncode != 0:
            tail = [line for line in err.strip().splitlines() if "Warning" not in line][-25:]
            failures.append(f"{m} {v}: exit {proc.returncode}:\n" + "\n".join(tail))
        print(f"done {m} {v} ({len(got)} shapes)", file=sys.stderr, flush=True)
    return rows, failures


def report(rows: list[dict], models: list[str], variants: list[str]) -> str:
    """A markdown table: medians over processes, the ratios the never-slower bar reads."""
    def values(m: str, v: str, s: str, key: str) -> list:
        return [r[key] for r in rows if r["model"] == m and r["variant"] == v and r["shape"] == s
                and r.get(key) is not None]

    def med(m: str, v: str, s: str, key: str) -> float | None:
        vals = values(m, v, s, key)
        return statistics.median(vals) if vals else None

    def spread(m: str, v: str, s: str, median: float | None) -> str:
        # One process per cell swings by a few percent on some models (each process compiles
        # and tunes its own kernels): the range across processes says what a ratio can mean.
        if median is None:
            return ""
        vals = values(m, v, s, "ms")
        return f"{median:.4f}" if len(vals) < 2 else f"{median:.4f} ({min(vals):.4f}-{max(vals):.4f})"

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    head = ["model", "shape"] + [f"{v} ms" for v in variants] + ["cp / min(ro, off)", "ro / cp"]
    against_inductor = "inductor" in variants
    if against_inductor:
        head.append("cp / inductor")
    # The uncaptured bar: capturepass without CUDA graphs within 1.10x of Inductor's default compile.
    uncaptured = against_inductor and "capturepass-uncaptured" in variants
    if uncaptured:
        head.append("uncaptured / inductor")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        for s in shapes:
            ms = {v: med(m, v, s, "ms") for v in variants}
            if all(x is None for x in ms.values()):
                continue
            cells = [m + (" (shared expert)" if m in SHARED_EXPERT else ""), s]
            cells += [spread(m, v, s, ms[v]) for v in variants]
            cp, ro, off = ms.get("capturepass"), ms.get("reduce-overhead"), ms.get("capturepass-off")
            best = min([x for x in (ro, off) if x is not None], default=None)
            cells.append(f"{cp / best:.3f}" if cp and best else "")
            cells.append(f"{ro / cp:.3f}" if cp and ro else "")
            if against_inductor:
                ind = ms.get("inductor")
                cells.append(f"{cp / ind:.3f}" if cp and ind else "")
            if uncaptured:
                unc = ms.get("capturepass-uncaptured")
                cells.append(f"{unc / ind:.3f}" if unc and ind else "")
            lines.append("| " + " | ".join(cells) + " |")
    def per_variant(what: str, cell: Callable[[str, str, str], str]) -> None:
        lines.extend(["", "| model | shape | " + " | ".join(f"{v} {what}" for v in variants) + " |",
                      "|" + "---|" * (2 + len(variants))])
        for m in models:
            for s in shapes:
                cells = [cell(m, v, s) for v in variants]
                if any(cells):
                    lines.append(f"| {m} | {s} | " + " | ".join(cells) + " |")

    def compile_cell(m: str, v: str, s: str) -> str:
        c, pk, ready = med(m, v, s, "compile_s"), med(m, v, s, "peak_mib"), med(m, v, s, "ready_s")
        if c is None:
            return ""
        own = [r["own_peak_mib"] for r in rows if (r["model"], r["variant"], r["shape"]) == (m, v, s)
               and r.get("own_peak_mib") is not None]
        return (f"{c:.1f}" + (f" ({ready:.1f})" if ready is not None else "") + f" / {pk:.0f}"
                + (f" ({statistics.median(own):.0f} own)" if own else ""))

    def host_cell(m: str, v: str, s: str) -> str:
        got = [r for r in rows if (r["model"], r["variant"], r["shape"]) == (m, v, s) and "host_ms" in r]
        return (f"{statistics.median(r['host_ms'] for r in got):.4f} (syncs {max(r.get('syncs', 0) for r in got)}, "
                f"cudaMalloc/Free {max(r.get('device_mallocs', 0) for r in got)})" if got else "")

    per_variant("compile s (three calls) / peak MiB", compile_cell)
    if any("host_ms" in r for r in rows):
        per_variant("host ms", host_cell)
    seen = set()
    for r in rows:
        for rep in r.get("replays") or []:
            key = (r["model"], r["variant"], rep["owner"])
            if key in seen:
                continue
            seen.add(key)
            if not lines[-1].startswith("replay alone"):
                lines.append("")
            choice = next((c for c in rep["choices"]), "schedule: the cost model's (not measured)")
            same = (f" (whole call on the same inputs {rep['call_ms']:.4f} ms, "
                    f"{rep['call_ms'] / rep['replay_ms']:.3f}x)" if rep.get("call_ms") else "")
            lines.append(f"replay alone: {r['model']} {r['variant']} {rep['owner']}: {rep['replay_ms']:.4f} ms{same}; "
                         f"{choice}")
    # On the CPU the host time is the call's time: nothing to tell apart.
    paced = [r for r in rows if r.get("device", "cuda") == "cuda" and r.get("host_ms") and r.get("ms")
             and r["host_ms"] >= HOST_PACED * r["ms"]]
    if paced:
        # Where the host takes about as long as the GPU, the call's time is the host's.
        lines.append("")
        lines += [f"paced by the host: {r['model']} {r['variant']} {r['shape']}: {r['ms']:.4f} ms, host {r['host_ms']:.4f} "
                  f"(slowest loop {r.get('host_ms_max', r['host_ms']):.4f}), involuntary switches "
                  f"{r.get('preempted', '?')}, cores {r.get('cpus', '?')}" for r in paced]
    errs = [r for r in rows if r.get("rel_err", 0) > 5e-2]
    if errs:
        lines.append("")
        lines += [f"large difference from eager: {r['model']} {r['variant']} {r['shape']} rel {r['rel_err']:.3g}"
                  for r in errs]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
