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
from capturepass.testing import zoo  # noqa: E402

NEW_TOKENS = 8


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
    args = p.parse_args()
    options = json.loads(args.options)
    if args.backend != "capturepass" and options:
        p.error("--options are capturepass's")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
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
        print(f"{'OK  ' if same else 'FAIL'} {name}: {args.backend} {json.dumps(options)}: "
              f"{3 * NEW_TOKENS} tokens {'equal to' if same else 'unlike'} eager's", flush=True)
        torch._dynamo.reset()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
