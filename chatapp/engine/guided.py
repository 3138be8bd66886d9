"""Guided decoding: a request's output held to a grammar (JSON Schema, any JSON object, a regex,
a list of choices, or a Lark grammar), applied as a token mask in the batched sampler.

Why llguidance: it has no dependencies (one Rust wheel), compiles a grammar lazily (a typical tool
schema takes ~1 ms to turn into a matcher with the bundled model's tokenizer, so there is no ahead-of-time
compile to cache or wait for) and computes a 49k-token mask in ~1 ms on this CPU; vLLM and
SGLang ship it as a backend. xgrammar, the other candidate, pulls triton and a TVM runtime and
compiles each grammar up front (its strength on GPUs, where masks must come out in microseconds).

The spec (``GuidedDecoding``) travels with SamplingParams; the engine process turns it into an
llguidance matcher (``GrammarCompiler``) off its loop, and the request carries the matcher: the
sampler masks the request's logits row with it, and each sampled token advances it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions

_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_CACHED_GRAMMARS = 64
# JSON on one line as json.dumps writes it: free whitespace lets small models run on in newlines.
_JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedDecodingError(ValueError):
    """A guided-decoding spec that cannot be compiled; the message names the problem."""


@dataclass(frozen=True)
class GuidedDecoding:
    """Exactly one of: a JSON Schema (dict, or its JSON text), any JSON object, a regex, a list of
    choices (the output is one of them, verbatim), or a Lark grammar (llguidance's dialect)."""

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided decoding takes exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            object.__setattr__(self, "json_schema", schema)
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError("json_schema must be a JSON object (a dict)")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    def to_wire(self) -> dict[str, Any]:
        """The spec for IPC; a schema as JSON text (msgpack cannot carry integers past 64 bits)."""
        wire = {k: getattr(self, k) for k in _KINDS if getattr(self, k) not in (None, False)}
        if self.json_schema is not None:
            wire["json_schema"] = json.dumps(self.json_schema)
        return wire

    @property
    def key(self) -> str:
        """One string per distinct spec, for the compiled-grammar cache."""
        return json.dumps({k: getattr(self, k) for k in _KINDS}, sort_keys=True)

    def llguidance_grammar(self) -> str:
        """The spec in llguidance's grammar format (no tokenizer needed)."""
        from llguidance import LLMatcher

        if self.json_schema is not None or self.json_object:
            # JSON on one line, items as ", " and keys as ": " (a schema's own x-guidance may say
            # otherwise): free whitespace lets small models run on in newlines until max_tokens.
            schema = self.json_schema if self.json_schema is not None else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark string literals
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None  # __post_init__: exactly one kind is given
        return LLMatcher.grammar_from_lark(self.grammar)

    def check(self) -> None:
        """Raise GuidedDecodingError if the grammar cannot compile (a bad schema, regex or grammar).

        Needs no tokenizer, so a server can refuse a request (400) before it reaches the engine.
        """
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.llguidance_grammar())
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if error:
            raise GuidedDecodingError(f"invalid {self._kind()}: {error}")

    def _kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False)).replace("_", " ")


class GrammarCompiler:
    """One per model: llguidance's view of the tokenizer (built once, ~0.4 s, on first use) and an
    LRU of matchers in their start state, copied for each request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # compiles run on a worker thread

    def matcher(self, spec: GuidedDecoding) -> LLMatcher:
        """A fresh llguidance matcher for ``spec``; raises GuidedDecodingError for a bad spec."""
        from llguidance import LLMatcher, LLTokenizer

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos)
            start = self._cache.get(spec.key)
            if start is None:
                try:
                    start = LLMatcher(self._tokenizer, spec.llguidance_grammar())
                except (ValueError, TypeError) as exc:
                    raise GuidedDecodingError(f"invalid {spec._kind()}: {exc}") from None
                if start.is_error():
                    raise GuidedDecodingError(f"invalid {spec._kind()}: {start.get_error()}")
                self._cache[spec.key] = start
                while len(self._cache) > _CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec.key)
            return start.deep_copy()


class GrammarWorker:
    """Compiles requests' grammars on one worker thread, so that the engine loop never waits on a
    compile (or on the tokenizer's first conversion); the compiler is made on first use."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def submit(self, spec: GuidedDecoding) -> Future[LLMatcher]:
        """A future of the matcher (its exception: GuidedDecodingError for a bad spec)."""
        return self._pool.submit(self._compile, spec)

    def _compile(self, spec: GuidedDecoding) -> LLMatcher:
        if self._compiler is None:
            from chatapp.engine.tokenizer import Tokenizer

            tokenizer_json = Tokenizer(self._model_path).hf.backend.to_str()
            self._compiler = GrammarCompiler(tokenizer_json, self._vocab_size, self._eos)
        return self._compiler.matcher(spec)
