"""Hands our model's weights to the C++ layer loop (chatapp/engine/csrc/cpu_forward.cpp): the Llama
family's layers and Gemma's (their extra norms, windows and RoPE-less layers by flags)."""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from chatapp.engine.block_quant import BlockQuantLinear
from chatapp.engine.models.gemma import GemmaDecoderLayer
from chatapp.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from chatapp.engine.quantization import Int8Linear


def _linear_spec(linear: nn.Module) -> dict[str, Any]:
    if isinstance(linear, BlockQuantLinear):
        return {"parts": [(p.packed, p.kind, p.out_features) for p in linear.parts], "bias": linear.bias}
    if isinstance(linear, Int8Linear):
        return {
            "packed": linear._packed,
            "in_features": linear.in_features,
            "outliers": linear.outliers,
            "outlier_rows": linear.outlier_rows if linear.outliers is not None else None,
            "bias": linear.bias,
        }
    assert isinstance(linear, nn.Linear), type(linear)
    return {"weight": linear.weight.detach(), "bias": None if linear.bias is None else linear.bias.detach()}


def build_cpu_model(ext: ModuleType, model: LlamaForCausalLM) -> Any:
    """A CpuModel holding the decoder layers' weights (shared with the Python model, not copied)."""
    mc = model.config

    def weight(norm: RMSNorm | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    cpu = ext.CpuModel(
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
        mc.rms_norm_eps,
        model.norm.weight.detach(),
        mc.attention_scale,
        mc.sliding_window or 0,
        mc.attn_logit_softcapping or 0.0,
        mc.is_gemma,
    )
    gemma = mc.is_gemma  # sandwich norms: each block's output normed before the residual
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer | GemmaDecoderLayer, module)  # the model's layer_class
        attn, mlp = layer.self_attn, layer.mlp
        cpu.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.mlp_input_norm.weight.detach(),
            weight(attn.q_norm),
            weight(attn.k_norm),
            _linear_spec(attn.qkv_proj),
            _linear_spec(attn.o_proj),
            _linear_spec(mlp.gate_up_proj),
            _linear_spec(mlp.down_proj),
            weight(layer.post_attention_layernorm) if gemma else None,
            weight(cast(GemmaDecoderLayer, layer).post_feedforward_layernorm) if gemma else None,
            mc.layer_is_local(i),
            mc.layer_uses_rope(i),
        )
    return cpu
