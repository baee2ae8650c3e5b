"""Capabilities of vLLM's own kernels, declared when the vLLM plugin loads.

Custom ops nobody declared are serialized (``ir.capabilities``): in a vLLM model compiled with
the ``capturepass`` backend (vLLM then enables every custom op, ``custom_ops="all"``), that is
every norm, activation and rotary embedding of the model, and nothing runs beside them. The ops
below are declared ``"safe"``: each writes only the arguments its schema marks as written (the
graph orders every reader after the write), reads only its arguments (``onednn_mm``'s weight,
behind its handle, is read-only once loaded), talks to no other rank, and launches ordinary
grids whose blocks never wait for one another (per-row or per-element work; the dynamic fp8
scale is an atomic maximum, not a wait), so other lanes' kernels beside them cannot stall them.

Left undeclared (serialized), for reasons their schemas do not show:

- ``vllm::unified_kv_cache_update`` and the attention ops: they write and read the layer's KV
  cache and per-step metadata through vLLM's forward context, and attention shares scratch
  buffers across layers;
- ``vllm::moe_forward`` / ``moe_forward_shared``: a scratch buffer shared by every MoE layer,
  expert-load statistics, and, with expert or data parallelism, the tokens' dispatch and combine
  between ranks inside the op (cooperative launches with DeepEP); the shared expert already runs
  on vLLM's own side stream;
- ``vllm::all_reduce`` and the other collectives: every rank must issue them in one order, and
  the custom all-reduce's blocks spin on their peers;
- GEMMs with kernels of their own (CUTLASS, Marlin, DeepGEMM): some wait on other blocks
  (Marlin's do), and which ones is not visible from here;
- the host's MoE kernels (``cpu_fused_moe``): scratch memory of their own.

A user's own declaration of one of these ops (``capturepass.register_capability``) is kept.
"""

from __future__ import annotations

from capturepass.ir.capabilities import REGISTRY

SAFE_KERNELS = (
    # Norms, activations, rotary embedding (CUDA and the host).
    "_C::rms_norm",
    "_C::fused_add_rms_norm",
    "_C::silu_and_mul",
    "_C::gelu_and_mul",
    "_C::gelu_tanh_and_mul",
    "_C::rotary_embedding",
    # fp8 quantization (CUDA).
    "_C::static_scaled_fp8_quant",
    "_C::dynamic_scaled_fp8_quant",
    "_C::dynamic_per_token_scaled_fp8_quant",
    "_C::per_token_group_fp8_quant",
    # The norms vLLM's IR wraps for its Inductor passes.
    "vllm_ir::rms_norm",
    "vllm_ir::fused_add_rms_norm",
    # The host's linear layers (oneDNN, packed weights).
    "_C::onednn_mm",
    "_C::weight_packed_linear",
)


def declare() -> list[str]:
    """Declares :data:`SAFE_KERNELS` ``"safe"``, except those already declared; returns the
    names it declared. Touches no device and needs no op to be loaded (names are enough)."""
    declared = []
    for name in SAFE_KERNELS:
        if not REGISTRY.declared(name):
            REGISTRY.register(name, overlap="safe")
            declared.append(name)
    return declared
