"""Engine logprobs -> OpenAI's two logprob shapes (chat's ``content`` list, completions' legacy columns).

A token's text is its own decoding (special tokens included), and ``bytes``
is that text's UTF-8; for a token that is only part of a multi-byte character
this is U+FFFD's bytes, not the raw byte.
"""

from __future__ import annotations

from typing import Any

from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def without_end_of_turn(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], stopped: bool
) -> tuple[list[int], list[TokenLogprobs]]:
    """An answer that stopped on its end-of-turn token (a special token) without it: OpenAI never
    returns that token, whose text the answer does not hold either."""
    if stopped and token_ids and logprobs and len(logprobs) == len(token_ids):
        last = token_ids[-1]
        if tokenizer.decode([last], skip_special_tokens=True) == "" and _text(tokenizer, last):
            return token_ids[:-1], logprobs[:-1]
    return token_ids, logprobs


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int
) -> list[dict[str, Any]]:
    """The ``choices[i].logprobs.content`` entries for these tokens."""
    out = []
    for token_id, lp in zip(token_ids, logprobs):
        text = _text(tokenizer, token_id)
        top = []
        for alt_id, alt_lp in lp.top[:top_n]:
            alt = _text(tokenizer, alt_id)
            top.append({"token": alt, "logprob": alt_lp, "bytes": list(alt.encode())})
        out.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return out


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int, text_offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` columns, and the next offset."""
    cols: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(token_ids, logprobs):
        text = _text(tokenizer, token_id)
        cols["tokens"].append(text)
        cols["token_logprobs"].append(lp.logprob)
        cols["top_logprobs"].append({_text(tokenizer, a): alp for a, alp in lp.top[:top_n]} if top_n else None)
        cols["text_offset"].append(text_offset)
        text_offset += len(text)
    if not top_n:  # logprobs: 0 asks for no alternatives at all (OpenAI: null, not a list of nulls)
        cols["top_logprobs"] = None
    return cols, text_offset


def echoed_prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None], top_n: int
) -> tuple[dict[str, Any], int]:
    """The prompt's own columns for ``echo``: its first token has no logprob (null), as OpenAI's."""
    cols: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, lp in zip(prompt_ids, prompt_logprobs):
        text = _text(tokenizer, token_id)
        cols["tokens"].append(text)
        cols["token_logprobs"].append(None if lp is None else lp.logprob)
        cols["top_logprobs"].append(None if lp is None else {_text(tokenizer, a): alp for a, alp in lp.top[:top_n]})
        cols["text_offset"].append(offset)
        offset += len(text)
    if not top_n:
        cols["top_logprobs"] = None
    return cols, offset


def join_columns(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two runs of legacy columns as one (the echoed prompt's, then the answer's)."""
    joined = {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "text_offset")}
    tops = (first["top_logprobs"], then["top_logprobs"])
    joined["top_logprobs"] = None if tops == (None, None) else (tops[0] or []) + (tops[1] or [])
    return joined
