"""Our forward pass for Gemma 2 and Gemma 3 (text), on the Llama family's pieces (llama.py).

What sets them apart, all read from ModelConfig:
- sandwich norms: each attention and MLP output is normed before it joins the residual stream, and
  the MLP has its own pre-norm; checkpoints store RMSNorm weights as w - 1 (loaders add the 1);
- GeGLU (tanh-approximated GELU) in the MLP, and embeddings scaled by sqrt(hidden_size);
- local layers attend to a sliding window of keys (Gemma 3 rotates them with a RoPE base of their
  own), global layers to every earlier key; the attention backend (or the C++ layer loop,
  csrc/cpu_forward.cpp, which follows this file) applies each layer's window;
- the attention scale comes from query_pre_attn_scalar; Gemma 2 soft-caps attention scores (in the
  backend) and the final logits (here).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from chatapp.engine.attention import AttentionBackend
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.llama import MLP, Attention, Device, LlamaForCausalLM, RMSNorm, Tables
from chatapp.engine.models.rope import RotaryEmbedding


class GemmaDecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer: int, device: Device = None) -> None:
        super().__init__()
        h, eps = mc.hidden_size, mc.rms_norm_eps
        self.local = mc.layer_is_local(layer)
        self.input_layernorm = RMSNorm(h, eps, device)
        self.self_attn = Attention(mc, layer, device)
        self.post_attention_layernorm = RMSNorm(h, eps, device)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, device)
        self.mlp = MLP(mc, device)
        self.post_feedforward_layernorm = RMSNorm(h, eps, device)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output the MLP reads (int8 smoothing folds its factors into it)."""
        return self.pre_feedforward_layernorm

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, table: Tables, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, table, attn))
        return cast(torch.Tensor, x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2/3: the Llama model's embedding, head and loading, with Gemma's layers and extras."""

    layer_class = GemmaDecoderLayer

    def __init__(self, mc: ModelConfig, max_positions: int, device: Device = None) -> None:
        super().__init__(mc, max_positions, device)
        self.local_rope: RotaryEmbedding | None = None

    def build_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        super().build_rope(dtype, device)
        mc = self.config
        if mc.local_rope_theta is not None:  # Gemma 3: local layers take their own base, unscaled
            self.local_rope = RotaryEmbedding(
                mc.head_dim, self.max_positions, mc.local_rope_theta, None, dtype, device, mc.rotary_dim
            )
        else:
            self.local_rope = self.rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # As Hugging Face: sqrt(hidden) rounded to the embedding's dtype, then one multiply.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(x.dtype)

    def rope_tables(self, positions: torch.Tensor) -> tuple[Tables, Tables]:
        assert self.rope is not None and self.local_rope is not None, "build_rope() comes first"
        table = self.rope.lookup(positions)
        return table, table if self.local_rope is self.rope else self.local_rope.lookup(positions)

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, tables: tuple[Tables, Tables], attn: AttentionBackend
    ) -> torch.Tensor:
        if layer.local:
            return cast(torch.Tensor, layer(x, self.local_rope, tables[1], attn))
        return cast(torch.Tensor, layer(x, self.rope, tables[0], attn))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def model_class(mc: ModelConfig) -> type[LlamaForCausalLM]:
    """The forward that runs this config's family."""
    return GemmaForCausalLM if mc.is_gemma else LlamaForCausalLM
