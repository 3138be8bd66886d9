"""A GGUF model file read in place: its metadata as our ModelConfig, its tensors as raw rows.

Why: GGUF files already hold the model in the layout and quantisation people chose; reading
them memory-mapped (the `gguf` package's reader) lets the loader go tensor by tensor from the
file's blocks to our kernels' packing, with no float32 copy of the model anywhere.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection, Container
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatapp.engine.models.config import (
    SOFTCAP_FIELDS,
    ModelConfig,
    UnsupportedModelError,
    check_sizes,
    optional_float,
)
from chatapp.engine.models.ggml_types import GGML_TYPES
from chatapp.engine.models.gguf_split import SPLIT_COUNT_KEY, SPLIT_NUMBER_KEY, SPLIT_TENSORS_KEY, part_names

if TYPE_CHECKING:  # numpy is imported where tensors are read: the tokenizer build (read_tokenizer_metadata) needs none
    import numpy as np

# GGUF `general.architecture` -> the Hugging Face architecture our forward runs for it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mistral files say "llama" too
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",  # Phi-3, Phi-3.5 and Phi-4 files all say "phi3"
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # every Gemma 3 size: the vision tower is a separate file
    "smollm3": "SmolLM3ForCausalLM",
}
# Gemma: every n-th layer is global (llama.cpp's SWA pattern), the others local.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
# Architectures whose converter permuted q/k rows for llama.cpp's interleaved RoPE; our forward uses
# Hugging Face's rotate-half layout, so their rows are put back (as transformers' GGUF loader does).
_PERMUTED_QK = ("llama", "mistral", "smollm3")


class GGUFError(ValueError):
    """A GGUF file that is unreadable, truncated, or does not describe a model we can run."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # e.g. "Q4_K", "F32"
    type_id: int  # ggml's type id
    shape: tuple[int, ...]  # PyTorch order: (rows, columns) for a matrix
    data: np.ndarray  # memory-mapped uint8 [rows, row bytes], whatever the type
    offset: int  # byte offset in its file
    part: int = 0  # which file of a split model holds it (0: the first, or the only one)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_LARGE_ARRAY = 1024  # longer arrays (a vocabulary) are skipped, not read: only the tokenizer needs them


