"""Build our model from a Hugging Face model directory's safetensors files.

Checkpoint tensors are mapped onto our parameters by name; the separate q/k/v
and gate/up projections land in slices of the fused weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gemma import model_class
from chatapp.engine.models.llama import LlamaForCausalLM, RMSNorm

# checkpoint suffix -> (our parameter suffix, shard index within the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class CheckpointError(ValueError):
    """The checkpoint's files do not match what its config describes."""


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {model_dir}")
    return files


def _shard_sizes(mc: ModelConfig, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        return [mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim]
    return [mc.intermediate_size, mc.intermediate_size]


def load_model(
    model_dir: Path, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    model = model_class(mc)(mc, max_positions, device="meta")
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                _load_tensor(name, f.get_tensor(name), params, loaded, mc)
    if mc.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(
            f"checkpoint in {model_dir} lacks weights: {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")
        )
    if mc.norm_weight_offset:  # Gemma stores w - 1: the forward multiplies by w (as HF's 1 + w, in float32)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.copy_((module.weight.float() + mc.norm_weight_offset).to(module.weight.dtype))
    model.build_rope(dtype, device)
    model.eval()
    return model


def _load_tensor(
    name: str, tensor: torch.Tensor, params: dict[str, torch.nn.Parameter], loaded: set[str], mc: ModelConfig
) -> None:
    if name.startswith(_OTHER_TOWERS):
        return  # a multimodal checkpoint's vision weights: we run its text model
    for prefix in ("language_model.model.", "model.language_model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if "rotary_emb" in name:
        return
    if name == "lm_head.weight" and mc.tie_word_embeddings:
        return
    for suffix, (fused, shard) in _FUSED.items():
        marker = f".{suffix}."
        if marker in name:
            prefix, kind = name.split(marker)
            target = f"{prefix}.{fused}.{kind}"
            if target not in params:
                raise CheckpointError(f"unexpected checkpoint tensor {name}")
            sizes = _shard_sizes(mc, fused)
            start = sum(sizes[:shard])
            dest = params[target].data[start : start + sizes[shard]]
            _copy(dest, tensor, name)
            loaded.add(f"{target}#{shard}")
            if all(f"{target}#{i}" in loaded for i in range(len(sizes))):
                loaded.add(target)
            return
    if name not in params:
        raise CheckpointError(f"unexpected checkpoint tensor {name}")
    _copy(params[name].data, tensor, name)
    loaded.add(name)


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise CheckpointError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)
