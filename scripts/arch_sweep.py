"""Transformers architectures outside the model zoo, through ``backend="capturepass"``, against eager.

The zoo (:mod:`capturepass.testing.zoo`) is the tested corpus; this sweep tries further
architectures as a new user would: decoders (logits of a causal LM), encoders (masked-LM logits
under an attention mask), encoder-decoders (the logits of four decoder tokens over an encoder input
under an attention mask) and vision models (image-classification logits, or the last hidden state),
each built from a tiny config (two layers, width 64 or less, float32, random weights), compiled with
default options, and called at three shapes, the second and third of which make Dynamo recompile
the graph with dynamic sizes. Every call's first output is compared with eager's at the zoo's
tolerance. Dynamo's caches are reset between models: transformers' shared wrappers are one frame
for every model, whose recompile limit would otherwise run later models eagerly (and equal to
eager for no merit).

    python3 scripts/arch_sweep.py                     # every architecture below, on the CPU
    python3 scripts/arch_sweep.py --models opt,swin --device cuda
    python3 scripts/arch_sweep.py --device cuda --procs 8   # eight processes at once, a shard each
    python3 scripts/arch_sweep.py --device cuda --procs 8 --deadline 500   # and the models not reached by then
    python3 scripts/arch_sweep.py --host-captures     # captures and replays run on the host
    python3 scripts/arch_sweep.py --attn flex_attention   # another attention implementation
    python3 scripts/arch_sweep.py --generate --host-captures   # decoders generating through captures
    python3 scripts/arch_sweep.py --regions fused     # every model's code through the lanes' rewrite
    python3 scripts/arch_sweep.py --backend inductor --models opt   # the same calls under torch's own backend
    python3 scripts/arch_sweep.py --models opt --traceback   # a failure's whole traceback

Prints one line per model (``OK`` with the largest absolute difference, and any frame Dynamo
stopped compiling at its recompile limit, which then runs eagerly under any backend; ``FAIL`` with the
error's last frames, or ``SLOW`` for a model equal to eager whose regions Inductor failed to
compile, which then ran as lane regions or eagerly, or whose lanes after fusion the order check
faulted, which then ran on one lane, with the first such warning; with ``--procs``, ``CRASH`` for
the model a process died on, a failure too) and exits 1 if any failed, was slow or was not
reached within ``--deadline``. An output
beyond the tolerance is compared with ``backend="inductor"``'s on the same input: ``TORCH`` (not
a failure of capturepass's) when Inductor's is beyond it too and capturepass's difference is at
most twice Inductor's, ``FAIL`` otherwise; both differences are
printed. An error is ``TORCH`` too where ``backend="inductor"`` fails on the same call (both errors
are printed). On CUDA, TF32 is off for matmuls and convolutions, as in the zoo's GPU tests. With
``--attn`` the models are built with that ``attn_implementation``; one that ``transformers`` has
no such implementation for is ``SKIP`` (counted apart, not a failure). With ``--generate`` each
decoder and encoder-decoder instead generates greedily (three generations: one prompt twice, then another, eight new
tokens each) with its ``forward`` compiled, in a static cache where ``transformers`` can compile
the model's decode step whole and in its default cache otherwise, and every token must be eager's
(``TORCH`` where ``backend="inductor"`` differs from eager's tokens too); the other models, and
a decoder whose eager generation fails, are ``SKIP``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sweep_shards, beside this script

from sweep_shards import run_shards  # noqa: E402 - found through the line above

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=128)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
               max_position_embeddings=128)
VIT = dict(ENCODER, image_size=32, patch_size=8)
# Mixture-of-experts fields under the names different configs read (each reads its own).
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           head_dim=16)
# Multi-head latent attention (no grouped KV heads) and DeepSeek's routing, with one dense layer first.
MLA = dict(MOE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1)
# BART-style encoder-decoders, and T5-style ones (relative position buckets, no biases).
SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512, max_position_embeddings=128, pad_token_id=0,
               eos_token_id=2, bos_token_id=1, decoder_start_token_id=1, forced_eos_token_id=None)
T5_STYLE = dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=512, decoder_start_token_id=0,
                pad_token_id=0)
# Sparse attention with a lightning indexer keeping 4 of 8 keys (DeepSeek-V3.2, GLM's DSA).
DSA = dict(MLA, index_n_heads=2, index_head_dim=16, index_topk=4)
# Per architecture: the head (causal, masked, seq2seq, image or backbone), its base config and the fields of its own.
ARCHITECTURES: dict[str, tuple[str, dict, dict]] = {
    "phi3": ("causal", SMALL, dict(pad_token_id=0)),
    "stablelm": ("causal", SMALL, {}),
    "starcoder2": ("causal", SMALL, {}),
    "olmo2": ("causal", SMALL, {}),
    "cohere": ("causal", SMALL, {}),
    "granite": ("causal", SMALL, {}),
    "nemotron": ("causal", SMALL, {}),
    "glm": ("causal", SMALL, dict(pad_token_id=0)),
    "helium": ("causal", SMALL, dict(head_dim=16)),
    "exaone4": ("causal", SMALL, {}),
    "smollm3": ("causal", SMALL, dict(pad_token_id=0)),
    "ernie4_5": ("causal", SMALL, {}),
    "opt": ("causal", SMALL, dict(ffn_dim=128, word_embed_proj_dim=64)),
    "bloom": ("causal", SMALL, dict(n_layer=2, n_head=4)),
    "codegen": ("causal", SMALL, dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_ctx=128, n_positions=128)),
    "mpt": ("causal", SMALL, dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128)),
    "dbrx": ("causal", SMALL, dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                   attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                   ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})),
    "minimax": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=2, block_size=8)),
    "jamba": ("causal", SMALL, dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                    attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8,
                                    mamba_dt_rank=8)),
    "mamba": ("causal", SMALL, dict(state_size=8, use_mambapy=False)),
    "gemma": ("causal", SMALL, dict(head_dim=16)),
    "glm4": ("causal", SMALL, dict(pad_token_id=0)),
    "glm4_moe": ("causal", SMALL, dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0)),
    "cohere2": ("causal", SMALL, dict(sliding_window=4)),
    "hunyuan_v1_dense": ("causal", SMALL, dict(head_dim=16)),
    "hunyuan_v1_moe": ("causal", SMALL, dict(head_dim=16, num_experts=4, moe_topk=2)),
    "ernie4_5_moe": ("causal", SMALL, dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32)),
    "seed_oss": ("causal", SMALL, dict(head_dim=16)),
    "gpt_oss": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4)),
    "arcee": ("causal", SMALL, {}),
    "olmo3": ("causal", SMALL, dict(sliding_window=4)),
    "phimoe": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=2)),
    "jetmoe": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16)),
    "gpt_bigcode": ("causal", SMALL, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "biogpt": ("causal", ENCODER, {}),
    "xglm": ("causal", SMALL, dict(d_model=64, ffn_dim=128, num_layers=2, attention_heads=4)),
    "persimmon": ("causal", SMALL, {}),
    "lfm2": ("causal", SMALL, {}),
    "bitnet": ("causal", SMALL, {}),
    "apertus": ("causal", SMALL, {}),
    "granitemoeshared": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)),
    "qwen3_next": ("causal", SMALL, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, head_dim=16, linear_num_value_heads=4,
                                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                         layer_types=["linear_attention", "full_attention"])),
    "falcon_h1": ("causal", SMALL, dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                                        head_dim=16)),
    "distilbert": ("masked", {}, dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=512,
                                      max_position_embeddings=128)),
    "electra": ("masked", ENCODER, dict(embedding_size=64)),
    "albert": ("masked", ENCODER, dict(embedding_size=32)),
    "deberta-v2": ("masked", ENCODER, {}),
    "modernbert": ("masked", ENCODER, dict(global_attn_every_n_layers=2, local_attention=8, pad_token_id=0)),
    "mpnet": ("masked", ENCODER, {}),
    "xlm-roberta": ("masked", ENCODER, {}),
    "camembert": ("masked", ENCODER, {}),
    "megatron-bert": ("masked", ENCODER, {}),
    "swin": ("image", {}, dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
    "convnext": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    "resnet": ("image", {}, dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    "convnextv2": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    "regnet": ("image", {}, dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)),
    "poolformer": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1])),
    "beit": ("image", VIT, {}),
    "dinov2": ("backbone", VIT, {}),
    "gemma3_text": ("causal", SMALL, dict(head_dim=16, sliding_window=4)),
    "llama4_text": ("causal", SMALL, dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                                          head_dim=16, attention_chunk_size=4)),
    "olmoe": ("causal", SMALL, MOE),
    "granitemoe": ("causal", SMALL, MOE),
    "minimax_m2": ("causal", SMALL, MOE),
    "afmoe": ("causal", SMALL, MOE),
    "solar_open": ("causal", SMALL, MOE),
    "exaone_moe": ("causal", SMALL, MOE),
    "flex_olmo": ("causal", SMALL, dict(MOE, pad_token_id=0)),
    "hy_v3": ("causal", SMALL, dict(MOE, num_shared_experts=1)),
    "lfm2_moe": ("causal", SMALL, dict(MOE, num_dense_layers=1, layer_types=["conv", "full_attention"])),
    "cohere2_moe": ("causal", SMALL, dict(MOE, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "laguna": ("causal", SMALL, dict(MOE, shared_expert_intermediate_size=64, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"])),
    "mimo_v2_flash": ("causal", SMALL, dict(MOE, v_head_dim=8, sliding_window=4,
                                            layer_types=["full_attention", "sliding_attention"])),
    "qwen3_5_moe_text": ("causal", SMALL, dict(MOE, shared_expert_intermediate_size=64, linear_num_value_heads=4,
                                               linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                               layer_types=["linear_attention", "full_attention"])),
    "gemma4_text": ("causal", SMALL, dict(head_dim=16, global_head_dim=16, sliding_window=4, enable_moe_block=True,
                                          num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                          vocab_size_per_layer_input=512, hidden_size_per_layer_input=16,
                                          layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v2": ("causal", SMALL, MLA),
    "dots1": ("causal", SMALL, MLA),
    "youtu": ("causal", SMALL, dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                    qk_nope_head_dim=8, v_head_dim=16)),
    "glm4_moe_lite": ("causal", SMALL, MLA),
    "minicpm3": ("causal", SMALL, MLA),
    "kimi_linear": ("causal", SMALL, dict(MLA, q_lora_rank=None, linear_head_dim=16, linear_num_heads=4, pad_token_id=0,
                                          layer_types=["linear_attention", "full_attention"])),
    "bailing_hybrid": ("causal", SMALL, dict(MLA, q_lora_rank=None, head_dim=16, pad_token_id=0,
                                             layer_types=["linear_attention", "full_attention"])),
    "longcat_flash": ("causal", SMALL, dict(MLA, num_layers=2, head_dim=8, ffn_hidden_size=128, moe_topk=2,
                                            zero_expert_num=2, expert_ffn_hidden_size=32)),
    "deepseek_v32": ("causal", SMALL, DSA),
    "glm_moe_dsa": ("causal", SMALL, DSA),
    # Keys compressed 2:1 and 4:1 (4:1 and 128:1 in the checkpoints), which 5 to 8 tokens leave entries of.
    "deepseek_v4": ("causal", SMALL, dict(MOE, num_key_value_heads=1, q_lora_rank=32, partial_rotary_factor=0.5,
                                          o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                                          sliding_window=4, hc_mult=2,
                                          compress_rates={"compressed_sparse_attention": 2,
                                                          "heavily_compressed_attention": 4},
                                          layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                                          mlp_layer_types=["hash_moe", "moe"])),
    "mamba2": ("causal", SMALL, dict(num_heads=4, head_dim=32, state_size=8, n_groups=1, expand=2, use_mambapy=False)),
    "falcon_mamba": ("causal", SMALL, dict(state_size=8, use_mambapy=False)),
    "zamba2": ("causal", SMALL, dict(mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1,
                                     attention_head_dim=16, num_mem_blocks=1, hybrid_layer_ids=[1],
                                     layers_block_type=["mamba", "hybrid"])),
    "bamba": ("causal", SMALL, dict(mamba_d_state=8, mamba_d_head=16, mamba_n_heads=8, mamba_n_groups=1,
                                    attn_layer_indices=[1])),
    "recurrent_gemma": ("causal", SMALL, dict(head_dim=16, lru_width=64, attention_window_size=4,
                                              block_types=["recurrent", "attention"])),
    "xlstm": ("causal", SMALL, {}),
    "rwkv": ("causal", SMALL, dict(context_length=128)),
    # Two hybrid layers: Zamba ties the later ones' shared transformer to the first's, and fails on none to tie.
    "zamba": ("causal", SMALL, dict(use_mamba_kernels=False, mamba_d_state=8, mamba_dt_rank=8, n_mamba_heads=2,
                                    layers_block_type=["hybrid", "hybrid"])),
    "granitemoehybrid": ("causal", SMALL, dict(MOE, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_state=8,
                                               mamba_chunk_size=4, layer_types=["mamba", "attention"])),
    # A Nemotron-H layer is one block (Mamba-2, attention or MoE): three layers, one of each.
    "nemotron_h": ("causal", SMALL, dict(MOE, n_shared_experts=1, moe_shared_expert_intermediate_size=32,
                                         use_mamba_kernels=False, ssm_state_size=8, mamba_num_heads=8,
                                         mamba_head_dim=16, n_groups=1, chunk_size=4,
                                         layers_block_type=["mamba", "attention", "moe"])),
    "olmo_hybrid": ("causal", SMALL, dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                                          pad_token_id=0)),
    "qwen3_5_text": ("causal", SMALL, dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           layer_types=["linear_attention", "full_attention"])),
    "gemma3n_text": ("causal", SMALL, dict(head_dim=16, sliding_window=4, vocab_size_per_layer_input=512,
                                           hidden_size_per_layer_input=16, laurel_rank=8, num_kv_shared_layers=0,
                                           layer_types=["sliding_attention", "full_attention"])),
    "exaone": ("causal", SMALL, dict(num_layers=2)),
    "doge": ("causal", SMALL, {}),
    "olmo": ("causal", SMALL, {}),
    "gpt_neox": ("causal", SMALL, {}),
    "gpt_neo": ("causal", SMALL, dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4)),
    "nanochat": ("causal", SMALL, {}),
    "vaultgemma": ("causal", SMALL, dict(head_dim=16)),
    "jais2": ("causal", SMALL, {}),
    "cwm": ("causal", SMALL, {}),
    "diffllama": ("causal", SMALL, {}),
    "ministral": ("causal", SMALL, dict(head_dim=16, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"])),
    "granite_swa": ("causal", SMALL, dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "apertus1p5_text": ("causal", SMALL, {}),
    "internlm3": ("causal", SMALL, {}),
    "ministral3": ("causal", SMALL, {}),
    "iquestcoder": ("causal", SMALL, {}),
    "hyperclovax": ("causal", SMALL, {}),
    "flint": ("causal", SMALL, {}),
    "dory": ("causal", SMALL, {}),
    "beam": ("causal", SMALL, {}),
    "hrm_text": ("causal", SMALL, {}),
    "lfm3": ("causal", SMALL, dict(pad_token_id=0)),
    "ctrl": ("causal", SMALL, dict(n_embd=64, n_layer=2, n_head=4, dff=128, n_positions=128)),
    "cohere_compass_text": ("causal", SMALL, dict(head_dim=16, rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("full_attention", "sliding_attention")})),
    "gemma4_unified_text": ("causal", SMALL, dict(head_dim=16, global_head_dim=16, sliding_window=4,
                                                  layer_types=["sliding_attention", "full_attention"])),
    "sarvam_moe": ("causal", SMALL, MOE),
    "mellum": ("causal", SMALL, MOE),
    "inkling_text": ("causal", SMALL, MOE),
    "kolibri1": ("causal", SMALL, MOE),
    "lara_mini": ("causal", SMALL, MOE),
    "zaya": ("causal", SMALL, dict(MOE, num_experts_per_tok=1)),
    "granitemoe_swa": ("causal", SMALL, dict(MOE, sliding_window=4)),
    "inkling2_text": ("causal", SMALL, dict(MOE, unpadded_vocab_size=512, head_dim=16, swa_num_attention_heads=4,
                                            swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4,
                                            n_layers_per_attn_res_block=2, layer_types=["hybrid_sliding", "hybrid"])),
    "inkling2_loop_text": ("causal", SMALL, MOE),
    "minimax_m3_vl_text": ("causal", SMALL, MOE),
    "aria_text": ("causal", SMALL, MOE),
    "openai-gpt": ("causal", SMALL, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "gpt_neox_japanese": ("causal", SMALL, {}),
    "modernbert-decoder": ("causal", ENCODER, dict(pad_token_id=0, local_attention=8, global_attn_every_n_layers=2)),
    "sarvam_mla": ("causal", SMALL, MLA),
    "axk2": ("causal", SMALL, MLA),
    "axk1": ("causal", SMALL, dict(MLA, head_dim=8)),
    # Sparse attention: an indexer picks each query's keys (top 4 of 5 to 8 tokens).
    "hy_v4": ("causal", SMALL, dict(MLA, pad_token_id=0, head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=4,
                                    layer_types=["indexed_attention", "indexed_attention"],
                                    indexer_types=["full", "shared"], mlp_layer_types=["dense", "sparse"])),
    "dots3_note_text": ("causal", SMALL, dict(MLA, pad_token_id=0, head_dim=16, index_topk=4, index_head_dim=16,
                                              sliding_window=4, shared_experts_intermediate_size=32)),
    "qwen4_exp_text": ("causal", SMALL, dict(MOE, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                             linear_value_head_dim=16, shared_expert_intermediate_size=64, head_dim=16,
                                             hc_lowrank=16, ple_embed_dim=64, ngram_vocab_size_base=512,
                                             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, index_topk=4,
                                             indexer_budget=4, indexer_compress_ratio=2,
                                             layer_types=["linear_attention", "indexed_attention"])),
    "deberta": ("masked", ENCODER, {}),
    "roberta-prelayernorm": ("masked", ENCODER, {}),
    "nomic_bert": ("masked", ENCODER, {}),
    "gte": ("masked", ENCODER, {}),
    "rembert": ("masked", ENCODER, {}),
    "roformer": ("masked", ENCODER, {}),
    "ibert": ("masked", ENCODER, {}),
    "fnet": ("masked", ENCODER, {}),
    "convbert": ("masked", ENCODER, {}),
    "nystromformer": ("masked", ENCODER, {}),
    "yoso": ("masked", ENCODER, {}),
    "mra": ("masked", ENCODER, {}),
    "ernie": ("masked", ENCODER, {}),
    "data2vec-text": ("masked", ENCODER, {}),
    "big_bird": ("masked", ENCODER, {}),
    "layoutlm": ("masked", ENCODER, {}),
    "flaubert": ("masked", ENCODER, {}),
    "xlm": ("masked", ENCODER, {}),
    "jina_embeddings_v3": ("masked", ENCODER, {}),
    "ultrabert": ("masked", ENCODER, {}),
    "longformer": ("masked", ENCODER, {}),
    "esm": ("masked", ENCODER, dict(pad_token_id=1, mask_token_id=2)),
    "eurobert": ("masked", ENCODER, dict(pad_token_id=0, num_key_value_heads=2)),
    "squeezebert": ("masked", ENCODER, dict(embedding_size=64)),
    "luke": ("masked", ENCODER, dict(entity_vocab_size=16, entity_emb_size=16)),
    "mobilebert": ("masked", ENCODER, dict(embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32,
                                           num_feedforward_networks=2)),
    "funnel": ("masked", {}, dict(vocab_size=512, block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128)),
    "vit_msn": ("image", VIT, {}),
    "ijepa": ("image", VIT, {}),
    "data2vec-vision": ("image", VIT, {}),
    "dinov2_with_registers": ("image", VIT, {}),
    # transformers' auto class lists DeiT's two heads; the config names the one built.
    "deit": ("image", VIT, dict(encoder_stride=8, architectures=["DeiTForImageClassification"])),
    "swinv2": ("image", {}, dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
    "focalnet": ("image", {}, dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
                                   focal_windows=[3, 3])),
    "hiera": ("image", {}, dict(image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1],
                                embed_dim=16, num_heads=[1, 2], depths=[1, 1], query_stride=[2, 2],
                                masked_unit_size=[4, 4], mask_unit_attn=[True, False], num_query_pool=1)),
    "cvt": ("image", {}, dict(embed_dim=[16, 32, 48], num_heads=[1, 2, 3], depth=[1, 2, 3])),
    "pvt": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16, 24, 32], num_attention_heads=[1, 2, 4, 8],
                              depths=[1, 1, 1, 1], num_labels=2)),
    "pvt_v2": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16, 24, 32], num_attention_heads=[1, 2, 4, 8],
                                 depths=[1, 1, 1, 1])),
    "segformer": ("image", {}, dict(image_size=32, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                                    decoder_hidden_size=32)),
    "mobilevit": ("image", {}, dict(image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64])),
    "swiftformer": ("image", {}, dict(image_size=32, embed_dims=[8, 16, 24, 32], depths=[1, 1, 1, 1])),
    "mobilenet_v1": ("image", {}, dict(image_size=32, depth_multiplier=0.25)),
    "mobilenet_v2": ("image", {}, dict(image_size=32, depth_multiplier=0.25)),
    "efficientnet": ("image", {}, dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)),
    "bit": ("image", {}, dict(embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], num_groups=8)),
    "hgnet_v2": ("image", {}, dict(stem_channels=[3, 8, 16], stage_in_channels=[16, 16, 32, 64],
                                   stage_mid_channels=[8, 16, 32, 64], stage_out_channels=[16, 32, 64, 128],
                                   stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[2, 2, 2, 2],
                                   hidden_sizes=[16, 32, 64, 128])),
    "textnet": ("image", {}, dict(stem_out_channels=8, hidden_sizes=[8, 16, 24, 32, 48],
                                  conv_layer_kernel_sizes=[[[3, 3]], [[3, 3]], [[3, 3]], [[3, 3]]],
                                  conv_layer_stride=[[1], [2], [2], [2]])),
    "pp_lcnet": ("image", {}, dict(scale=0.25)),
    # Encoder-decoders (T5 is in the zoo): masked-LM style inputs for the encoder, a few decoder
    # tokens; with --generate the decoder's self- and cross-attention caches are both written.
    "bart": ("seq2seq", SEQ2SEQ, {}),
    "mbart": ("seq2seq", SEQ2SEQ, {}),
    "pegasus": ("seq2seq", SEQ2SEQ, {}),
    "marian": ("seq2seq", SEQ2SEQ, {}),
    "blenderbot": ("seq2seq", SEQ2SEQ, {}),
    "blenderbot-small": ("seq2seq", SEQ2SEQ, {}),
    "plbart": ("seq2seq", SEQ2SEQ, {}),
    "m2m_100": ("seq2seq", SEQ2SEQ, {}),
    "led": ("seq2seq", SEQ2SEQ, dict(max_encoder_position_embeddings=128, max_decoder_position_embeddings=128,
                                     attention_window=[8, 8])),
    "bigbird_pegasus": ("seq2seq", SEQ2SEQ, dict(attention_type="original_full")),
    "mt5": ("seq2seq", T5_STYLE, {}),
    "umt5": ("seq2seq", T5_STYLE, {}),
    "longt5": ("seq2seq", T5_STYLE, {}),
    "pegasus_x": ("seq2seq", SEQ2SEQ, {}),
    "fsmt": ("seq2seq", SEQ2SEQ, {}),
    "mvp": ("seq2seq", SEQ2SEQ, {}),
    "nllb-moe": ("seq2seq", SEQ2SEQ, {}),
    "switch_transformers": ("seq2seq", T5_STYLE, dict(num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)),
    "prophetnet": ("seq2seq", {}, dict(vocab_size=512, max_position_embeddings=128, hidden_size=64, num_encoder_layers=2,
                                       num_decoder_layers=2, num_encoder_attention_heads=4,
                                       num_decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                       ngram=2)),
}
TOKENS = ((2, 8), (3, 8), (3, 5))  # batch, sequence
IMAGES = (2, 3, 4)  # batch of 3x32x32 images


def _inputs(head: str, vocab: int, device: str) -> list[dict]:
    import torch

    if head in ("image", "backbone"):
        return [{"pixel_values": torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(b)).to(device)}
                for b in IMAGES]
    out = []
    for shape in TOKENS:
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)
        if head == "causal":
            out.append({"input_ids": ids, "use_cache": False})
        elif head == "seq2seq":
            mask = torch.ones(shape, dtype=torch.long, device=device)
            mask[0, shape[1] // 2:] = 0  # a padded row of the encoder's input
            out.append({"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :4], "use_cache": False})
        else:
            mask = torch.ones(shape, dtype=torch.long, device=device)
            mask[0, shape[1] // 2:] = 0  # a padded row
            out.append({"input_ids": ids, "attention_mask": mask})
    return out


# capturepass's warnings of a compile that failed and was replaced by a slower one: the model
# stays equal to eager, so only its log tells (MiniMax on the H200 ran every region eagerly).
FALLBACKS = ("compiler failed on region", "one compile of", "lanes after fusion left out")


# Dynamo's warning when a frame reached its recompile limit: from then on that frame runs
# eagerly, under any backend (JetMoE's calls pass through transformers' deprecation wrapper).
RECOMPILE_LIMIT = re.compile(r"torch\._dynamo hit config\.\w+ .*?function: '([^']+)'", re.S)
# A compile's lanes after fusion, as logged: how many of its frees the rewrite moved or held.
FUSED = re.compile(r"lanes after fusion: .* (\d+) frees held to the join, (\d+) moved to a later wait")


class Fallbacks(logging.Handler):
    """Collects capturepass's warnings of failed compiles while installed (a context manager),
    and the frames Dynamo stopped compiling (:attr:`eager_frames`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.eager_frames: list[str] = []
        self.in_place = 0  # shapes captured again with inputs read in place (``--host-captures``)
        self.fused = [0, 0, 0]  # compiles with lanes after fusion, their frees held, moved (``--regions fused``)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "stayed at one address" in message:
            self.in_place += 1
        fused = FUSED.search(message)
        if fused:
            self.fused = [self.fused[0] + 1, self.fused[1] + int(fused.group(1)), self.fused[2] + int(fused.group(2))]
        if record.levelno < logging.WARNING:
            return
        if any(f in message for f in FALLBACKS):
            self.messages.append(message)
        limit = RECOMPILE_LIMIT.search(message)
        if limit and limit.group(1) not in self.eager_frames:
            self.eager_frames.append(limit.group(1))

    def __enter__(self) -> "Fallbacks":
        for name in ("capturepass", "torch._dynamo"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("capturepass", "torch._dynamo"):
            logging.getLogger(name).removeHandler(self)


def host_captures() -> list[tuple[str, int]]:
    """Runs the executor's capture decisions and capturepass's replay path on the host
    (``--host-captures``): every graph is compiled as on a GPU (``cudagraphs="monolithic"``) and
    captured on host graphs (``tests.helpers.HostCapture`` over ``capturepass.testing.host_graphs``:
    a replay runs the segment on the memory it was captured on; it also asserts that a replay finds
    every input captured in place at its captured address), so that which inputs are copied or
    read in place, when a shape is captured again, and the buffers, copies and output aliases of
    every replay, are exercised on the model's own inputs. Returns their log, ``("capture" |
    "replay", id)`` per event."""
    from tests.helpers import capture_on_host

    return capture_on_host()


class Unsupported(Exception):
    """``transformers`` has no implementation of the asked attention for the architecture (or,
    with ``--generate``, the model is no decoder, or its eager generation fails)."""


def _options(capture: bool, regions: str | None) -> dict | None:
    """capturepass's options for a model of the sweep: captures on the host, a region route."""
    options = {"cudagraphs": "monolithic"} if capture else {}
    if regions is not None:
        options["regions"] = regions
    return options or None


def _compile(fn: Callable[..., Any], backend: str, options: dict | None) -> Callable[..., Any]:
    """``fn`` compiled by ``backend``: capturepass with ``options``, or a baseline the same calls
    run under instead (``reduce-overhead`` is Inductor's cudagraph trees)."""
    import torch

    if backend == "capturepass":
        return torch.compile(fn, backend="capturepass", options=options)
    if backend == "reduce-overhead":
        return torch.compile(fn, mode="reduce-overhead")
    return torch.compile(fn, backend=backend)


def check(name: str, device: str, refill: bool = False, attn: str | None = None,
          regions: str | None = None, backend: str = "capturepass") -> float:
    """The largest absolute difference from eager over the model's three inputs (raises on a failure).

    With ``refill`` every input is then passed three times more in buffers refilled in place (a
    caller that keeps its input buffers: the second such call is captured again with them read in
    place, the third replays that capture).
    """
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.testing import zoo

    torch._dynamo.reset()
    head, config, model = _build(name, device, attn)
    compiled = _compile(model, backend, _options(refill, regions))
    tol = zoo.TOLERANCE[device]
    worst = 0.0
    seen: list[dict] = []

    def inductor():
        # The calls so far, in order, so that Dynamo makes the same shapes dynamic for Inductor.
        theirs = torch.compile(model, backend="inductor")
        return [theirs(**kw)[0] for kw in seen][-1]

    with torch.no_grad():
        for kwargs in _inputs(head, getattr(config, "vocab_size", 0), device):
            seen.append(kwargs)
            ref = model(**kwargs)[0]
            buffers = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            for call in range(4 if refill else 1):
                for k, v in kwargs.items():
                    if isinstance(v, torch.Tensor):
                        buffers[k].copy_(v)  # refilled where it is
                try:
                    got = compiled(**(kwargs if call == 0 else buffers))[0]
                except Exception as exc:
                    raise _failure(exc, inductor) from exc
                try:
                    torch.testing.assert_close(got, ref, **tol)
                except AssertionError as exc:
                    raise _mismatch(inductor, ref, got, tol) from exc
                worst = max(worst, float((ref - got).abs().max()))
    return worst


def _build(name: str, device: str, attn: str | None) -> tuple:
    """``(head, config, model)``: the architecture's model from its tiny config (seed 0), in eval
    mode on ``device``; raises :class:`Unsupported` where ``attn`` is what it cannot be built with."""
    import torch
    import transformers

    head, base, own = ARCHITECTURES[name]

    def config():
        return transformers.AutoConfig.for_model(name, **dict(base, **own))

    auto = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM, "image": transformers.AutoModelForImageClassification,
            "backbone": transformers.AutoModel}[head]
    torch.manual_seed(0)
    try:
        model = auto.from_config(config(), **({"attn_implementation": attn} if attn else {}))
    except ValueError as exc:
        if attn is None:
            raise
        # A new config (the refused one was given the implementation): built without it, the
        # attention implementation is what the model refused.
        auto.from_config(config())
        raise Unsupported(str(exc).split(". ")[0]) from exc
    return head, model.config, model.eval().to(device)


NEW_TOKENS = 8


def check_generate(name: str, device: str, attn: str | None = None, capture: bool = False,
                   regions: str | None = None, backend: str = "capturepass") -> str:
    """Three greedy generations with the model's ``forward`` compiled (``capture``: as on a GPU,
    ``cudagraphs="monolithic"``), each equal to eager's tokens; returns the cache they used.
    Raises :class:`Mismatch` on other tokens, :class:`Unsupported` for a model that is no decoder."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed

    if ARCHITECTURES[name][0] not in ("causal", "seq2seq"):
        raise Unsupported("not a decoder")
    torch._dynamo.reset()
    _, config, model = _build(name, device, attn)
    static = bool(getattr(type(model), "_can_compile_fullgraph", False))
    gen = torch.Generator().manual_seed(0)
    first, other = (torch.randint(1, config.vocab_size, (2, 6), generator=gen).to(device) for _ in range(2))
    prompts = (first, first, other)

    def generate(forward) -> list[torch.Tensor]:
        model.forward = forward
        with torch.no_grad():
            # disable_compile: with a static cache transformers would compile the decode step itself.
            # min_new_tokens: an end-of-sequence token would end a generation early, and a call less.
            return [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, disable_compile=True,
                                   **({"cache_implementation": "static"} if static else {})) for ids in prompts]

    eager = model.forward
    try:
        try:
            want = generate(eager)
        except Exception as exc:  # noqa: BLE001 - the model's own generation, before any compile
            raise Unsupported(f"eager generation fails ({type(exc).__name__}: {str(exc)[:200]})") from exc
        options = _options(capture, regions)
        try:
            got = generate(_compile(eager, backend, options))
        except Exception as exc:
            raise _failure(exc, lambda: generate(torch.compile(eager, backend="inductor"))) from exc
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
        if bad:
            torch._dynamo.reset()
            theirs = generate(torch.compile(eager, backend="inductor"))
            also = any(not torch.equal(t, w) for t, w in zip(theirs, want))
            raise Mismatch(f"generation(s) {bad} differ from eager's tokens (first: {got[bad[0]].tolist()} against "
                           f"{want[bad[0]].tolist()}); backend=\"inductor\" {'differs' if also else 'does not'}",
                           also)
    finally:
        model.forward = eager
    return "static cache" if static else "default cache"


class Mismatch(AssertionError):
    """A model's output beyond the tolerance; ``inductor_too``: ``backend="inductor"`` is beyond it
    on the same input as well, and capturepass's difference is at most :data:`INDUCTOR_MARGIN`
    times Inductor's (torch's numerics, not capturepass's schedule)."""

    def __init__(self, message: str, inductor_too: bool) -> None:
        super().__init__(message)
        self.inductor_too = inductor_too


# A mismatch is torch's only where capturepass's difference is of the order of Inductor's own: a
# wrong schedule (a missing wait, a buffer reused too early) moves outputs by far more.
INDUCTOR_MARGIN = 2.0


def _failure(exc: Exception, inductor: Callable[[], Any]) -> Exception:
    """What capturepass's error ``exc`` is: a :class:`Mismatch` that Inductor shares where
    ``inductor`` (the calls so far, in order, compiled by ``backend="inductor"`` from a fresh
    Dynamo cache) fails too, else ``exc`` itself."""
    import torch

    torch._dynamo.reset()
    try:
        inductor()
    except Exception as theirs:  # noqa: BLE001 - any error of Inductor's own is the answer
        return Mismatch(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}; backend=\"inductor\" "
                        f"fails too ({type(theirs).__name__}: {str(theirs).strip().splitlines()[0][:200]})", True)
    return exc


