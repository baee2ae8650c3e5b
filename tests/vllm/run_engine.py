"""Runs a real vLLM engine on the CPU on a tiny Llama and prints its greedy token ids as JSON.

A script, run by tests/vllm/test_vllm_engine.py with the ``.venv-vllm``
interpreter (vLLM spawns worker processes, so the engine starts under
``if __name__ == "__main__"``)::

    python tests/vllm/run_engine.py --route {none,backend,qualified,pass} --work DIR [--out FILE]

``--route``: ``none`` (mode 0, no compilation), ``backend``
(``DYNAMO_TRACE_ONCE`` with ``backend="capturepass"``, the plugin's name),
``qualified`` (``backend="capturepass.backend"``, with the plugin disabled
through ``VLLM_PLUGINS``), ``pass`` (``VLLM_COMPILE`` with
``inductor_passes={"post_grad_custom_post_pass": "capturepass.post_grad_pass"}``).
The caller sets the environment (``VLLM_CACHE_ROOT``, ``CAPTUREPASS_DUMP_DIR``, ...).
The last line of stdout is ``RESULT {"tokens": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os

PROMPT = [1, 7, 42, 3, 99, 15, 64, 2]
MAX_TOKENS = 8

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

ROUTES = {
    "none": {"mode": 0},
    "backend": {"mode": "DYNAMO_TRACE_ONCE", "backend": "capturepass"},
    "qualified": {"mode": "DYNAMO_TRACE_ONCE", "backend": "capturepass.backend"},
    "pass": {
        "mode": "VLLM_COMPILE",
        "backend": "inductor",
        "inductor_passes": {"post_grad_custom_post_pass": "capturepass.post_grad_pass"},
    },
}


def write_model(directory: str) -> str:
    """Writes the tiny Llama's config (weights are dummy) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=sorted(ROUTES), required=True)
    parser.add_argument("--work", required=True, help="a directory for the model config")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = write_model(os.path.join(args.work, "tiny-llama"))
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        seed=0,
        compilation_config=ROUTES[args.route],
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    print("RESULT " + json.dumps({"route": args.route, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
