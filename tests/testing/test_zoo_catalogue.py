"""The zoo catalogue itself (no compiles): what it builds, its inputs, and its comparison with eager."""

from __future__ import annotations

import pytest
import torch

from capturepass.testing import zoo

REQUIRED = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "gpt2",
    "gpt_neox", "gptj", "falcon", "phi", "olmoe", "granitemoe", "bert", "roberta", "t5", "vit",
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "granitemoe"}


def test_catalogue_covers_the_required_architectures():
    assert REQUIRED <= set(zoo.ZOO)
    assert {"gemma2", "gemma3"} & set(zoo.ZOO)
    assert len(zoo.ZOO) >= 20
    assert set(zoo.FAMILIES) == set(zoo.ZOO)
    assert set(zoo.FAMILIES.values()) == {"decoder", "encoder", "encoder-decoder", "vision"}
    for name, builder in zoo.ZOO.items():
        assert builder.__doc__ and len(builder.__doc__) > 40, f"{name}: its docstring says what it exercises"


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_model_and_inputs(name: str):
    model, make_inputs = zoo.build(name)
    assert not model.training
    assert model.config._attn_implementation == "eager"
    # Decoders, T5 and Whisper fill a KV cache (transformers' default, the path engines take); encoders have none.
    assert getattr(model.config, "use_cache", False) == (zoo.FAMILIES[name] in ("decoder", "encoder-decoder"))
    if name in MOE:
        assert model.config._experts_implementation == "grouped_mm"
    a, b, c = make_inputs(1), make_inputs(1), make_inputs(2)
    assert a.keys() == c.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{name}: {key} is not a function of the seed"
        assert a[key].shape == c[key].shape, f"{name}: {key} changes shape between seeds (a recompile)"
    assert any(not torch.equal(a[k], c[k]) for k in a), f"{name}: two seeds give the same inputs"
    with torch.no_grad():
        out = zoo.output_tensors(model(**a))
        again = zoo.output_tensors(model(**b))
    assert out, f"{name}: no output tensors"
    for key, value in out.items():
        assert torch.isfinite(value).all(), f"{name}: {key} is not finite"
        assert torch.equal(value, again[key]), f"{name}: eager is not deterministic ({key})"


def test_builds_are_reproducible():
    m1, _ = zoo.build("deepseek_v3")
    m2, _ = zoo.build("deepseek_v3")
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    bias = [b for n, b in m1.named_buffers() if n.endswith("e_score_correction_bias")]
    assert bias and all(b.abs().sum() > 0 for b in bias), "the routing correction bias is set"


def test_sdpa_variant_and_gemma2_refusal():
    model, _ = zoo.build("llama", attn="sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="gemma2 soft-caps attention logits, which needs attn='eager'"):
        zoo.build("gemma2", attn="sdpa")


def test_unknown_name_lists_the_zoo():
    with pytest.raises(KeyError, match="llama"):
        zoo.build("no_such_model")


def test_output_tensors_flattens_fields_and_nesting():
    t = torch.zeros(1)
    assert zoo.output_tensors(t) == {"output": t}
    got = zoo.output_tensors({"logits": t, "past": (t, [t]), "none": None})
    assert list(got) == ["logits", "past.0", "past.1.0"]


def test_compare_with_eager_catches_a_small_error():
    model, make_inputs = zoo.build("gpt2")
    tol = zoo.TOLERANCE["cpu"]

    def same(**kw):
        return model(**kw)

    assert zoo.compare_with_eager(model, same, make_inputs, (1, 2), **tol) == [0.0, 0.0]

    def off_on_second_call(**kw):
        out = model(**kw)
        if kw["input_ids"].equal(make_inputs(2)["input_ids"]):
            out.logits[0, 3, 5] += 1e-4
        return out

    with pytest.raises(AssertionError, match=r"gpt2 x: call 1 \(seed 2\), output 'logits'"):
        zoo.compare_with_eager(model, off_on_second_call, make_inputs, (1, 2), label="gpt2 x", **tol)

    def other_fields(**kw):
        return {"hidden": model(**kw).logits}

    with pytest.raises(AssertionError, match="outputs"):
        zoo.compare_with_eager(model, other_fields, make_inputs, (1,), **tol)
