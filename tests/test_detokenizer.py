"""Streamed text equals the full decode and never shows half a character."""

from __future__ import annotations

import pytest

from chatapp.engine.detokenizer import IncrementalDetokenizer
from chatapp.engine.tokenizer import Tokenizer
from chatapp.store import resolve_model

TEXTS = [
    "Hello 👋 world! 🎉🎉 Family: 👨‍👩‍👧‍👦 done.",
    "日本語のテキストと中文字符，还有한국어도 있습니다。",
    "Mixed: café naïve — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and\nnew lines\ttabs.",
    "  leading spaces and a trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    assert (
        any(len(tokenizer.decode([i]).encode()) == 0 or "\ufffd" in tokenizer.decode([i]) for i in ids)
        or text.isascii()
    )  # the non-ASCII texts really do split characters across tokens
    detok = IncrementalDetokenizer(tokenizer.hf, prompt)
    pieces = [detok.add_tokens([i], finished=(n == len(ids) - 1)) for n, i in enumerate(ids)]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_never_shown_even_across_tokens(tokenizer: Tokenizer) -> None:
    text = "alpha beta STOP gamma"
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.hf, [], stop=("STOP",))
    shown = ""
    for i in ids:
        shown += detok.add_tokens([i], finished=False)
        assert "ST" not in shown.replace("STOP", "")[len("alpha beta") :] or detok.stop_reason
        if detok.stop_reason:
            break
    assert detok.stop_reason == "STOP"
    assert shown == "alpha beta " and detok.text == "alpha beta "


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.hf, [], stop=("four", "two"))
    out = "".join(detok.add_tokens([i], finished=False) for i in ids)
    assert detok.text == "one " and detok.stop_reason == "two" and out == "one "


def test_dangling_partial_character_is_dropped_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode("ok 🎉", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte-token never arrives
    detok = IncrementalDetokenizer(tokenizer.hf, [])
    out = "".join(detok.add_tokens([i], finished=(n == len(cut) - 1)) for n, i in enumerate(cut))
    assert "\ufffd" not in out and out.startswith("ok")
