"""A GGUF model file read in place: its metadata as our ModelConfig, its tensors as raw rows.

Why: GGUF files already hold the model in the layout and quantisation people chose; reading
them memory-mapped (the `gguf` package's reader) lets the loader go tensor by tensor from the
file's blocks to our kernels' packing, with no float32 copy of the model anywhere.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chatapp.engine.models.config import ModelConfig, UnsupportedModelError

# GGUF `general.architecture` -> the Hugging Face architecture our forward runs for it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mistral files say "llama" too
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose converter permuted q/k rows for llama.cpp's interleaved RoPE; our forward uses
# Hugging Face's rotate-half layout, so their rows are put back (as transformers' GGUF loader does).
_PERMUTED_QK = ("llama", "mistral")


class GGUFError(ValueError):
    """A GGUF file that is unreadable, truncated, or does not describe a model we can run."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # e.g. "Q4_K", "F32"
    type_id: int  # ggml's type id
    shape: tuple[int, ...]  # PyTorch order: (rows, columns) for a matrix
    data: np.ndarray  # memory-mapped: [rows, row bytes] (quantized) or [rows, columns] (float)
    offset: int  # byte offset in the file


class GGUFModelFile:
    """An open GGUF file: metadata, model config and tensors by name (nothing read until asked)."""

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.path = Path(path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises ValueError, IndexError, OSError... on damaged files
            raise GGUFError(f"{self.path.name} is not a readable GGUF file ({exc})") from exc
        size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self._reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            if t.data_offset + int(t.n_bytes) > size:
                raise GGUFError(f"{self.path.name} is truncated: tensor {t.name} ends past the end of the file")
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, int(t.tensor_type), shape, t.data,
                                              int(t.data_offset))
        self.architecture = str(self.field("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return default if value is None else value

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name} lacks tensor {name}") from None

    def release(self, tensor: GGUFTensor) -> None:
        """Drop a tensor's pages from this process's memory once it has been repacked.

        The file stays mapped (and in the page cache); only our resident set shrinks, so
        loading never holds the file and its packed copy at once.
        """
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start = tensor.offset // page * page
        end = min(len(mm), tensor.offset + tensor.data.nbytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    @property
    def permuted_qk(self) -> bool:
        return self.architecture in _PERMUTED_QK

    # -- the model's config ------------------------------------------------------------------------

    def model_config(self) -> ModelConfig:
        arch = GGUF_ARCHITECTURES.get(self.architecture)
        if arch is None:
            raise UnsupportedModelError(
                f"GGUF architecture {self.architecture or 'unknown'!r} is not supported by chatapp's engine; "
                f"it runs {', '.join(GGUF_ARCHITECTURES)}")
        try:
            return self._model_config(arch)
        except (KeyError, TypeError, ValueError) as exc:
            raise GGUFError(f"{self.path.name} has incomplete or wrong model metadata ({exc})") from exc

    def _required(self, key: str) -> Any:
        value = self.arch_field(key)
        if value is None:
            raise KeyError(f"{self.architecture}.{key} is missing")
        return value

    def _model_config(self, arch: str) -> ModelConfig:
        hidden = int(self._required("embedding_length"))
        heads = int(self._required("attention.head_count"))
        kv_heads = self.arch_field("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts (some newer files): ours must be uniform
            if len(set(kv_heads)) != 1:
                raise UnsupportedModelError("per-layer KV head counts are not supported")
            kv_heads = kv_heads[0]
        embed = self.tensor("token_embd.weight")
        vocab = int(self.arch_field("vocab_size", embed.shape[0]))
        head_dim = int(self.arch_field("attention.key_length", hidden // heads))
        eos = {int(self.field(key)) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                "tokenizer.ggml.eom_token_id") if self.field(key) is not None}
        bos = self.field("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._required("feed_forward_length")),
            num_layers=int(self._required("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=int(self.arch_field("context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            eos_token_ids=frozenset(eos),
            bos_token_id=None if bos is None else int(bos),
            checkpoint_dtype=None,
        )

    def _rope_scaling(self) -> dict[str, Any] | None:
        if "rope_freqs.weight" in self.tensors:  # Llama 3.1+: the converter stored the frequency factors
            factors = np.asarray(self.tensor("rope_freqs.weight").data, dtype=np.float32)
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
        kind = self.arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
        return {"rope_type": "linear", "factor": float(self.arch_field("rope.scaling.factor", 1.0))}
