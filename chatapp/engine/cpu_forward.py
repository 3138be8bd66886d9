"""Hands our model's weights to the C++ layer loop (chatapp/engine/csrc/cpu_forward.cpp)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn

from chatapp.engine.block_quant import BlockQuantLinear
from chatapp.engine.models.llama import LlamaForCausalLM
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


def build_cpu_model(ext: ModuleType, model: LlamaForCausalLM):
    """A CpuModel holding the decoder layers' weights (shared with the Python model, not copied)."""
    mc = model.config
    cpu = ext.CpuModel(mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.rms_norm_eps, model.norm.weight.detach())
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        cpu.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            None if attn.q_norm is None else attn.q_norm.weight.detach(),
            None if attn.k_norm is None else attn.k_norm.weight.detach(),
            _linear_spec(attn.qkv_proj),
            _linear_spec(attn.o_proj),
            _linear_spec(mlp.gate_up_proj),
            _linear_spec(mlp.down_proj),
        )
    return cpu
