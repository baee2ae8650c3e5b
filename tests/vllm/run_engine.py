"""Runs a real vLLM engine on the CPU on a tiny model (random weights) and prints its greedy tokens as JSON.

A script, run by tests/vllm/test_vllm_engine.py with the ``.venv-vllm``
interpreter (vLLM spawns worker processes, so the engine starts under
``if __name__ == "__main__"``)::

    python tests/vllm/run_engine.py --route {none,backend,qualified,pass,inductor} --work DIR [--model NAME]

``--route``: ``none`` (mode 0, no compilation), ``backend``
(``DYNAMO_TRACE_ONCE`` with ``backend="capturepass"``, the plugin's name),
``qualified`` (``backend="capturepass.backend"``, with the plugin disabled
through ``VLLM_PLUGINS``), ``pass`` (``VLLM_COMPILE`` with
``inductor_passes={"post_grad_custom_post_pass": "capturepass.post_grad_pass"}``), ``inductor``
(``VLLM_COMPILE`` without the pass: vLLM's own compile). ``--model``: the tiny Llama (default), the
tiny Qwen2-MoE, or one of ``SWEEP_CONFIGS`` (scripts/vllm_sweep.py).
The caller sets the environment (``VLLM_CACHE_ROOT``, ``CAPTUREPASS_DUMP_DIR``, ...).
The last line of stdout is ``RESULT {"tokens": [...], "logprobs": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os

PROMPT = [1, 7, 42, 3, 99, 15, 64, 2]
MAX_TOKENS = 8
# Log-probabilities of one token under two compiles of one float32 model differ by rounding alone.
LOGPROB_TOL = 1e-4

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

# A tiny Qwen2-MoE: routed experts beside a gated shared expert (the overlap capturepass exists
# for), through vLLM's own fused-MoE layer.
MOE_CONFIG = {
    **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")},
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
    "use_sliding_window": False,
}
# Further architectures for scripts/vllm_sweep.py, each through vLLM's own model code: MoE layers
# with and without shared experts, multi-head latent attention, soft-capped logits, fused QKV.
_BASE = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
SWEEP_CONFIGS = {
    "mixtral": {**_BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**_BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True},
    "olmoe": {**_BASE, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "num_experts": 4,
              "num_experts_per_tok": 2},
    "granitemoe": {**_BASE, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                   "num_local_experts": 4, "num_experts_per_tok": 2},
    # vLLM's CPU MLA takes a latent of 512 and a rotary part of 64 (DeepSeek's own widths).
    "deepseek_v2": {**_BASE, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 64, "n_group": 1,
                    "topk_group": 1, "topk_method": "greedy"},
    "gemma2": {**_BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64, "sliding_window": 16,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True},
    "phi3": {**_BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "pad_token_id": 0},
    "qwen3": {**_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2,
             "vocab_size": 128, "n_positions": 256, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"},
}
MODELS = {"llama": CONFIG, "qwen2_moe": MOE_CONFIG, **SWEEP_CONFIGS}

ROUTES = {
    "none": {"mode": 0},
    "backend": {"mode": "DYNAMO_TRACE_ONCE", "backend": "capturepass"},
    "qualified": {"mode": "DYNAMO_TRACE_ONCE", "backend": "capturepass.backend"},
    "pass": {
        "mode": "VLLM_COMPILE",
        "backend": "inductor",
        "inductor_passes": {"post_grad_custom_post_pass": "capturepass.post_grad_pass"},
    },
    # vLLM's own compile without capturepass: what the pass route's pieces are, before the pass.
    "inductor": {"mode": "VLLM_COMPILE", "backend": "inductor"},
}


def engine_env(work: str, cache: str, dump: str | None, root: str, **extra: str) -> dict[str, str]:
    """The environment of one engine run: the caller's without its ``CAPTUREPASS_*`` and ``VLLM_*``
    settings, vLLM's CPU settings, caches of its own under ``work/cache``, capturepass's dumps in
    ``work/dump`` (none: no dumps), ``root`` (the checkout) importable, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPTUREPASS_", "VLLM_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        VLLM_CACHE_ROOT=os.path.join(work, cache),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(work, cache, "inductor"),
        PYTHONPATH=root,
    )
    if dump is not None:
        env["CAPTUREPASS_DUMP_DIR"] = os.path.join(work, dump)
    env.update(extra)
    return env


def write_model(directory: str, name: str = "llama") -> str:
    """Writes the tiny model into ``directory``: its config, and random weights (seeded) saved by
    transformers. vLLM's dummy weights (uniform in +-1e-3) would make every logit equal: any
    result would then give the same tokens."""
    import torch
    import transformers

    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory  # the same seed made it: engines of one test share it
    os.makedirs(directory, exist_ok=True)
    config = transformers.AutoConfig.for_model(**MODELS[name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=sorted(ROUTES), required=True)
    parser.add_argument("--work", required=True, help="a directory for the model config")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = write_model(os.path.join(args.work, f"tiny-{args.model}"), args.model)
    # Latent attention (kv_lora_rank): on a CPU with AMX tiles vLLM picks its AMX MLA backend, which
    # takes bf16, fp16 or quantized weights only ("expect weight to be bfloat16, ..."), also for a
    # float32 model; its reference CPU backend takes float32 on any CPU.
    mla = {"attention_backend": "CPU_MLA"} if "kv_lora_rank" in MODELS[args.model] else {}
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        seed=0,
        compilation_config=ROUTES[args.route],
        **mla,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=0)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    # The chosen tokens' log-probabilities: greedy tokens alone hide most numeric differences.
    logprobs = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, tokens)]
    print("RESULT " + json.dumps({"route": args.route, "model": args.model, "tokens": tokens, "logprobs": logprobs}),
          flush=True)


if __name__ == "__main__":
    main()
