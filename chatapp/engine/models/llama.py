"""Our forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, SmolLM3).

The differences between these are small and are flags here: q/k/v biases
(Qwen2), per-head RMSNorm of q and k (Qwen3), tied embeddings, RoPE on part of
each head and LongRoPE tables (Phi; rope.py), layers without RoPE (SmolLM3). Attention reads
and writes the engine's paged KV cache through an attention backend; the
q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.engine.attention import AttentionBackend
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.rope import RotaryEmbedding

Device = torch.device | str | None

# On a GPU, RMSNorm, SwiGLU's gate and RoPE run as one Triton kernel each (chatapp/kernels/fused.py
# says why). CHATAPP_GPU_FUSED=0 runs the torch formulas instead, to compare or to debug.
FUSED_GPU_KERNELS = os.environ.get("CHATAPP_GPU_FUSED", "1") != "0"
# On a GPU, a one-row projection in half precision (the decode step of a single chat) runs as our
# GEMV kernel (chatapp/kernels/gemv.py says why); CHATAPP_GPU_GEMV=0 leaves it to cuBLAS.
GEMV_KERNEL = os.environ.get("CHATAPP_GPU_GEMV", "1") != "0"
Tables = tuple[torch.Tensor, torch.Tensor]  # a RoPE table's (cos, signed sin) for a step's positions


def gemv_applies(x: torch.Tensor) -> bool:
    """One row in half precision on a GPU, with the GEMV kernel on (see GEMV_KERNEL)."""
    return GEMV_KERNEL and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, through the GEMV kernel where that applies."""
    if gemv_applies(x) and type(linear) is nn.Linear and linear.bias is None:
        return linear_gemv(x, linear.weight)
    return cast(torch.Tensor, linear(x))


def linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from chatapp.kernels.gemv import gemv

    return cast(torch.Tensor, gemv(x.contiguous(), weight))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and FUSED_GPU_KERNELS and x.dim() == 2 and x.stride(-1) == 1:
            from chatapp.kernels.fused import rms_norm

            return cast(torch.Tensor, rms_norm(x, self.weight, self.eps))
        # One fused op; bit-identical to HF's x * rsqrt(mean(x^2) + eps) * w in float32.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig, layer: int, device: Device = None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_heads, mc.num_kv_heads, mc.head_dim
        self.q_size = mc.num_heads * mc.head_dim
        self.kv_size = mc.num_kv_heads * mc.head_dim
        self.qkv_proj: nn.Module = nn.Linear(
            mc.hidden_size, self.q_size + 2 * self.kv_size, bias=mc.attention_bias, device=device
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, mc.hidden_size, bias=False, device=device)
        self.use_rope = mc.layer_uses_rope(layer)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if mc.qk_norm:
            self.q_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, device)
            self.k_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, table: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = project(self.qkv_proj, x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # set together in __init__
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        if self.use_rope and qk.is_cuda and FUSED_GPU_KERNELS and rope.rotary_dim == self.head_dim:
            from chatapp.kernels.fused import rope_

            rope_(qk, table[0][:, 0], table[1][:, 0])  # in place: qk is this step's own projection
        elif self.use_rope:
            qk = rope.rotate(qk, table)  # q and k in one go
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer, qk[:, : self.num_heads], qk[:, self.num_heads :], v)
        return project(self.o_proj, out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, mc: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.intermediate = mc.intermediate_size
        self.gate_up_proj: nn.Module = nn.Linear(
            mc.hidden_size, 2 * mc.intermediate_size, bias=mc.mlp_bias, device=device
        )
        self.down_proj: nn.Module = nn.Linear(mc.intermediate_size, mc.hidden_size, bias=mc.mlp_bias, device=device)
        self.gelu = mc.is_gemma  # GeGLU (tanh-approximated GELU), else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x)
        if gate_up.is_cuda and FUSED_GPU_KERNELS and not self.gelu and gate_up.dim() == 2:
            from chatapp.kernels.fused import silu_mul

            return project(self.down_proj, silu_mul(gate_up))
        gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return project(self.down_proj, act * up)


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer: int, device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, device)
        self.self_attn = Attention(mc, layer, device)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, device)
        self.mlp = MLP(mc, device)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output the MLP reads (int8 smoothing folds its factors into it)."""
        return self.post_attention_layernorm

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, table: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, table, attn)
        return cast(torch.Tensor, x + self.mlp(self.post_attention_layernorm(x)))


def projections(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, attribute) of a decoder layer's four projections, for the quantizers to swap."""
    return [
        (cast(nn.Module, layer.self_attn), "qkv_proj"),
        (cast(nn.Module, layer.self_attn), "o_proj"),
        (cast(nn.Module, layer.mlp), "gate_up_proj"),
        (cast(nn.Module, layer.mlp), "down_proj"),
    ]