def _mismatch(inductor: Callable[[], Any], ref, got, tol: dict) -> Mismatch:
    """What a mismatch is: capturepass's largest difference, against Inductor's own on the same
    input (``inductor``: the calls so far compiled by ``backend="inductor"``, from a fresh Dynamo
    cache, its last output)."""
    import torch

    torch._dynamo.reset()
    theirs = inductor()
    ours_d, theirs_d = float((ref - got).abs().max()), float((ref - theirs).abs().max())
    beyond = not torch.isclose(theirs, ref, **tol).all().item()
    return Mismatch(f"largest difference {ours_d:.2e}; backend=\"inductor\" on the same input {theirs_d:.2e}"
                    f" ({'also' if beyond else 'not'} beyond the tolerance {tol})",
                    beyond and ours_d <= INDUCTOR_MARGIN * theirs_d)


def _cuda_float32() -> None:
    """The tolerance on CUDA is float32's with TF32 off (as the zoo's GPU tests run): cuDNN's
    convolutions use TF32 by default (DINOv2's output differed from eager by 9.4e-4 with it on the
    H200, by 1.8e-6 without)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# A model's result line, as :func:`main` prints it (a FAIL's traceback follows on lines indented by five),
# and its last line: what ``--procs`` reads of each process (``sweep_shards``).
RESULT = re.compile(r"^(OK  |FAIL|SLOW|TORCH|SKIP|CRASH) (\S+?):")
SUMMARY = re.compile(r"^\d+ of \d+ equal to eager")


def summary(total: int, failed: int, slow: int, torch_own: int, skipped: int, not_reached: list[str] = ()) -> int:
    """Prints the sweep's last line; returns its exit status (1 if any model failed, was slow, or
    was not reached within ``--deadline``)."""
    total -= len(not_reached)
    print(f"{total - failed - torch_own - skipped} of {total - skipped} equal to eager"
          + (f" ({skipped} skipped)" if skipped else "")
          + (f", {slow} with failed compiles" if slow else "")
          + (f", {torch_own} where backend=\"inductor\" fails or differs from eager too" if torch_own else "")
          + (f"; {len(not_reached)} not reached within the deadline: {','.join(not_reached)}" if not_reached else ""))
    return 1 if failed or slow or not_reached else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ARCHITECTURES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--attn", default=None,
                   help="the attn_implementation to build every model with (transformers' default otherwise)")
    p.add_argument("--generate", action="store_true",
                   help="decoders generate greedily with forward compiled; tokens against eager's")
    p.add_argument("--regions", default=None, choices=("auto", "lanes", "segments", "fused"),
                   help="capturepass's region route (its default otherwise); fused on the CPU puts every "
                        "model's Inductor code through the lanes-after-fusion rewrite and its order check")
    p.add_argument("--host-captures", action="store_true",
                   help="on the CPU, capture and replay on the host (the executor's decisions on real inputs); "
                        "each input is then passed three times more in refilled buffers")
    p.add_argument("--traceback", action="store_true",
                   help="print a failure's whole traceback (its last five lines otherwise)")
    p.add_argument("--backend", default="capturepass", choices=("capturepass", "inductor", "reduce-overhead"),
                   help="compile with this instead of capturepass: whether a failure is capturepass's or "
                        "also happens under torch's own backends (reduce-overhead: Inductor's cudagraph trees)")
    p.add_argument("--procs", type=int, default=1,
                   help="run the models in this many processes at once (shards of the list, in turn); a "
                        "process that crashes is reported on the model it was on, and the rest go on")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="with --procs: stop every process after this many seconds and name the models not "
                        "reached (for a machine lent by the call)")
    args = p.parse_args()
    if args.backend != "capturepass" and (args.host_captures or args.regions):
        p.error("--host-captures and --regions are capturepass's options")
    if args.procs < 1:
        p.error("--procs must be at least 1")
    if args.deadline is not None and args.procs == 1:
        p.error("--deadline is for --procs")
    names = args.models.split(",")
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        p.error(f"unknown architecture: {', '.join(unknown)} (known: {', '.join(ARCHITECTURES)})")
    if args.host_captures and args.device != "cpu":
        p.error("--host-captures is for the CPU (a GPU captures for real)")
    if args.procs > 1:
        flags = ["--device", args.device, "--backend", args.backend,
                 *(["--attn", args.attn] if args.attn else []), *(["--regions", args.regions] if args.regions else []),
                 *[f"--{flag.replace('_', '-')}" for flag in ("generate", "host_captures", "traceback")
                   if getattr(args, flag)]]
        script = os.path.abspath(__file__)
        kinds = run_shards([names[i::args.procs] for i in range(args.procs)],
                           lambda models: [sys.executable, script, *flags, "--models", ",".join(models)],
                           RESULT, drop=SUMMARY, seconds=args.deadline)
        counts = [list(kinds.values()).count(k) for k in ("FAIL", "CRASH", "SLOW", "TORCH", "SKIP")]
        sys.exit(summary(len(names), counts[0] + counts[1], *counts[2:], [n for n in names if n not in kinds]))
    import transformers

    transformers.logging.set_verbosity_error()  # random-init and unused-key notices
    if args.device == "cuda":
        _cuda_float32()
    log: list[tuple[str, int]] = []
    if args.host_captures:
        log = host_captures()
    if args.host_captures or args.regions:
        # The shapes captured again, the frees of lanes after fusion: counted from the log.
        logging.getLogger("capturepass").setLevel(logging.INFO)
    failed = slow = torch_own = skipped = 0
    for name in names:
        del log[:]
        try:
            with Fallbacks() as fallbacks:
                if args.generate:
                    cache = check_generate(name, args.device, attn=args.attn, capture=args.host_captures,
                                           regions=args.regions, backend=args.backend)
                    kinds = [k for k, _ in log]
                    what = f"{3 * NEW_TOKENS} tokens equal to eager's ({cache}" + (
                        f"; {kinds.count('capture')} captures, {kinds.count('replay')} replays)"
                        if args.host_captures else ")")
                else:
                    worst = check(name, args.device, refill=args.host_captures, attn=args.attn,
                                  regions=args.regions, backend=args.backend)
                    what = f"largest difference {worst:.2e}"
        except Unsupported as exc:
            skipped += 1
            print(f"SKIP {name}: {exc}", flush=True)
            continue
        except Mismatch as exc:
            if exc.inductor_too:
                torch_own += 1
                print(f"TORCH {name}: {exc}", flush=True)
            else:
                failed += 1
                print(f"FAIL {name}: {exc}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row, not the end of the sweep
            failed += 1
            frames = traceback.format_exc().strip().splitlines()[None if args.traceback else -5:]
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}\n     " + "\n     ".join(frames), flush=True)
            continue
        if fallbacks.messages:
            slow += 1
            print(f"SLOW {name}: {what}; {len(fallbacks.messages)} failed compile(s), the "
                  f"first: {fallbacks.messages[0][:300]}", flush=True)
        else:
            eager = (f"; Dynamo ran {', '.join(repr(f) for f in fallbacks.eager_frames)} eagerly past its recompile "
                     f"limit (under any backend)") if fallbacks.eager_frames else ""
            in_place = f"; {fallbacks.in_place} shape(s) captured again with inputs read in place" \
                if args.host_captures and not args.generate else ""
            compiles, held, moved = fallbacks.fused
            fused = (f"; lanes after fusion in {compiles} compile(s): {moved} frees moved to a later wait, {held} "
                     f"held to the join") if compiles else ""
            print(f"OK   {name}: {what}{in_place}{fused}{eager}", flush=True)
    sys.exit(summary(len(names), failed, slow, torch_own, skipped))


if __name__ == "__main__":
    main()
