"""A GGUF file's byte-level BPE tokenizer built with the `tokenizers` library alone (and written as tokenizer.json).

Why: a GGUF file carries its tokenizer as metadata (vocabulary, merges, token types), and its
tokenizer.json has to be built once, on its first start. transformers builds it in ~1.2 s, most of
it importing transformers; the start waits for that. The byte-level BPE kind ("gpt2" in the file:
SmolLM, Llama 3, Qwen 2 and 3) is a vocabulary, merges, a split rule and a byte alphabet, which this
module builds directly in ~0.1 s. Every other kind (SentencePiece, unigram), and a byte-level file
whose split rule (`tokenizer.ggml.pre`) is not one named here, is left to transformers.

The files match transformers' build of the same GGUF file field for field, but for one token
transformers invents (see _backend); tests/test_tokenizer.py compares the two on the bundled model and
on variants of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from chatapp.engine.models.gguf_file import read_tokenizer_metadata

# Token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# How text is split into words before the merges run, by `tokenizer.ggml.pre`: the regex each
# family's merges were learned with. Split rules not named here and not in _GPT2_SPLIT_PRES are left to
# transformers, which knows more families.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_SPLIT_PRES = frozenset({"", "default", "gpt-2", "gpt2", "smollm"})
"""Split rules that are GPT-2's own (the byte-level pre-tokenizer's built-in regex)."""

GPT2_END_OF_TEXT = "<|endoftext|>"

_NAMED_SPECIAL = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves, the
    other 68 (controls, space, soft hyphen...) take the code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 256
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(extra)
            extra += 1
    return spelling


@dataclass(frozen=True)
class ByteLevelTokenizer:
    """A byte-level BPE GGUF file's tokenizer as built in memory: the `tokenizers` object, the
    tokenizer_config.json fields and the chat template (None when the file has none)."""

    backend: Any
    config: dict[str, Any]
    chat_template: str | None

    def write(self, out: Path) -> None:
        """tokenizer.json, tokenizer_config.json (and chat_template.jinja) into ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps(self.config, indent=2, ensure_ascii=False), encoding="utf-8"
        )
        if self.chat_template:
            (out / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")


KIND_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")
"""The metadata is_byte_level_bpe reads (read_tokenizer_metadata's `until`: they precede the vocabulary)."""


def is_byte_level_bpe(fields: dict[str, Any]) -> bool:
    """Whether a file's metadata names a tokenizer this module builds: byte-level BPE with a split rule
    it knows (the rest go to transformers); the fields of KIND_KEYS are enough."""
    pre = fields.get("tokenizer.ggml.pre") or ""
    return fields.get("tokenizer.ggml.model") == "gpt2" and (pre in _SPLITS or pre in _GPT2_SPLIT_PRES)


def build_byte_level_tokenizer(gguf_path: Path) -> ByteLevelTokenizer | None:
    """A byte-level BPE GGUF file's tokenizer, built from its metadata; None when it is of another kind
    (or its metadata is not what this module takes: transformers then builds it, or says what is wrong)."""
    fields = read_tokenizer_metadata(gguf_path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    if not is_byte_level_bpe(fields):
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    merges = fields.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        return None
    named = {name: _token_at(tokens, fields.get(key)) for name, key in _NAMED_SPECIAL.items()}
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and named["bos_token"] is None) or (add_eos and named["eos_token"] is None):
        return None
    pre = fields.get("tokenizer.ggml.pre") or ""
    try:
        backend = _backend(tokens, merges, fields.get("tokenizer.ggml.token_type") or [], pre, named)
        backend.post_processor = _post_processor(named, add_bos, add_eos, backend)
    except Exception:  # e.g. a merge naming a token the vocabulary lacks: transformers says what is wrong
        return None
    template = fields.get("tokenizer.chat_template")
    return ByteLevelTokenizer(
        backend,
        {"tokenizer_class": "PreTrainedTokenizerFast", **named},
        template if isinstance(template, str) and template else None,
    )


def write_byte_level_tokenizer(gguf_path: Path, out: Path) -> bool:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) for a byte-level BPE GGUF
    file into ``out``; False, writing nothing, when the file's tokenizer is of another kind."""
    built = build_byte_level_tokenizer(gguf_path)
    if built is None:
        return False
    built.write(out)
    return True


def _token_at(tokens: list[str], index: Any) -> str | None:
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _backend(tokens: list[str], merges: list[str], types: list[int], pre: str, named: dict[str, str | None]) -> Any:
    """The BPE model, split rule, byte-level decoder and added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written in plain UTF-8 (some converters' added tokens) is spelled in the byte alphabet.
    # Most files have none: one check over all of them, then no per-token test (~2x less time).
    if set("".join(tokens)) <= alphabet:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, right = merge.split(" ")  # a merge of other than two parts: ValueError (left to transformers)
        pairs.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix=""))
    split = _SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens are special (kept whole, skipped when decoding without special tokens), as are
    # the named ones; a control token outside the byte alphabet is a converter's mislabel and would
    # grow the vocabulary past the model's, so it is left out. User-defined ones (e.g. <think>) are
    # kept whole but are not special.
    special = [t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    special += [t for t in named.values() if t is not None and t not in special]
    # transformers' byte-level tokenizer class takes GPT-2's <|endoftext|> as its default special token,
    # so its build makes it special whatever the file says. Where the vocabulary lacks it (Llama 3),
    # transformers adds it as one id past the model's vocabulary; we do not add a token the model has
    # no embedding for (the one difference from its files; tests/test_tokenizer.py shows it).
    if GPT2_END_OF_TEXT in vocab and GPT2_END_OF_TEXT not in special:
        special.append(GPT2_END_OF_TEXT)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user_defined = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    return backend


def _post_processor(named: dict[str, str | None], add_bos: bool, add_eos: bool, backend: Any) -> Any:
    """BOS and/or EOS around each sequence as the file asks (`add_bos_token`, `add_eos_token`)."""
    from tokenizers import processors

    def around(seq: str, type_id: int) -> list[str]:
        parts = [f"{seq}:{type_id}"]
        if add_bos:
            parts.insert(0, f"{named['bos_token']}:{type_id}")
        if add_eos:
            parts.append(f"{named['eos_token']}:{type_id}")
        return parts

    specials = [t for t, wanted in ((named["bos_token"], add_bos), (named["eos_token"], add_eos)) if wanted]
    return processors.TemplateProcessing(
        single=around("$A", 0),
        pair=around("$A", 0) + around("$B", 1),
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(specials) if t is not None],
    )
