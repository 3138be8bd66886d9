"""Prompts to token ids, with chat rendering that keeps multi-turn prefix hits.

A follow-up turn re-renders the whole conversation through the chat template.
Re-tokenising an earlier answer's *text* can give different ids than the ones
the model generated (BPE has many spellings of one string), which breaks the
prefix cache for every block after it. So the tokenizer remembers the ids it
generated for each answer text and splices them back in when that answer comes
back as history.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

from chatapp.engine.model_ref import is_gguf_path

_ROLES = ("system", "developer", "user", "assistant")
_REMEMBERED = 4096


class ChatFormatError(ValueError):
    """A conversation that cannot be rendered (bad role, bad content, no template)."""


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Check OpenAI-style messages and flatten text parts; raise ChatFormatError clearly."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatFormatError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def gguf_tokenizer_cache(gguf: Path) -> Path:
    """Where the tokenizer of a GGUF file is kept once built (keyed on the file's path, size and time)."""
    from chatapp import paths

    st = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    return paths.cache_dir() / "tokenizers" / f"{gguf.stem}-{key}"


def load_hf_tokenizer(path: Path):
    """A model directory's tokenizer, or a GGUF file's (built by transformers once, then cached).

    Why a cache: building a tokenizer from a GGUF file parses its whole vocabulary (seconds for
    a 128k one); the saved files load in a fraction of that. Only the tokenizer is kept: weights
    are always read from the file itself.
    """
    from transformers import AutoTokenizer  # here, not at import: clients load it while the engine starts

    if not is_gguf_path(path):
        return AutoTokenizer.from_pretrained(str(path))
    cache = gguf_tokenizer_cache(path)
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache or a lost race: the tokenizer in hand still works
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


class Tokenizer:
    """The model's Hugging Face tokenizer plus our chat rendering."""

    def __init__(self, model_path: Path | str) -> None:
        self.hf = load_hf_tokenizer(Path(model_path))
        self._generated: OrderedDict[str, list[int]] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, reusing the exact ids of answers we generated."""
        messages = normalize_messages(messages)
        if not self.hf.chat_template:
            raise ChatFormatError("this model has no chat template; use a plain completion prompt")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
            raise ChatFormatError(f"the model's chat template rejected the conversation: {exc}") from exc
        ids: list[int] = []
        pos = 0
        for message in messages:
            remembered = self._generated.get(message["content"]) if message["role"] == "assistant" else None
            if not remembered or not message["content"]:
                continue
            at = text.find(message["content"], pos)
            if at == -1:
                continue
            ids += self._encode_piece(text[pos:at]) + remembered
            self._generated.move_to_end(message["content"])
            pos = at + len(message["content"])
        return ids + self._encode_piece(text[pos:])

    def _encode_piece(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False) if text else []

    def remember_output(self, text: str, token_ids: list[int]) -> None:
        """Remember the ids of a finished answer whose tokens decode exactly to ``text``."""
        if not text:
            return
        ids = list(token_ids)
        while ids and self.decode(ids[-1:]) == "":  # a trailing end-of-turn token is not content
            ids.pop()
        if self.decode(ids) != text:
            return
        self._generated[text] = ids
        self._generated.move_to_end(text)
        while len(self._generated) > _REMEMBERED:
            self._generated.popitem(last=False)
