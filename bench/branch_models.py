"""Models whose branches are wide, for ``bench/zoo.py``: where lanes have the most to win.

- ``googlenet``, ``inception_v3`` (torchvision): every inception block runs four convolution
  branches side by side on one input and concatenates them; at a small batch each branch's
  kernels fill a fraction of the GPU. Images of 224 and 299 pixels, batch 1 and 16.
- ``flux`` (diffusers' ``FluxTransformer2DModel``): each joint block runs the image tokens and the
  text tokens through their own projections, norms and MLPs, side by side around one shared
  attention; the single blocks run the attention and an MLP in parallel off one norm. At
  FLUX.1's width (24 heads of 128), two joint and two single blocks; a 256 and a 512 pixel image
  (256 and 1024 latent tokens) beside 128 and 512 text tokens, batch 1.
- ``sd3`` (diffusers' ``SD3Transformer2DModel``): MMDiT joint blocks, image and text streams side
  by side, at SD3.5 Medium's width (24 heads of 64), four blocks; 512 and 1024 pixel images
  (1024 and 4096 latent tokens) beside 154 text tokens, batch 1.

Random weights in bf16; ``sizes="zoo"``: tiny float32 widths, for the host's share on the CPU.
torchvision and diffusers are imported only when such a model is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

MODELS = ("googlenet", "inception_v3", "flux", "sd3")


class Workload(NamedTuple):
    """A model under the bench: the inputs of a call at each shape (by seed) and the tensor of
    its result compared with eager's."""

    model: Any
    shapes: dict[str, Callable[[int], dict]]
    output: Callable[[Any], Any]


def _randn(shape: tuple[int, ...], device: str, dtype: Any, seed: int):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randn(shape, device=device, generator=g).to(dtype)


def _vision(name: str, device: str, sizes: str) -> Workload:
    import torch
    import torchvision

    torch.manual_seed(0)
    side = 299 if name == "inception_v3" else 224
    kwargs = dict(weights=None, aux_logits=False, init_weights=False)
    if name == "inception_v3":
        kwargs["transform_input"] = False
    with torch.device(device):
        model = getattr(torchvision.models, name)(**kwargs)
    dtype = torch.bfloat16 if sizes == "real" else torch.float32
    model = model.to(dtype=dtype).eval()
    batches = (1, 16) if sizes == "real" else (1, 2)

    def images(b: int) -> Callable[[int], dict]:
        return lambda seed: dict(x=_randn((b, 3, side, side), device, dtype, seed))

    return Workload(model, {f"batch[{b},3,{side},{side}]": images(b) for b in batches}, lambda out: out)


def _diffusion(name: str, device: str, sizes: str) -> Workload:
    import torch
    import diffusers

    real = sizes == "real"
    dtype = torch.bfloat16 if real else torch.float32
    torch.manual_seed(0)
    if name == "flux":
        heads, head_dim, text_dim, pooled = (24, 128, 4096, 768) if real else (2, 32, 64, 32)
        config = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                      attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
                      pooled_projection_dim=pooled, guidance_embeds=False,
                      axes_dims_rope=(16, 56, 56) if real else (8, 12, 12))
        with torch.device(device):
            model = diffusers.FluxTransformer2DModel(**config)
        shapes_at = ((16, 128), (32, 512)) if real else ((4, 8), (8, 16))

        def inputs(side: int, text: int) -> Callable[[int], dict]:
            def make(seed: int) -> dict:
                rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
                img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
                return dict(hidden_states=_randn((1, side * side, 64), device, dtype, seed),
                            encoder_hidden_states=_randn((1, text, text_dim), device, dtype, seed + 100),
                            pooled_projections=_randn((1, pooled), device, dtype, seed + 200),
                            timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
                            img_ids=img_ids.to(device=device, dtype=dtype),
                            txt_ids=torch.zeros(text, 3, device=device, dtype=dtype), return_dict=False)
            return make

        shapes = {f"image[{s * s}]+text[{t}]": inputs(s, t) for s, t in shapes_at}
    else:
        heads, head_dim, text_dim, pooled = (24, 64, 4096, 2048) if real else (2, 32, 64, 32)
        config = dict(sample_size=128 if real else 16, patch_size=2, in_channels=16, num_layers=4 if real else 2,
                      attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
                      caption_projection_dim=heads * head_dim, pooled_projection_dim=pooled, out_channels=16,
                      pos_embed_max_size=192 if real else 32)
        with torch.device(device):
            model = diffusers.SD3Transformer2DModel(**config)
        shapes_at = ((64, 154), (128, 154)) if real else ((8, 6), (16, 6))

        def inputs(side: int, text: int) -> Callable[[int], dict]:
            return lambda seed: dict(hidden_states=_randn((1, 16, side, side), device, dtype, seed),
                                     encoder_hidden_states=_randn((1, text, text_dim), device, dtype, seed + 100),
                                     pooled_projections=_randn((1, pooled), device, dtype, seed + 200),
                                     timestep=torch.full((1,), 500.0, device=device, dtype=dtype), return_dict=False)

        shapes = {f"image[{(s // 2) ** 2}]+text[{t}]": inputs(s, t) for s, t in shapes_at}
    return Workload(model.to(dtype=dtype).eval(), shapes, lambda out: out[0])


def build(name: str, device: str, sizes: str = "real") -> Workload:
    """The model ``name`` of :data:`MODELS` with its shapes, on ``device``."""
    if name in ("googlenet", "inception_v3"):
        return _vision(name, device, sizes)
    if name in ("flux", "sd3"):
        return _diffusion(name, device, sizes)
    raise ValueError(f"unknown model {name!r} (models: {', '.join(MODELS)})")
