"""Shared pieces of the benchmarks: deterministic prompts and a timer."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

_WORDS = (
    "the model engine token cache block prefix request batch memory thread kernel river mountain "
    "library window garden market signal story number letter bridge planet engineer music paper "
    "quiet bright ancient rapid gentle careful strange simple heavy golden silver modern hidden "
    "builds reads writes moves finds keeps opens closes carries measures follows explains changes"
).split()


def make_text(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return " ".join(sentences)


def prompt_of_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Token ids of a prompt of exactly ``num_tokens`` tokens of plain English-like text."""
    ids = tokenizer.encode(make_text(num_tokens, seed))
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + make_text(num_tokens, seed + 1000))
    return ids[:num_tokens]


def conversation(num_tokens: int, tokenizer, seed: int = 0) -> list[dict[str, str]]:
    """A multi-turn chat whose rendered history is about ``num_tokens`` tokens."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    turn = 0
    while len(tokenizer.render_chat(messages + [{"role": "user", "content": "x"}])) < num_tokens:
        messages.append({"role": "user", "content": f"Question {turn}: " + make_text(60, seed + turn)})
        messages.append({"role": "assistant", "content": make_text(90, seed + 500 + turn)})
        turn += 1
    return messages


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result