class LlamaForCausalLM(nn.Module):
    """Token ids and positions of a flattened batch in, final hidden states out.

    device="meta" builds it without memory, for a loader to fill. The embedding is made uninitialised:
    on the meta device, nn.Embedding's normal_ init runs torch's reference ops, which import its
    compiler stack (~2 s and ~150 MB at every load).
    """

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, mc: ModelConfig, max_positions: int, device: Device = None) -> None:
        super().__init__()
        self.config = mc
        # An uninitialised weight: the loader fills it (nn.Embedding's own normal_ init is the slow ref op).
        self.embed_tokens = nn.Embedding(
            mc.vocab_size, mc.hidden_size, _weight=torch.empty(mc.vocab_size, mc.hidden_size, device=device)
        )
        self.layers = nn.ModuleList(self.layer_class(mc, i, device) for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, device)
        if mc.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False, device=device)
        self.max_positions = max_positions
        self.rope: RotaryEmbedding | None = None
        self.quantized_lm_head: nn.Module | None = None  # set by the load quantizer (int8 or int4) or the GGUF loader

    def build_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        mc = self.config
        self.rope = RotaryEmbedding(
            mc.head_dim, self.max_positions, mc.rope_theta, mc.rope_scaling, dtype, device, mc.rotary_dim
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings in the model's dtype (a quantized model keeps a 16-bit checkpoint's
        embedding table as it is: the rows are exact in float32)."""
        return cast(torch.Tensor, self.embed_tokens(input_ids)).to(self.norm.weight.dtype)

    def rope_tables(self, positions: torch.Tensor) -> tuple[Tables, Tables]:
        """(global, local) layers' (cos, signed_sin) for a step's positions; one set for this family."""
        assert self.rope is not None, "build_rope() comes first"
        table = self.rope.lookup(positions)
        return table, table

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, tables: tuple[Tables, Tables], attn: AttentionBackend
    ) -> torch.Tensor:
        """One decoder layer with its RoPE (a family with local layers picks theirs)."""
        return cast(torch.Tensor, layer(x, self.rope, tables[0], attn))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(input_ids)
        tables = self.rope_tables(positions)  # once per step, shared by every layer
        if x.is_cuda and FUSED_GPU_KERNELS and self._plain_layers():
            return self._forward_fused_residual(x, tables[0], attn)
        for layer in self.layers:
            x = self.run_layer(layer, x, tables, attn)
        return cast(torch.Tensor, self.norm(x))

    def _plain_layers(self) -> bool:
        """Every layer is a plain DecoderLayer run the plain way (not Gemma's, with its extra norms)."""
        return self.layer_class is DecoderLayer and type(self).run_layer is LlamaForCausalLM.run_layer

    def _forward_fused_residual(self, x: torch.Tensor, table: Tables, attn: AttentionBackend) -> torch.Tensor:
        """The same layers with each residual add fused into the norm that reads it (one kernel each
        instead of two; chatapp/kernels/fused.py): the last layer's adds into the final norm."""
        from chatapp.kernels.fused import add_rms_norm

        assert self.rope is not None
        layers = [cast(DecoderLayer, layer) for layer in self.layers]
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            x, h = add_rms_norm(x, layer.self_attn(h, self.rope, table, attn), post.weight, post.eps)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = add_rms_norm(x, layer.mlp(h), after.weight, after.eps)
        return cast(torch.Tensor, h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_lm_head is not None:
            return cast(torch.Tensor, self.quantized_lm_head(hidden))
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if gemv_applies(hidden):
            return linear_gemv(hidden, weight)
        return F.linear(hidden, weight)
