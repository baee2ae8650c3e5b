"""A zoo of Hugging Face ``transformers`` architectures at toy size, for compile tests and benchmarks.

Every entry of :data:`ZOO` is a builder: ``ZOO[name](device=..., dtype=...,
attn=...)`` (or :func:`build`) returns ``(model, make_inputs)``, where ``model`` is an ``eval()`` module
built from a tiny random config (no hub download; the weights come from
``torch.manual_seed(0)``) and ``make_inputs(seed)`` returns the keyword
arguments of one call, new random token ids, pixel values or audio per seed, always
of the same shapes (so that a compiled model does not recompile between
calls). Each builder's docstring says what its config exercises (GQA, MoE
routing with shared experts, parallel residual, rotary variants, sliding
windows, soft-capping, tied embeddings, ...).

Sizes: 1 layer (2 where the architecture alternates layer kinds), hidden 64,
4 heads, vocabulary 128, batch 2, sequence 16 (images 32x32 in patches of 8; Whisper's
32 frames of 16 mel bins, Wav2Vec2's 800 samples).

Choices that hold for the whole zoo:

- ``attn_implementation="eager"``: the attention is plain ATen (matmul,
  softmax) that every architecture here supports with every feature its
  config turns on (Gemma 2's logit soft-capping exists only there; ``sdpa``
  refuses it), with masks built the same way in every version; the fused
  ``sdpa`` kernels have per-device fallbacks of their own. ``attn="sdpa"``
  builds the others with ``sdpa`` (on the CPU they compile alike).
- ``experts_implementation="grouped_mm"`` for the MoE models (the default of
  ``transformers``, pinned so that a new default does not change the zoo):
  experts sorted by routing, run by ``grouped_mm``; under compile in a dtype
  other than bfloat16, by ``transformers``' own custom op
  ``transformers::grouped_mm_fallback`` instead, which reads the expert
  offsets on the host (a device-to-host sync inside the graph).
- Decoders (and T5) keep ``transformers``' default ``use_cache=True``: a call is
  a prefill that fills a new KV cache (``torch.cat`` onto an empty cache, the
  engines' path through these models; a region seam once returned that
  concatenation at another layout than its consumer was compiled for). The
  cache object among the outputs is not a tensor and is not compared; the
  logits read it. So does Whisper's decoder. Encoders (BERT, RoBERTa, CLIP, Wav2Vec2) have no cache.
- Models are built on the CPU in float32 and then moved, so that the weights
  are the same on every device.

``transformers`` is imported when a model is built; the module itself imports
without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

VOCAB = 128
HIDDEN = 64
HEADS = 4
INTERMEDIATE = 128
BATCH = 2
SEQ = 16
IMAGE = 32
MAX_POSITIONS = 64
MEL_BINS = 16
AUDIO_SAMPLES = 800  # 79 frames after Wav2Vec2's two strided convolutions

TOLERANCE: dict[str, dict[str, float]] = {
    # torch.testing's float32 defaults. Measured on this zoo (8 seeds a model, torch 2.13,
    # x86 CPU): Inductor's largest difference from eager is 1.9e-6 (T5's logits, |x| <= 9),
    # most models stay under 5e-7. A missing wait or a wrong buffer changes outputs by the
    # order of the outputs (0.1 to 1), far beyond either bound.
    "cpu": {"atol": 1e-5, "rtol": 1.3e-6},
    # CUDA, float32 with TF32 off: Triton's fused reductions and transcendental functions
    # round differently from ATen's kernels by a few ulps per op. Not yet measured here;
    # scripts/zoo_table.py prints Inductor's largest difference per model on the device.
    "cuda": {"atol": 1e-4, "rtol": 1e-4},
}
"""Float32 tolerances (``assert_close``'s ``atol``/``rtol``) of a compiled zoo model against eager, per device type."""

InputMaker = Callable[[int], dict[str, torch.Tensor]]
Builder = Callable[..., tuple[nn.Module, InputMaker]]

ZOO: dict[str, Builder] = {}
"""name -> builder ``(device=None, dtype=torch.float32, attn="eager") -> (model, make_inputs)``, in catalogue order."""

FAMILIES: dict[str, str] = {}
"""name -> ``"decoder"``, ``"encoder"``, ``"encoder-decoder"`` or ``"vision"``."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - a test dependency
        raise ImportError(
            "capturepass.testing.zoo builds Hugging Face models and needs transformers "
            "(pip install 'capturepass[test]')"
        ) from e
    return transformers


def _register(name: str, family: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        ZOO[name] = fn
        FAMILIES[name] = family
        return fn

    return deco


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silences transformers' warnings about random init and unused config keys while building."""
    logging = _transformers().utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _instantiate(
    auto: str, config: Any, device: torch.device | str | None, dtype: torch.dtype, attn: str, **kwargs: Any
) -> nn.Module:
    """``transformers.<auto>.from_config`` with seeded weights, on the CPU in float32, then moved."""
    tf = _transformers()
    with _quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(tf, auto).from_config(config, attn_implementation=attn, **kwargs)
    return model.to(device=device, dtype=dtype).eval()


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _token_inputs(device: torch.device | str | None, low: int = 0) -> InputMaker:
    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(low, VOCAB, (BATCH, SEQ), generator=_generator(seed))
        return {"input_ids": ids.to(device)}

    return make_inputs


def _padded_inputs(
    device: torch.device | str | None, pad_id: int, token_types: bool = False
) -> InputMaker:
    """Token ids with right padding: row ``b`` keeps a random length in ``[SEQ/2, SEQ]``."""

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        g = _generator(seed)
        ids = torch.randint(pad_id + 1, VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
        out = {"input_ids": ids, "attention_mask": mask}
        if token_types:
            out["token_type_ids"] = (torch.arange(SEQ)[None, :] >= lengths[:, None] // 2).long() * mask
        return {k: v.to(device) for k, v in out.items()}

    return make_inputs


def _and_input(first: InputMaker, key: str, make: Callable[[torch.Generator], torch.Tensor]) -> InputMaker:
    """``first``'s inputs and one more, ``key``, drawn by ``make`` from a generator of its own per seed."""

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        out = first(seed)
        out[key] = make(_generator(seed + 1_000_003))
        return out

    return make_inputs


def _causal_lm(
    config: Any, device: torch.device | str | None, dtype: torch.dtype, attn: str, moe: bool = False
) -> tuple[nn.Module, InputMaker]:
    kwargs = {"experts_implementation": "grouped_mm"} if moe else {}
    return _instantiate("AutoModelForCausalLM", config, device, dtype, attn, **kwargs), _token_inputs(device)


def _common(**kw: Any) -> dict[str, Any]:
    """The sizes every Llama-like config shares."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
    )
    base.update(kw)
    return base


# -- decoders -------------------------------------------------------------------------------------


@_register("llama", "decoder")
def _llama(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Llama: GQA (4 query heads over 2 KV heads), RoPE with Llama 3 frequency scaling,
    SwiGLU MLP, RMSNorm, untied LM head."""
    tf = _transformers()
    config = tf.LlamaConfig(
        **_common(num_key_value_heads=2),
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
        },
    )
    return _causal_lm(config, device, dtype, attn)


@_register("mistral", "decoder")
def _mistral(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Mistral: sliding-window causal mask (window 8 < sequence 16), multi-query attention
    (1 KV head), a head dimension (32) decoupled from hidden/heads (so o_proj maps 128 -> 64)."""
    tf = _transformers()
    config = tf.MistralConfig(**_common(num_key_value_heads=1, head_dim=32), sliding_window=8)
    return _causal_lm(config, device, dtype, attn)


@_register("mixtral", "decoder")
def _mixtral(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Mixtral: sparse MoE (top-2 of 4 SwiGLU experts, softmax router, grouped_mm), GQA."""
    tf = _transformers()
    config = tf.MixtralConfig(
        **_common(num_key_value_heads=2, intermediate_size=32), num_local_experts=4, num_experts_per_tok=2
    )
    return _causal_lm(config, device, dtype, attn, moe=True)


@_register("qwen2", "decoder")
def _qwen2(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Qwen2: biases on the q/k/v projections, GQA, RoPE theta 1e6, LM head tied to the embedding."""
    tf = _transformers()
    config = tf.Qwen2Config(
        **_common(num_key_value_heads=2), tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return _causal_lm(config, device, dtype, attn)


@_register("qwen2_moe", "decoder")
def _qwen2_moe(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Qwen2-MoE: a shared expert with a sigmoid gate beside top-2 of 4 routed experts
    (softmax routing, weights not renormalized), q/k/v biases, GQA."""
    tf = _transformers()
    config = tf.Qwen2MoeConfig(
        **_common(num_key_value_heads=2),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False,
    )
    return _causal_lm(config, device, dtype, attn, moe=True)


@_register("qwen3", "decoder")
def _qwen3(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Qwen3: per-head RMSNorm of queries and keys (q_norm, k_norm), head dimension 32
    decoupled from hidden/heads, GQA, tied LM head."""
    tf = _transformers()
    config = tf.Qwen3Config(**_common(num_key_value_heads=2, head_dim=32), tie_word_embeddings=True)
    return _causal_lm(config, device, dtype, attn)


@_register("qwen3_moe", "decoder")
def _qwen3_moe(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Qwen3-MoE: top-2 of 8 experts with renormalized routing weights (norm_topk_prob), no
    shared expert, q/k norms, GQA."""
    tf = _transformers()
    config = tf.Qwen3MoeConfig(
        **_common(num_key_value_heads=2, head_dim=16),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    )
    return _causal_lm(config, device, dtype, attn, moe=True)


@_register("deepseek_v3", "decoder")
def _deepseek_v3(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """DeepSeek-V3 (one MoE layer): multi-head latent attention (low-rank q and kv with a
    decoupled, interleaved rotary part; YaRN scaling), a shared expert beside top-2 of 8
    routed experts picked by sigmoid scores plus a (random, nonzero) correction bias with
    group-limited routing (2 of 4 groups), weighted by the uncorrected scores, renormalized
    and scaled by routed_scaling_factor."""
    tf = _transformers()
    config = tf.DeepseekV3Config(
        **_common(num_key_value_heads=HEADS),
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    )
    model, make_inputs = _causal_lm(config, device, dtype, attn, moe=True)
    # The bias is zero at init; random values make expert choice differ from weighting.
    g = _generator(0)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model, make_inputs


@_register("gpt2", "decoder")
def _gpt2(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """GPT-2: learned absolute positions, fused qkv Conv1D (transposed weights), LayerNorm,
    gelu_new, LM head tied to the token embedding."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=1, n_head=HEADS,
        n_inner=INTERMEDIATE, bos_token_id=0, eos_token_id=0,
    )
    return _causal_lm(config, device, dtype, attn)


@_register("gpt_neox", "decoder")
def _gpt_neox(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """GPT-NeoX: parallel residual (attention and MLP both read the block input, each through
    its own LayerNorm), partial rotary (a quarter of each head), fused qkv with bias."""
    tf = _transformers()
    config = tf.GPTNeoXConfig(
        **_common(), use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    return _causal_lm(config, device, dtype, attn)


@_register("gptj", "decoder")
def _gptj(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """GPT-J: attention and MLP in parallel off one LayerNorm, rotary on the first 8 dims of
    each head with interleaved (rotate-every-two) pairs, sinusoid table indexed by position."""
    tf = _transformers()
    config = tf.GPTJConfig(
        vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=1, n_head=HEADS,
        rotary_dim=8, n_inner=INTERMEDIATE, bos_token_id=0, eos_token_id=0,
    )
    return _causal_lm(config, device, dtype, attn)


@_register("falcon", "decoder")
def _falcon(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Falcon (new decoder architecture): attention and MLP in parallel (parallel_attn), each
    after its own LayerNorm (ln_attn, ln_mlp), GQA through a fused qkv projection, RoPE,
    tied LM head."""
    tf = _transformers()
    config = tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, num_kv_heads=2,
        new_decoder_architecture=True, parallel_attn=True, num_ln_in_parallel_attn=2, alibi=False, bias=False,
        ffn_hidden_size=INTERMEDIATE, max_position_embeddings=MAX_POSITIONS,
    )
    return _causal_lm(config, device, dtype, attn)


@_register("phi", "decoder")
def _phi(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Phi (1/2): attention and MLP in parallel off one LayerNorm, partial rotary (half of each
    head), LayerNorm on queries and keys (qk_layernorm), biases everywhere."""
    tf = _transformers()
    config = tf.PhiConfig(
        **_common(), qk_layernorm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    return _causal_lm(config, device, dtype, attn)


@_register("gemma2", "decoder")
def _gemma2(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Gemma 2: a sliding-window layer (window 8) then a global one, tanh soft-capping of the
    attention logits (50) and the final logits (30), query scaling by query_pre_attn_scalar,
    pre- and post-norms around both sublayers, embeddings scaled by sqrt(hidden), GeGLU, tied
    LM head. Eager attention only: ``sdpa`` has no soft-capping (some transformers
    versions refuse it, others drop the cap)."""
    if attn != "eager":
        raise ValueError(f"zoo model gemma2 soft-caps attention logits, which needs attn='eager', not {attn!r}")
    tf = _transformers()
    config = tf.Gemma2Config(
        **_common(num_hidden_layers=2, num_key_value_heads=2), head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=0,
    )
    return _causal_lm(config, device, dtype, attn)


@_register("gemma3", "decoder")
def _gemma3(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Gemma 3 (text): a sliding-window layer then a global one with different rotary tables
    (local theta 1e4; global theta 1e6 with linear scaling 8), q/k RMSNorm, multi-query
    attention, tied LM head."""
    tf = _transformers()
    config = tf.Gemma3TextConfig(
        **_common(num_hidden_layers=2, num_key_value_heads=1), head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
    )
    return _causal_lm(config, device, dtype, attn)


@_register("olmoe", "decoder")
def _olmoe(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """OLMoE: top-2 of 8 experts without renormalization, RMSNorm of the full q and k
    projections, q/k/v clipping (clip_qkv)."""
    tf = _transformers()
    config = tf.OlmoeConfig(
        **_common(intermediate_size=32), num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        clip_qkv=4.0, pad_token_id=1, eos_token_id=2,
    )
    return _causal_lm(config, device, dtype, attn, moe=True)


@_register("granitemoe", "decoder")
def _granitemoe(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Granite-MoE: top-2 of 4 experts (router top-k, then softmax over the chosen), and
    Granite's multipliers: embeddings x12, residual x0.22, attention scale 1/16, logits /8."""
    tf = _transformers()
    config = tf.GraniteMoeConfig(
        **_common(num_key_value_heads=2, intermediate_size=32), num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0 / 16, logits_scaling=8.0,
    )
    return _causal_lm(config, device, dtype, attn, moe=True)


@_register("mamba", "decoder")
def _mamba(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Mamba: no attention; a gated causal depthwise Conv1d over the sequence and a selective
    scan (input-dependent state-space parameters, a Python loop over the 16 positions in
    transformers' own path), RMSNorm. Its cache is the convolution and SSM states, written in
    place."""
    tf = _transformers()
    config = tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4,
    )
    return _causal_lm(config, device, dtype, attn)


# -- encoders, encoder-decoder, vision ------------------------------------------------------------


@_register("bert", "encoder")
def _bert(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """BERT (masked LM): bidirectional attention under a padding mask, token-type and learned
    absolute position embeddings, post-LayerNorm, MLM head tied to the word embedding."""
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, pad_token_id=0,
        use_cache=False,
    )
    model = _instantiate("AutoModelForMaskedLM", config, device, dtype, attn)
    return model, _padded_inputs(device, pad_id=0, token_types=True)


@_register("roberta", "encoder")
def _roberta(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """RoBERTa (base model with pooler): position ids computed from the token values (a cumsum
    over non-pad tokens, offset by the pad id), padding mask, tanh pooler."""
    tf = _transformers()
    config = tf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=MAX_POSITIONS, pad_token_id=1,
        type_vocab_size=1, use_cache=False,
    )
    model = _instantiate("AutoModel", config, device, dtype, attn)
    return model, _padded_inputs(device, pad_id=1)


@_register("t5", "encoder-decoder")
def _t5(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """T5: encoder-decoder with bucketed relative position biases (bidirectional in the
    encoder, causal in the decoder), cross-attention under the encoder's padding mask, RMS
    LayerNorm without bias, gated-GELU MLP, tied LM head rescaled by d_model**-0.5."""
    tf = _transformers()
    config = tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=INTERMEDIATE, num_layers=1, num_decoder_layers=1,
        num_heads=HEADS, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=True,
        pad_token_id=0, decoder_start_token_id=0,
    )
    model = _instantiate("AutoModelForSeq2SeqLM", config, device, dtype, attn)
    decoder_ids = lambda g: torch.randint(1, VOCAB, (BATCH, SEQ), generator=g).to(device)  # noqa: E731
    return model, _and_input(_padded_inputs(device, pad_id=0), "decoder_input_ids", decoder_ids)


@_register("whisper", "encoder-decoder")
def _whisper(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Whisper (speech to text): log-mel features through two Conv1d layers with GELU (the second
    strided), fixed sinusoidal positions in the encoder, learned ones in the decoder, pre-LayerNorm
    blocks, cross-attention over the encoder's frames without a mask, an output projection tied to
    the token embedding."""
    tf = _transformers()
    frames = 2 * SEQ  # the encoder takes exactly 2 * max_source_positions frames
    config = tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=HIDDEN, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE,
        decoder_ffn_dim=INTERMEDIATE, max_source_positions=SEQ, max_target_positions=MAX_POSITIONS,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )
    model = _instantiate("AutoModelForSpeechSeq2Seq", config, device, dtype, attn)

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        g = _generator(seed)
        features = torch.randn(BATCH, MEL_BINS, frames, generator=g)
        dec = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)
        return {"input_features": features.to(device=device, dtype=dtype), "decoder_input_ids": dec.to(device)}

    return model, make_inputs


@_register("clip", "encoder")
def _clip(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """CLIP (two towers): a text transformer under a causal mask and the padding mask, pooled at
    each row's end-of-text token (an argmax over the ids, a gather), and a ViT (pre-LayerNorm,
    a CLS token); both projected, L2-normalized and compared under a learned temperature: eight
    outputs, among them both towers' hidden states and the two similarity matrices."""
    tf = _transformers()
    config = tf.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=1, num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                           num_attention_heads=HEADS, image_size=IMAGE, patch_size=8),
        projection_dim=32,
    )
    model = _instantiate("AutoModel", config, device, dtype, attn)
    pixels = lambda g: torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return model, _and_input(_padded_inputs(device, pad_id=0), "pixel_values", pixels)


@_register("wav2vec2", "encoder")
def _wav2vec2(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Wav2Vec2 (speech, CTC head): raw samples through strided Conv1d feature layers (GroupNorm
    on the first), a grouped convolutional position embedding under weight normalization
    (a parametrization recomputed at every call), post-LayerNorm blocks, a linear CTC head."""
    tf = _transformers()
    config = tf.Wav2Vec2Config(
        vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, feat_extract_norm="group",
        do_stable_layer_norm=False, mask_time_prob=0.0,
    )
    model = _instantiate("AutoModelForCTC", config, device, dtype, attn)

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        samples = torch.randn(BATCH, AUDIO_SAMPLES, generator=_generator(seed))
        return {"input_values": samples.to(device=device, dtype=dtype)}

    return model, make_inputs


@_register("vit", "vision")
def _vit(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """ViT (image classification): patch embedding by a strided Conv2d (32x32 images in 8x8
    patches), a CLS token and learned positions, pre-LayerNorm encoder, a linear head on CLS."""
    tf = _transformers()
    config = tf.ViTConfig(
        image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, intermediate_size=INTERMEDIATE, num_labels=10,
    )
    model = _instantiate("AutoModelForImageClassification", config, device, dtype, attn)

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=_generator(seed))
        return {"pixel_values": pixels.to(device=device, dtype=dtype)}

    return model, make_inputs


@_register("resnet", "vision")
def _resnet(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """ResNet (image classification): a convolutional network, no attention: a 7x7 strided stem,
    BatchNorm (eval: running statistics), max pooling, two stages of basic blocks with strided
    shortcut convolutions, global average pooling, a linear head."""
    tf = _transformers()
    config = tf.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10,
    )
    model = _instantiate("AutoModelForImageClassification", config, device, dtype, attn)

    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=_generator(seed))
        return {"pixel_values": pixels.to(device=device, dtype=dtype)}

    return model, make_inputs


# -- helpers --------------------------------------------------------------------------------------


def build(
    name: str, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> tuple[nn.Module, InputMaker]:
    """Builds the zoo model ``name``.

    Args:
        name: a key of :data:`ZOO`.
        device: where the model and its inputs live (``None``: the CPU).
        dtype: the parameters' dtype (inputs of floating type follow it).
        attn: the ``attn_implementation`` (``"eager"``, the zoo's choice, ``"sdpa"``, or
            ``"flex_attention"`` where ``transformers`` has it for the architecture; Gemma 2
            takes only ``"eager"``, as ``sdpa`` has no soft-capping).

    Returns:
        ``(model, make_inputs)``: the model in eval mode and a function of a seed returning
        the keyword arguments of one call.

    Raises:
        KeyError: ``name`` is not in the zoo (the message lists the names).
        ValueError: ``attn`` is one the model cannot honour its config with.
    """
    if name not in ZOO:
        raise KeyError(f"no zoo model {name!r}; the zoo has: {', '.join(ZOO)}")
    return ZOO[name](device=device, dtype=dtype, attn=attn)


def output_tensors(out: Any) -> dict[str, torch.Tensor]:
    """The tensors of a model's output, by name (a ``ModelOutput``'s fields, or positions).

    Args:
        out: what the model returned: a ``ModelOutput``, a tuple, a dict or a tensor.

    Returns:
        Every tensor in ``out``, keyed by its field name or index path (nested outputs joined
        with ``.``); fields that are ``None`` are left out.
    """
    found: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found[path or "output"] = value
        elif isinstance(value, dict):  # ModelOutput is an OrderedDict of its non-None fields
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(out, "")
    return found


def compare_with_eager(
    model: nn.Module,
    compiled: Callable[..., Any],
    make_inputs: InputMaker,
    seeds: Sequence[int],
    atol: float,
    rtol: float,
    label: str = "",
) -> list[float]:
    """Calls ``compiled`` and ``model`` on the inputs of each seed and checks that they agree.

    Eager runs first, on inputs of its own; the compiled callable then gets a fresh copy
    of the same inputs, so that neither can see what the other did to its arguments.

    Args:
        model: the eager model (the reference).
        compiled: the compiled model.
        make_inputs: the model's input maker.
        seeds: one call per seed, in order.
        atol: absolute tolerance of ``torch.testing.assert_close``.
        rtol: relative tolerance.
        label: what the error messages name (model and options).

    Returns:
        The largest absolute difference of each call, over all output tensors.

    Raises:
        AssertionError: the outputs differ beyond the tolerances, or have other fields,
            shapes or dtypes; the message names the call, its seed and the output field.
    """
    errors = []
    for call, seed in enumerate(seeds):
        with torch.no_grad():
            expected = output_tensors(model(**make_inputs(seed)))
            got = output_tensors(compiled(**make_inputs(seed)))
        where = f"{label}: call {call} (seed {seed})"
        assert got.keys() == expected.keys(), f"{where}: outputs {sorted(got)} != eager's {sorted(expected)}"
        worst = 0.0
        for key, want in expected.items():
            have = got[key]
            torch.testing.assert_close(
                have, want, atol=atol, rtol=rtol, msg=lambda m, key=key: f"{where}, output {key!r}: {m}"
            )
            if want.numel():
                worst = max(worst, (have.double() - want.double()).abs().max().item())
        errors.append(worst)
    return errors
