"""The sampler's rules that need no torch, shared by the torch Sampler and the numpy ArraySampler.

Kept apart so a torch-free engine (the CPU path that never pays torch's import) can sample and
decide which steps may run ahead with the same definitions as the torch one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chatapp.engine.outputs import TokenLogprobs

if TYPE_CHECKING:
    from chatapp.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def samples_without_history(req: Request) -> bool:
    """Its next token needs neither its earlier tokens nor a reply to the host (no penalties, grammar
    or logprobs), so a step may sample it while the host has yet to read the token before it."""
    p = req.params
    return p.logprobs is None and not p.uses_penalties and req.matcher is None


def plain_greedy(req: Request) -> bool:
    """Greedy with nothing that changes or reports the logits (bias, penalties, grammar, logprobs)."""
    p = req.params
    return p.greedy and p.logprobs is None and not p.logit_bias and not p.uses_penalties and req.matcher is None


def token_positions(words: np.ndarray, at: np.ndarray, vocab: int) -> np.ndarray:
    """Flat [row, token] positions of the set bits of the words at flat word indices ``at``."""
    bits = np.unpackbits(words.reshape(-1)[at].view(np.uint8).reshape(-1, 4), axis=-1, bitorder="little")
    word, bit = np.nonzero(bits)
    per_row = words.shape[1]
    row, column = np.divmod(at[word], per_row)
    token = column * 32 + bit
    keep = token < vocab
    return row[keep] * vocab + token[keep]
