"""Incremental detokenisation with stop strings.

A token may end in the middle of a multi-byte character (emoji, CJK split by
byte-level BPE). Decoding a short window of recent tokens and holding back
text that ends in U+FFFD means the stream never shows half a character, and
the streamed pieces add up to the full decode. Text that could still become a
stop string is held back too, so a stop string is never shown.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5  # earlier tokens decoded with the new ones, for context-dependent spacing


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (cut at a stop string)
        self._emitted = 0
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip)
        return text

    def add_tokens(self, token_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the text that may be shown now."""
        for token_id in token_ids:
            if self.stop_reason is not None:
                break
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full = self._decode(self._ids[self._prefix :])
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                self._append(full[len(prefix_text) :])
                self._prefix, self._read = self._read, len(self._ids)
        if finished and self.stop_reason is None:
            # Flush what was waiting for more bytes; drop a dangling partial character.
            rest = self._decode(self._ids[self._prefix :])[len(self._decode(self._ids[self._prefix : self._read])) :]
            self._append(rest.rstrip("\ufffd"))
        return self._take(finished or self.stop_reason is not None)

    def _append(self, new_text: str) -> None:
        start = max(0, len(self.text) - self._holdback)
        self.text += new_text
        for stop in self._stop:  # each cut shortens the text, so the earliest stop wins
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[:at]
                self.stop_reason = stop

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