class _HeaderReader:
    """Reads GGUF's little-endian header fields from a memory map, bounds-checked."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError("the header ends early (truncated file)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError("the header ends early (truncated file)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, merges): string() with the loop's lookups hoisted,
        ~3x faster over the 100k strings of a tokenizer build."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                start = pos + 8
                pos = start + unpack(buf, pos)[0]
                append(buf[start:pos].decode("utf-8", errors="replace"))
        except (struct.error, OverflowError):  # a length field past the end of the file (or past any offset)
            raise GGUFError("the header ends early (truncated file)") from None
        if pos > len(buf):
            raise GGUFError("the header ends early (truncated file)")
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if count > _LARGE_ARRAY:
                self._skip_array(item, count)
                return _SKIPPED
            return [self.value(item) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"unknown metadata value type {kind}")
        return self.take(fmt)

    def preamble(self) -> tuple[int, int]:
        """The magic number and version checked: (tensor count, metadata field count)."""
        if self.take("<I") != 0x46554747:  # "GGUF"
            raise GGUFError("no GGUF magic number")
        version = self.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported")
        return self.take("<Q"), self.take("<Q")

    def _skip_array(self, item: int, count: int) -> None:
        if item in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item]) * count
        elif item == _STRING:  # a vocabulary: 50-250k strings, each a u64 length and its bytes
            unpack, pos = _U64.unpack_from, self.pos  # locals: this loop is most of a warm start's header read
            try:
                for _ in range(count):
                    pos += 8 + unpack(self.buf, pos)[0]
            except (struct.error, OverflowError):  # a length field past the end of the file (or past any offset)
                raise GGUFError("the header ends early (truncated file)") from None
            self.pos = pos
        else:
            for _ in range(count):
                self.value(item)
        if self.pos > len(self.buf):
            raise GGUFError("the header ends early (truncated file)")


_SKIPPED = object()  # a long array left unread


def read_tokenizer_metadata(
    path: Path | str, string_arrays: Container[str] = (), until: Collection[str] = ()
) -> dict[str, Any]:
    """A GGUF file's metadata fields as transformers' GGUF reader returns them: arrays of numbers in
    full, arrays of strings as their length unless named in `string_arrays` (the vocabulary and merges,
    read in full). Why: transformers' reader module imports torch (~1 s), which the process that only
    builds a file's tokenizer (tokenizer.py) does without.

    until: stop once every one of these keys has been read, leaving the fields after them unread. Why: the
    tokenizer's kind comes before its vocabulary and merges, and walking those two string arrays took 7 ms
    of the engine's start (a 49k vocabulary) before its load could begin."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _HeaderReader(buf)
        _, num_fields = r.preamble()
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            if until and all(key in fields for key in until):
                break
            key = r.string()
            kind = r.take("<I")
            if kind != _ARRAY:
                fields[key] = r.value(kind)
                continue
            item, count = r.take("<I"), r.take("<Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt) * count
                if r.pos + size > len(buf):
                    raise GGUFError("the header ends early (truncated file)")
                fields[key] = list(struct.unpack_from(f"<{count}{fmt[1:]}", buf, r.pos))
                r.pos += size
            elif item == _STRING and key in string_arrays:
                fields[key] = r.strings(count)
            elif item == _STRING:
                r._skip_array(item, count)
                fields[key] = count
            else:
                raise GGUFError(f"metadata field {key} is an array of type {item}, which this reader does not read")
        return fields


class _Part:
    """One GGUF file, memory-mapped: its metadata and tensor table (a whole model, or one part of a split one)."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf = path, buf
        try:
            self.fields, self.table, self.data_start = self._read_header()
        except GGUFError as exc:
            raise GGUFError(f"{path.name} is not a readable GGUF file ({exc})") from exc

    @classmethod
    def open(cls, path: Path) -> _Part:
        try:
            with open(path, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # unreadable, or empty (mmap refuses length 0)
            raise GGUFError(f"{path.name} is not a readable GGUF file ({exc})") from exc
        return cls(path, buf)

    def _read_header(self) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
        r = _HeaderReader(self.buf)
        num_tensors, num_fields = r.preamble()
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = r.string()
            fields[key] = r.value(r.take("<I"))
        table = []
        for _ in range(num_tensors):
            name = r.string()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            table.append((name, dims, r.take("<I"), r.take("<Q")))
        alignment = int(fields.get("general.alignment", 32)) or 32
        return fields, table, -(-r.pos // alignment) * alignment

    def split_count(self) -> int:
        """How many files the model is split in (1: this file is the whole model)."""
        return _whole(self, SPLIT_COUNT_KEY, 1)

    def split_number(self) -> int:
        """Which part this is, from 1."""
        return _whole(self, SPLIT_NUMBER_KEY, 0) + 1

    def tensors(self, part: int) -> list[GGUFTensor]:
        """The tensor table as tensors over this file's memory map, each checked to lie within the file."""
        import numpy as np

        name_of_file, size = self.path.name, len(self.buf)
        data = np.frombuffer(self.buf, dtype=np.uint8)
        out = []
        for name, dims, type_id, offset in self.table:
            qtype = GGML_TYPES.get(type_id)
            if qtype is None:
                raise GGUFError(f"{name_of_file}: tensor {name} has unknown type {type_id}")
            block, block_bytes = qtype.block_weights, qtype.block_bytes
            shape = tuple(int(n) for n in reversed(dims)) or (1,)
            columns = shape[-1]
            rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
            if columns % block:
                raise GGUFError(f"{name_of_file}: tensor {name} has {columns} columns, not whole {qtype.name} blocks")
            row_bytes = columns // block * block_bytes
            start = self.data_start + offset
            if start + rows * row_bytes > size:
                raise GGUFError(f"{name_of_file} is truncated: tensor {name} ends past the end of the file")
            rows_data = data[start : start + rows * row_bytes].reshape(rows, row_bytes)
            out.append(GGUFTensor(name, qtype.name, int(type_id), shape, rows_data, start, part))
        return out


def _whole(part: _Part, key: str, default: int) -> int:
    """A split field: a whole number, or a clear error naming the file."""
    value = part.fields.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFError(f"{part.path.name} has a wrong {key} ({value!r})")
    return value


def _all_parts(given: _Part, count: int) -> list[_Part]:
    """Every part of the split model ``given`` is a part of, found beside it by name, first part first."""
    number = given.split_number()
    names = part_names(given.path)
    if names is None or len(names) != count or not 1 <= number <= count or names[number - 1] != given.path:
        raise GGUFError(
            f"{given.path.name} is part {number} of a model split in {count} files, but its name is not that "
            f"part's (NAME-{number:05d}-of-{count:05d}.gguf), so the other parts cannot be found; keep the "
            "names they were downloaded with"
        )
    parts = []
    for index, name in enumerate(names, start=1):
        if name == given.path:
            parts.append(given)
            continue
        if not name.exists():
            raise GGUFError(
                f"{given.path.name} is one of the {count} parts of a split model, and part {index} "
                f"({name.name}) is not beside it; download every part"
            )
        part = _Part.open(name)
        if (part.split_number(), part.split_count()) != (index, count):
            raise GGUFError(
                f"{name.name} is not part {index} of {count} of the model in {given.path.name} (its metadata "
                f"says part {part.split_number()} of {part.split_count()})"
            )
        parts.append(part)
    return parts


class GGUFModelFile:
    """An open GGUF file: metadata, model config and tensors by name (nothing read until asked).

    Why our own header reader: the `gguf` package's reader builds a numpy object for every
    vocabulary entry, which costs seconds and hundreds of MB for a 128k vocabulary; we need the
    model's numbers and the tensor table only (the tokenizer is built from the file separately).
    """

    def __init__(self, path: Path | str) -> None:
        given = Path(path)
        first = _Part.open(given)
        count = first.split_count()
        parts = [first] if count == 1 else _all_parts(first, count)
        self.path = parts[0].path  # the part with the metadata (a split model may be named by any part)
        self._fields = parts[0].fields
        self._maps = [part.buf for part in parts]
        self.tensors: dict[str, GGUFTensor] = {}
        for index, part in enumerate(parts):
            for tensor in part.tensors(index):
                if tensor.name in self.tensors:
                    raise GGUFError(f"{part.path.name}: tensor {tensor.name} is in two parts of the model")
                self.tensors[tensor.name] = tensor
        if count > 1 and len(self.tensors) != _whole(parts[0], SPLIT_TENSORS_KEY, len(self.tensors)):
            raise GGUFError(
                f"the {count} parts of {self.path.name} hold {len(self.tensors)} tensors, but its metadata "
                f"says {parts[0].fields[SPLIT_TENSORS_KEY]}"
            )
        self.architecture = str(self.field("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key)
        return default if value is None or value is _SKIPPED else value

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name} lacks tensor {name}") from None

    def release(self, tensor: GGUFTensor, rows: slice = slice(None)) -> None:
        """Drop a tensor's pages (or some rows' pages) from this process's memory once used.

        The file stays mapped (and in the page cache); only our resident set shrinks, so
        loading never holds the file and its packed copy at once.
        """
        mm = self._maps[tensor.part]
        if not hasattr(mm, "madvise"):
            return
        first, last, _ = rows.indices(tensor.data.shape[0])
        row_bytes = tensor.data.shape[1]
        page = mmap.PAGESIZE
        start = (tensor.offset + first * row_bytes) // page * page
        end = min(len(mm), tensor.offset + last * row_bytes)
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
                f"it runs {', '.join(GGUF_ARCHITECTURES)}"
            )
        try:
            config = self._model_config(arch)
            self._check_sizes(config)
        except UnsupportedModelError:
            raise
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            raise GGUFError(f"{self.path.name} has incomplete or wrong model metadata ({exc})") from exc
        return config

    def _check_sizes(self, mc: ModelConfig) -> None:
        """The metadata's sizes against each other and the file's tensors, before anything is sized from
        them: a zero, a negative or an absurd count (a corrupt or hand-edited file) is named here, where it
        would otherwise divide by zero, or size a KV cache of terabytes, deep in the engine."""
        check_sizes(mc)
        embed = self.tensor("token_embd.weight")
        if mc.vocab_size > embed.shape[0]:
            raise ValueError(f"the vocabulary size is {mc.vocab_size}, more than token_embd.weight's rows")
        if embed.shape[-1] != mc.hidden_size:
            raise ValueError(
                f"the embedding length is {mc.hidden_size} but token_embd.weight has {embed.shape[-1]} columns"
            )
        if not any(name.startswith(f"blk.{mc.num_layers - 1}.") for name in self.tensors):
            raise ValueError(
                f"the block count is {mc.num_layers} but the file holds no tensors of block {mc.num_layers - 1}"
            )

    def _required(self, key: str) -> Any:
        value = self.arch_field(key)
        if value is None:
            raise KeyError(f"{self.architecture}.{key} is missing")
        return value

    def _count(self, key: str) -> int:
        """A required size: a whole number of at least 1 (the others divide by it)."""
        value = int(self._required(key))
        if value < 1:
            raise ValueError(f"{self.architecture}.{key} is {value}")
        return value

    def _model_config(self, arch: str) -> ModelConfig:
        hidden = self._count("embedding_length")
        heads = self._count("attention.head_count")
        kv_heads = self.arch_field("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts (some newer files): ours must be uniform
            if len(set(kv_heads)) != 1:
                raise UnsupportedModelError("per-layer KV head counts are not supported")
            kv_heads = kv_heads[0]
        embed = self.tensor("token_embd.weight")
        vocab = int(self.arch_field("vocab_size", embed.shape[0]))
        head_dim = int(self.arch_field("attention.key_length", hidden // heads))
        eos = {
            int(self.field(key))
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if self.field(key) is not None
        }
        bos = self.field("tokenizer.ggml.bos_token_id")
        max_len = int(self.arch_field("context_length", 4096))
        window = self.arch_field("attention.sliding_window")
        layers = self._count("block_count")
        # Phi-3's window covers every layer (as config.py's _WINDOWED); Gemma's only the local ones.
        all_local: dict[str, Any] = {}
        if window and arch == "Phi3ForCausalLM" and int(window) < max_len:
            all_local = {"sliding_window": int(window), "local_layers": (True,) * layers}
        if arch == "SmolLM3ForCausalLM":  # llama.cpp's fixed rule: every 4th layer has no RoPE
            all_local = {"nope_layers": tuple((i + 1) % 4 == 0 for i in range(layers))}
        rotary_dim = int(self.arch_field("rope.dimension_count", head_dim))
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._count("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=max_len,
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            eos_token_ids=frozenset(eos),
            bos_token_id=None if bos is None else int(bos),
            checkpoint_dtype=None,
            partial_rotary_factor=rotary_dim / head_dim,
            **self._gemma_fields(hidden, heads, head_dim),
            **all_local,
        )

    def _gemma_fields(self, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        every = _GEMMA_GLOBAL_EVERY.get(self.architecture)
        if every is None:
            return {}
        layers = int(self._required("block_count"))
        # As llama.cpp: the 27B models scale queries by hidden / heads, the others by the head size.
        scalar = hidden // heads if layers in (46, 62) else head_dim
        return {
            "sliding_window": int(self._required("attention.sliding_window")),
            "local_layers": tuple((i + 1) % every != 0 for i in range(layers)),
            "local_rope_theta": 10000.0 if self.architecture == "gemma3" else None,
            "query_pre_attn_scalar": float(scalar),
            **{key: optional_float(self.arch_field(key)) for key in SOFTCAP_FIELDS},
        }

    def _float_values(self, name: str) -> tuple[float, ...]:
        tensor = self.tensor(name)
        if tensor.type_name != "F32":
            raise GGUFError(f"tensor {name} is {tensor.type_name}, expected F32")
        import numpy as np

        return tuple(float(f) for f in tensor.data.reshape(-1).view(np.float32))

    def _rope_scaling(self) -> dict[str, Any] | None:
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE: the converter stored both factor sets
            original = int(self._required("rope.scaling.original_context_length"))
            return {
                "rope_type": "longrope",
                "short_factor": self._float_values("rope_factors_short.weight"),
                "long_factor": self._float_values("rope_factors_long.weight"),
                "original_max_position_embeddings": original,
                "factor": int(self.arch_field("context_length", original)) / original,
                "attention_factor": self.arch_field("rope.scaling.attn_factor"),
            }
        if "rope_freqs.weight" in self.tensors:  # Llama 3.1+: the converter stored the frequency factors
            import numpy as np

            factors = self.tensor("rope_freqs.weight").data.reshape(-1).view(np.float32)
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
        kind = self.arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = float(self.arch_field("rope.scaling.factor", 1.0))
        if kind == "yarn":  # Qwen's long-context setting, as its converter writes it
            scaling: dict[str, Any] = {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": int(self._required("rope.scaling.original_context_length")),
            }
            for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                if self.arch_field(f"rope.scaling.{key}") is not None:
                    scaling[ours] = float(self.arch_field(f"rope.scaling.{key}"))
            return scaling
        if kind != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
        return {"rope_type": "linear", "factor": factor}
