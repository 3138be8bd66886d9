"""The configured CPU quantization, applied one decoder layer at a time as the loader fills them.

Why layer by layer: a 7B checkpoint in bf16 is 15 GB, and 30 GB as a float32 model; quantized to
int8 it is 7.5 GB. The loader materialises one layer, hands it here, and this swaps its
projections for quantized ones before the next layer is read, so the float model never exists
whole. The same object quantizes an already loaded float model (``run``), so both paths share
one policy:

- ``None``: the float weights stay.
- ``"int4"``: projections rounded to 4-bit blocks, the LM head to 8-bit (block_quant.py).
- ``"int8"``: calibrated dynamic int8 (quantization.py), calibration run layer by layer.
- ``"auto"``: layers whose weights already are exact 4/8-bit blocks keep them (a de-quantised GGUF
  saved as safetensors); from the first layer that is not, calibrated int8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from chatapp.engine.attention import AttentionMetadata, TorchAttentionBackend, layer_attention
from chatapp.engine.block_kinds import BLOCK
from chatapp.engine.block_quant import blocks_fit, pack_head, pack_layer
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.llama import LlamaForCausalLM
from chatapp.engine.quantization import CALIBRATION_TEXT, Calibration, Int8Quantizer

log = logging.getLogger(__name__)


class LoadQuantizer:
    """begin(model) once the embeddings are in, layer(model, layer) for each decoder layer in order,
    finish(model) once the LM head is in; ``applied`` then names what was done (None, int4 or int8)."""

    def __init__(self, mode: str | None, ext: ModuleType | None, calibration: Callable[[], Calibration]) -> None:
        self.mode = mode
        self.ext = ext
        self._calibration = calibration
        self._int8: Int8Quantizer | None = None
        self._lossless = False  # auto, while every layer so far was exact blocks
        self._lossless_layers = 0
        self.applied: str | None = None

    def begin(self, model: LlamaForCausalLM) -> None:
        mc = model.config
        if self.mode == "int4" and not blocks_fit(mc):
            log.warning("int4 needs layer widths divisible by %d; using int8", BLOCK)
            self.mode = "int8"
        if self.mode == "auto":
            self._lossless = self.ext is not None and self.ext.block_quant_fast() and blocks_fit(mc)
            if not self._lossless:
                self.mode = "int8"
        self.applied = "int4" if self.mode == "auto" else self.mode  # auto: until a layer is not exact
        if self.mode in ("auto", "int8"):
            self._int8 = Int8Quantizer(model, self._calibration())

    def layer(self, model: LlamaForCausalLM, layer: nn.Module) -> None:
        if self.mode is None:
            return
        if self.mode == "int4":
            pack_layer(layer, self.ext, lossless_only=False)
            return
        assert self._int8 is not None  # begin() made it: the mode is auto or int8 here
        if self._lossless and pack_layer(layer, self.ext, lossless_only=True):
            self._lossless_layers += 1
            self._int8.advance(model, layer)  # the calibration stream, in case a later layer needs it
            return
        if self._lossless:
            self._lossless = False
            self.applied = "int8"
            if self._lossless_layers:
                log.info("the first %d layers are exact 4/8-bit blocks, kept; the rest int8", self._lossless_layers)
        self._int8.layer(model, layer)

    def finish(self, model: LlamaForCausalLM) -> None:
        if self.mode is None:
            return
        if self.mode == "int4":
            pack_head(model, self.ext, lossless_only=False)
        elif not (self._lossless and pack_head(model, self.ext, lossless_only=True)):
            self.applied = "int8"
            assert self._int8 is not None  # begin() made it: the mode is auto or int8 here
            self._int8.finish(model)
        if self.applied == "int4" and self.mode == "auto":
            log.info("weights are 4/8-bit blocks already: kept as they are (int4)")
        self._int8 = None

    def run(self, model: LlamaForCausalLM) -> None:
        """Quantize a model whose float weights are all loaded."""
        self.begin(model)
        for layer in model.layers:
            self.layer(model, layer)
        self.finish(model)


def calibration_prefill(
    model_dir: Path, mc: ModelConfig, device: torch.device, kv_dtype: torch.dtype, max_tokens: int, block_size: int
) -> Calibration:
    """CALIBRATION_TEXT as one float prefill for int8, with torch attention on a scratch cache of its own."""
    from chatapp.engine.tokenizer import Tokenizer

    ids = Tokenizer(model_dir).encode(CALIBRATION_TEXT)
    ids = [i for i in ids if i < mc.vocab_size][:max_tokens]
    n = len(ids)
    attn = single_prefill_attention(mc, n, device, kv_dtype, block_size)
    return Calibration(torch.tensor(ids, device=device), torch.arange(n, device=device), attn)


def single_prefill_attention(
    mc: ModelConfig, n: int, device: torch.device, kv_dtype: torch.dtype, block_size: int
) -> TorchAttentionBackend:
    """Torch attention set up for one n-token prefill (positions 0..n-1) on a scratch cache of its own."""
    blocks = -(-n // block_size)
    pool = torch.zeros(
        mc.num_layers, 2, blocks, block_size, mc.num_kv_heads, mc.head_dim, dtype=kv_dtype, device=device
    )
    attn = TorchAttentionBackend([(p[0], p[1]) for p in pool], mc.num_heads, mc.head_dim, layer_attention(mc))
    attn.begin_step(
        AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            num_decodes=0,
            max_query_len=n,
            max_seq_len=n,
        )
    )
    return attn
