"""Static-cache generations of the zoo's decoders on CUDA under one backend, against eager's tokens.

The steps of ``tests/test_generate.py::test_generate_with_a_static_cache_gpu`` outside pytest:
for each model, three greedy generations (one prompt twice, then another, eight new tokens, a
static cache, float32, TF32 off) eagerly, then with ``forward`` compiled, token for token. It
exists to run the same calls under several backends and options in fresh processes, under a
heap checker (``scripts/gpu_run.sh heap`` with ``HEAP_VARIANTS``): which path a native heap
fault needs.

    python3 scripts/static_generations.py                                  # capturepass, default options
    python3 scripts/static_generations.py --backend inductor
    python3 scripts/static_generations.py --options '{"policy": "off"}' --models llama
    python3 scripts/static_generations.py --models qwen2_moe --declare transformers::grouped_mm_fallback
    python3 scripts/static_generations.py --models qwen2_moe --without weak-args,pool-routing

``--declare OP`` declares an op not capturable before the compile (its breaks exist from the
first capture: no failed capture, no probe). ``--without`` turns off mechanisms of the capture
path one by one, to find the one a fault needs (diagnosis only; each keeps the results right):

- ``weak-args``: a break's tensor arguments are passed as they are, not as non-owning views;
- ``let-go``: captured outputs and input buffers keep their storages (no non-owning holds,
  no buffers moved into the pool);
- ``pool-routing``: nothing routes a thread's allocations into a graph pool (warm-ups run
  outside it, no pool keeper), as on a torch without that call;
- ``aliases``: replayed outputs are copied out, never handed out as aliases (``let-go`` goes
  with it: it holds only outputs that are handed out);
- ``cublas-clears``: cuBLAS's workspace cache is never cleared around captures;
- ``finalizers``: no finalizer watches a model's tensors or a captured input's storage (their
  captures then go with the model or by ``max_captures``);
- ``heap-search``: a held output's views the caller derived are never searched for on the heap
  (torch without ``UntypedStorage._swap_data_ptr_``): they are expired instead, and raise if read.

Each model's line also says how many times a rescue searched the heap.

Prints one line per model and exits 1 if any generation differs from eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arch_sweep import _compile  # noqa: E402 - the sweep's backends, the same three names
import capturepass  # noqa: E402
from capturepass.testing import zoo  # noqa: E402

NEW_TOKENS = 8


def _without(names: list[str]) -> None:
    """Turns off the capture-path mechanisms ``names`` (see the module doc) for this process,
    and counts the heap searches of those left on."""
    from capturepass.runtime import capture, lifetime, outputs, program, replay

    outputs.gc = _HEAP

    def keep_args(run, *where):
        return run

    switches = {
        "weak-args": lambda: setattr(program, "_weak_args", keep_args),
        "let-go": lambda: setattr(replay.Capture, "_lets_go", lambda self: False),
        "pool-routing": lambda: setattr(capture, "POOL_WARM_UP_UNSUPPORTED", "turned off (--without pool-routing)"),
        "aliases": lambda: setattr(outputs, "UNSUPPORTED", "turned off (--without aliases)"),
        "cublas-clears": lambda: setattr(capture, "clear_cublas_workspaces", lambda: None),
        "finalizers": lambda: (setattr(lifetime, "watch", lambda *a: []),
                               setattr(lifetime, "watch_capture", lambda *a: [])),
        "heap-search": lambda: setattr(_HEAP, "search", False),
    }
    for name in names:
        if name not in switches:
            raise SystemExit(f"--without {name}: not one of {', '.join(switches)}")
        switches[name]()


class _Heap:
    """Stands in for ``gc`` in :mod:`capturepass.runtime.outputs`: counts its heap searches, and
    finds nothing once ``search`` is off."""

    def __init__(self) -> None:
        self.search = True
        self.searches = 0

    def get_objects(self) -> list:
        import gc

        self.searches += 1
        return gc.get_objects() if self.search else []


_HEAP = _Heap()


def _generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # disable_compile: with a static cache transformers would compile the decode step itself.
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              cache_implementation="static", disable_compile=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,qwen2_moe,deepseek_v3")
    p.add_argument("--backend", default="capturepass", choices=("capturepass", "inductor", "reduce-overhead"))
    p.add_argument("--options", default="{}", help="capturepass's options, a JSON object")
    p.add_argument("--declare", default="", help="ops (comma-separated) declared not capturable before the compile")
    p.add_argument("--without", default="", help="capture-path mechanisms to turn off (comma-separated; see above)")
    args = p.parse_args()
    options = json.loads(args.options)
    if args.backend != "capturepass" and options:
        p.error("--options are capturepass's")
    if args.backend != "capturepass" and (args.declare or args.without):
        p.error("--declare and --without are capturepass's")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    for op in filter(None, args.declare.split(",")):
        capturepass.register_capability(op, capturable=False)
    _without(list(filter(None, args.without.split(","))))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    for name in args.models.split(","):
        model, make_inputs = zoo.build(name, device="cuda")
        prompts = [make_inputs(seed)["input_ids"][:, :6] for seed in (0, 0, 1)]
        want = [_generate(model, ids) for ids in prompts]
        model.forward = _compile(model.forward, args.backend, options)
        got = [_generate(model, ids) for ids in prompts]
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        failed += not same
        searches, _HEAP.searches = _HEAP.searches, 0
        extra = "".join(f" --{k} {v}" for k, v in (("declare", args.declare), ("without", args.without)) if v)
        print(f"{'OK  ' if same else 'FAIL'} {name}: {args.backend} {json.dumps(options)}{extra}: "
              f"{3 * NEW_TOKENS} tokens {'equal to' if same else 'unlike'} eager's; heap searches {searches}", flush=True)
        torch._dynamo.reset()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
