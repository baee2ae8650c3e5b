"""Transformers architectures outside the model zoo, through ``backend="capturepass"``, against eager.

The zoo (:mod:`capturepass.testing.zoo`) is the tested corpus; this sweep tries further decoder
architectures as a new user would: each built from a tiny config (two layers, hidden 64, float32,
random weights), compiled with default options, and called at three shapes, the second and third
of which make Dynamo recompile the graph with dynamic sizes. Every call's logits are compared with
eager's at the zoo's CPU tolerance. Dynamo's caches are reset between models: transformers' shared
wrappers are one frame for every model, whose recompile limit would otherwise run later models
eagerly (and equal to eager for no merit).

    python3 scripts/arch_sweep.py                     # every architecture below, on the CPU
    python3 scripts/arch_sweep.py --models opt,bloom --device cuda

Prints one line per model (``OK`` with the largest absolute difference, or ``FAIL`` with the
error's last frames) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=128)
# Per architecture, the config fields that differ from SMALL (names of its own, or a valid padding id).
ARCHITECTURES: dict[str, dict] = {
    "phi3": dict(pad_token_id=0),
    "stablelm": {},
    "starcoder2": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "nemotron": {},
    "glm": dict(pad_token_id=0),
    "helium": dict(head_dim=16),
    "exaone4": {},
    "smollm3": dict(pad_token_id=0),
    "ernie4_5": {},
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_layer=2, n_head=4),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_ctx=128, n_positions=128),
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, block_size=8),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, mamba_dt_rank=8),
    "mamba": dict(state_size=8, use_mambapy=False),
}
SHAPES = ((2, 8), (3, 8), (3, 5))


def check(name: str, device: str) -> float:
    """The largest absolute difference from eager over :data:`SHAPES` (raises on a failure)."""
    import torch
    import transformers

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.testing import zoo

    torch._dynamo.reset()
    fields = dict(SMALL, **ARCHITECTURES[name])
    config = transformers.AutoConfig.for_model(name, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(device)
    compiled = torch.compile(model, backend="capturepass")
    tol = zoo.TOLERANCE[device]
    worst = 0.0
    with torch.no_grad():
        for shape in SHAPES:
            g = torch.Generator().manual_seed(sum(shape))
            ids = torch.randint(0, config.vocab_size, shape, generator=g).to(device)
            ref = model(input_ids=ids, use_cache=False).logits
            got = compiled(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(got, ref, **tol)
            worst = max(worst, float((ref - got).abs().max()))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ARCHITECTURES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        p.error(f"unknown architecture: {', '.join(unknown)} (known: {', '.join(ARCHITECTURES)})")
    import transformers

    transformers.logging.set_verbosity_error()  # random-init and unused-key notices
    failed = 0
    for name in names:
        try:
            print(f"OK   {name}: largest difference {check(name, args.device):.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row, not the end of the sweep
            failed += 1
            frames = traceback.format_exc().strip().splitlines()[-5:]
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}\n     " + "\n     ".join(frames), flush=True)
    print(f"{len(names) - failed} of {len(names)} equal to eager")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
