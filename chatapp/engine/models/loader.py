"""Build our model from a Hugging Face model directory's safetensors files.

Checkpoint tensors are mapped onto our parameters by name; the separate q/k/v
and gate/up projections land in slices of the fused weights. Loading goes one
decoder layer at a time (see load_model), never the whole float model at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from chatapp.engine.memory import return_freed_memory
from chatapp.engine.models.checkpoint_files import CheckpointError, checkpoint_files
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gemma import model_class
from chatapp.engine.models.llama import LlamaForCausalLM, RMSNorm
from chatapp.engine.models.safetensors_reader import StoredTensor, read_index, read_into, read_tensor

# checkpoint suffix -> (our parameter suffix, shard index within the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def safetensors_files(model_dir: Path) -> list[Path]:
    files = checkpoint_files(model_dir)
    if not files:
        raise CheckpointError(f"no .safetensors weights in {model_dir}")
    return files


def _shard_sizes(mc: ModelConfig, fused: str) -> list[int]:
    """The row counts of a fused weight's shards (q, k, v or gate, up), by its parameter name."""
    if "qkv_proj" in fused:
        return [mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim]
    return [mc.intermediate_size, mc.intermediate_size]


class LayerSink(Protocol):
    """Takes each decoder layer as soon as its weights are in (load_quantizer.LoadQuantizer)."""

    def begin(self, model: LlamaForCausalLM) -> None: ...
    def layer(self, model: LlamaForCausalLM, layer: nn.Module) -> None: ...
    def finish(self, model: LlamaForCausalLM) -> None: ...


def load_model(
    model_dir: Path,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    sink: LayerSink | None = None,
) -> LlamaForCausalLM:
    """Our model from the checkpoint, read tensor by tensor and materialised one group of modules at a
    time (embeddings and final norm, each decoder layer, the LM head). A sink that quantizes each
    layer as it arrives keeps the float model from ever being whole in memory."""
    model = model_class(mc)(mc, max_positions, device="meta")
    model.build_rope(dtype, device)
    entries = _checkpoint_entries(model_dir, model)
    fill = _Filler(model_dir, mc, dtype, device)
    # Quantizing, the embedding table (and the LM head, quantized last) stay in a 16-bit
    # checkpoint's dtype: a row is exact in float32 once looked up, and a 128k vocabulary's table
    # is 2 GB in float32.
    compact = sink is not None and device.type == "cpu"
    fill([("embed_tokens.", model.embed_tokens)], entries.pop("embed_tokens", []), keep_16bit=compact)
    fill([("norm.", model.norm)], entries.pop("norm", []))
    if sink is not None:
        sink.begin(model)
    for i, layer in enumerate(model.layers):
        fill([(f"layers.{i}.", layer)], entries.pop(f"layers.{i}", []))
        if sink is not None:
            sink.layer(model, layer)
            return_freed_memory()  # the layer's float weights, before the next layer's arrive
    if model.lm_head is not None:
        fill([("lm_head.", model.lm_head)], entries.pop("lm_head", []), keep_16bit=compact)
    if sink is not None:
        sink.finish(model)
    model.eval()
    return model


_Entry = tuple[StoredTensor, str, int | None]  # (the stored tensor, our parameter, fused shard)


def _checkpoint_entries(model_dir: Path, model: LlamaForCausalLM) -> dict[str, list[_Entry]]:
    """Every checkpoint tensor we read, grouped by the module it fills ("embed_tokens", "norm",
    "layers.N", "lm_head").

    Unknown names are refused here, before a single weight is read.
    """
    ours = {name for name, _ in model.named_parameters()}
    groups: dict[str, list[_Entry]] = {}
    for path in safetensors_files(model_dir):
        for name, stored in read_index(path).items():
            target = _target(name, model.config)
            if target is None:
                continue
            param, shard = target
            if param not in ours:
                raise CheckpointError(f"unexpected checkpoint tensor {name}")
            group = ".".join(param.split(".")[:2]) if param.startswith("layers.") else param.split(".")[0]
            groups.setdefault(group, []).append((stored, param, shard))
    return groups


class _Filler:
    """Materialises a group of modules and reads its checkpoint tensors in, every weight accounted for."""

    def __init__(self, model_dir: Path, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.mc, self.dtype, self.device = model_dir, mc, dtype, device

    @torch.no_grad()
    def __call__(self, modules: list[tuple[str, nn.Module]], entries: list[_Entry], keep_16bit: bool = False) -> None:
        """keep_16bit: a one-tensor module takes its checkpoint tensor's dtype where that is 16-bit."""
        dtype = self.dtype
        if keep_16bit and len(entries) == 1 and entries[0][0].dtype in ("BF16", "F16"):
            dtype = entries[0][0].torch_dtype
        params: dict[str, nn.Parameter] = {}
        for prefix, module in modules:
            module.to(dtype=dtype).to_empty(device=self.device)
            params.update({prefix + n: p for n, p in module.named_parameters()})
        loaded: set[str] = set()
        for stored, param, shard in entries:
            self._put(params[param].data, shard, stored, param, loaded)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(
                f"checkpoint in {self.model_dir} lacks weights: {', '.join(missing[:6])}"
                + (" ..." if len(missing) > 6 else "")
            )
        if self.mc.norm_weight_offset:  # Gemma stores w - 1: the forward multiplies by w (as HF's 1 + w, in float32)
            for _prefix, module in modules:
                for norm in module.modules():
                    if isinstance(norm, RMSNorm):
                        norm.weight.copy_((norm.weight.float() + self.mc.norm_weight_offset).to(norm.weight.dtype))

    def _put(self, dest: torch.Tensor, shard: int | None, stored: StoredTensor, param: str, loaded: set[str]) -> None:
        if shard is not None:
            sizes = _shard_sizes(self.mc, param)
            start = sum(sizes[:shard])
            dest = dest[start : start + sizes[shard]]
        if tuple(dest.shape) != stored.shape:
            raise CheckpointError(f"tensor {stored.name} has shape {stored.shape}, expected {tuple(dest.shape)}")
        if stored.torch_dtype == dest.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            read_into(stored, dest)  # straight into the weight: no second copy in memory
        else:
            dest.copy_(read_tensor(stored))  # another dtype (bf16 -> float32) or device
        if shard is None:
            loaded.add(param)
            return
        loaded.add(f"{param}#{shard}")
        if all(f"{param}#{i}" in loaded for i in range(len(sizes))):
            loaded.add(param)


def _target(name: str, mc: ModelConfig) -> tuple[str, int | None] | None:
    """Our parameter (and its shard of a fused weight) for a checkpoint tensor; None for one we skip."""
    if name.startswith(_OTHER_TOWERS):
        return None  # a multimodal checkpoint's vision weights: we run its text model
    for prefix in ("language_model.model.", "model.language_model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight" and mc.tie_word_embeddings:
        return None
    for suffix, (fused, shard) in _FUSED.items():
        marker = f".{suffix}."
        if marker in name:
            prefix, kind = name.split(marker)
            return f"{prefix}.{fused}.{kind}", shard
    return name, None
