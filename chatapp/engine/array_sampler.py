"""The torch Sampler's twin on numpy arrays, for the torch-free CPU path.

Same rules, row for row (chatapp/engine/sampler.py): logprobs of the raw logits, then logit bias,
penalties and grammar masks, then greedy rows take the argmax and the others go through temperature,
top-k, top-p, min-p and a draw. What differs is only how: a batch here is 1-16 rows, so each sampled
row is worked on its own, over the few tokens that can win (np.argpartition) where top-k or top-p
bounds them, and drawn by inverse CDF (one uniform per row, where torch's exponential race needs
one number per vocabulary entry). A seeded request draws from its own numpy Generator, so it repeats
exactly whatever shares the batch; its stream is numpy's, not torch's, so the two samplers give a
seed different tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.request import Request
from chatapp.engine.sampling_rules import SamplerOutput, plain_greedy, token_positions

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

_NUCLEUS_WINDOW = 1024
"""Most likely tokens looked at first for top-p; a wider window (x8) only when the nucleus fills it."""
_DRAW_BLOCK = 1024  # tokens per block of a draw's first level
_SAMPLE_VALUES = 512  # values in the strided sample _largest takes its threshold from
_SEED_MASK = 2**64 - 1  # torch.manual_seed's reading of a negative seed: the same 64 bits, unsigned


class ArraySampler:
    """``ArraySampler()(logits, requests)``: one token per row of float32 ``logits`` [S, V]."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)  # unseeded requests' draws; ``seed`` is for tests
        self._executor: LLExecutor | None = None

    def __call__(self, logits: np.ndarray, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row of ``logits`` for ``requests`` (same order); ``logits`` may be
        changed in place (bias, penalties, masks)."""
        if all(plain_greedy(r) for r in requests):
            return SamplerOutput(logits.argmax(axis=-1).tolist(), [None] * len(requests))
        logits = logits.astype(np.float32, copy=False)
        # Logprobs are the model's: taken before bias, penalties and masks change the row.
        raw = {i: _log_softmax(logits[i]) for i, r in enumerate(requests) if r.params.logprobs is not None}
        tokens = self._choose(logits, requests)
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for i, row in raw.items():
            logprobs[i] = _scored(row, tokens[i], requests[i].params.logprobs or 0)
        return SamplerOutput(tokens, logprobs)

    def _choose(self, logits: np.ndarray, requests: list[Request]) -> list[int]:
        for i, req in enumerate(requests):
            if req.params.logit_bias:
                _add_bias(logits[i], req.params.logit_bias)
            if req.params.uses_penalties:
                _apply_penalties(logits[i], req)
        guided = [(req.matcher, i) for i, req in enumerate(requests) if req.matcher is not None]
        if guided:
            self._mask_grammar(logits, guided)
        return [
            int(logits[i].argmax()) if r.params.greedy else self._sample_row(logits[i], r)
            for i, r in enumerate(requests)
        ]

    def _mask_grammar(self, logits: np.ndarray, guided: list[tuple[LLMatcher, int]]) -> None:
        """Guided rows' masks from llguidance (its threads, one row each), applied to those rows only."""
        import llguidance
        import llguidance.numpy as lln

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        masks = lln.allocate_token_bitmask(len(guided), logits.shape[1])
        lln.fill_next_token_bitmask_par(self._executor, [(m, j) for j, (m, _i) in enumerate(guided)], masks)
        _mask_out(logits, masks, np.array([i for _m, i in guided]))

    def _sample_row(self, row: np.ndarray, req: Request) -> int:
        """Temperature, top-k, top-p, softmax, min-p, then one draw from the request's stream."""
        p = req.params
        scaled = row / np.float32(p.temperature)
        ids = _candidates(scaled, p.top_k, p.top_p)
        kept = scaled if ids is None else scaled[ids]
        weights = np.exp(kept - kept.max())  # softmax up to its sum: the top token weighs 1
        if p.min_p > 0:
            weights[weights < p.min_p] = 0.0  # prob < min_p * max prob, with max prob's weight 1
        pick = _draw(weights, self._generator(req))
        if pick is None:  # every token blocked (a grammar at a dead end) or NaN logits
            return int(row.argmax())
        return pick if ids is None else int(ids[pick])

    def _generator(self, req: Request) -> np.random.Generator:
        """A seeded request's own stream (made at first use, or again over a torch one), else ours."""
        seed = req.params.seed
        if seed is None:
            return self._rng
        if not isinstance(req.generator, np.random.Generator):
            req.generator = np.random.Generator(np.random.PCG64(seed & _SEED_MASK))
        return req.generator


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    log_total = float(np.log(np.exp(shifted).sum(dtype=np.float64)))
    return np.asarray(shifted - log_total, dtype=np.float32)


def _top_ids(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest values, largest first (ties: lower index first)."""
    if n >= len(values):
        return np.argsort(-values, kind="stable")
    top = _largest(values, n)
    return top[np.argsort(-values[top], kind="stable")]


def _largest(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest values (1 <= n < len), in no set order; of values tied with the n-th largest,
    which are kept is unspecified (as with np.argpartition).

    Why not np.argpartition over the whole row: ~14 ns a value here, 0.7 ms over a 49k vocabulary and 1.9 ms over
    128k, every sampled step of a request with top-k or top-p. A threshold taken from a strided sample of ~512
    values leaves a few hundred candidates (every value at or above it, so the n largest among them when there
    are at least n), found and partitioned in tens of microseconds; a threshold that leaves fewer (or a NaN)
    falls back to the whole row."""
    step = len(values) // _SAMPLE_VALUES
    if step >= 4 and n * 8 < len(values):
        sample = values[::step]
        rank = min(len(sample), 2 * (n // step) + 8)  # ~2x the sample's expected share of the n, and a margin
        threshold = np.partition(sample, len(sample) - rank)[len(sample) - rank]
        candidates = np.flatnonzero(values >= threshold)
        if len(candidates) >= n:
            picked: np.ndarray = candidates[np.argpartition(-values[candidates], n - 1)[:n]]
            return picked
    return np.argpartition(-values, n - 1)[:n]


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """``token``'s logprob under one row of raw ``logits`` [V], with the ``top_n`` most likely
    (prompt logprobs score each prompt token this way)."""
    return _scored(_log_softmax(logits.astype(np.float32, copy=False)), token, top_n)


def _scored(logprobs: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    ids = _top_ids(logprobs, top_n) if top_n > 0 else np.empty(0, dtype=np.int64)
    return TokenLogprobs(float(logprobs[token]), list(zip(ids.tolist(), logprobs[ids].tolist())))


def _add_bias(row: np.ndarray, bias: dict[int, float]) -> None:
    ids = np.fromiter(bias, dtype=np.int64, count=len(bias))
    values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    inside = ids < len(row)  # a bias for a token past the vocabulary is ignored
    row[ids[inside]] += values[inside]


def _apply_penalties(row: np.ndarray, req: Request) -> None:
    """Repetition penalty (HF: prompt and output) and OpenAI presence/frequency (output only)."""
    params = req.params
    vocab = len(row)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.all_token_ids, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab)]
        values = row[seen]
        penalty = np.float32(params.repetition_penalty)
        row[seen] = np.where(values > 0, values / penalty, values * penalty)
    if params.presence_penalty or params.frequency_penalty:
        output = np.asarray(req.output_token_ids, dtype=np.int64)
        ids, counts = np.unique(output[(output >= 0) & (output < vocab)], return_counts=True)
        cost = np.float32(params.frequency_penalty) * counts.astype(np.float32) + np.float32(params.presence_penalty)
        row[ids] -= cost


def _candidates(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray | None:
    """Ids inside the row's top-k and top-p nucleus (in no set order); None when all are.

    As in the torch Sampler: the nucleus is measured on the whole row's softmax (not renormalised
    after top-k), a token goes when the mass ranked above it reaches ``top_p``, and the most likely
    token always stays. Only values are sorted, and first only the top ``_NUCLEUS_WINDOW`` of them (found by
    ``_largest``): over 256k logits an argsort took ~4 ms here (a stable one ~28 ms)."""
    vocab = len(row)
    k = vocab if top_k <= 0 else min(top_k, vocab)
    pool = None if k >= vocab else _largest(row, k)
    if top_p >= 1.0:
        return pool
    values = row if pool is None else row[pool]
    peak = row.max()
    total = np.exp(row - peak).sum(dtype=np.float64)
    width = min(k, _NUCLEUS_WINDOW)
    while True:
        top = values if width >= k else values[_largest(values, width)]
        top = np.sort(top)[::-1]
        above = np.cumsum(np.exp(top - peak), dtype=np.float64) / total
        above[1:] = above[:-1].copy()  # the mass ranked above each token: nondecreasing, so kept is a prefix
        above[0] = 0.0
        kept = max(1, int(np.count_nonzero(above < top_p)))
        if kept < width or width >= k:
            break
        width = min(k, width * 8)
    # The kept tokens are those above the last one's logit, and as many tokens tied with it as fit.
    cut = top[kept - 1]
    if pool is None:
        tied, above_cut = np.flatnonzero(values == cut), np.flatnonzero(values > cut)
    else:
        tied, above_cut = pool[values == cut], pool[values > cut]
    return np.concatenate([above_cut, tied[: kept - len(above_cut)]])


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int | None:
    """Index i drawn with probability weights[i] / sum (inverse CDF); None when nothing weighs.

    In two levels, blocks then a block's tokens: a cumulative sum over 256k weights took ~2 ms
    here, block sums and one block's ~0.1 ms."""
    full = len(weights) // _DRAW_BLOCK * _DRAW_BLOCK
    sums = weights[:full].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if full < len(weights):
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
    cdf = np.cumsum(sums)
    if not cdf[-1] > 0:
        return None
    target = rng.random() * cdf[-1]
    block = _last_with_weight(sums, int(np.searchsorted(cdf, target, side="right")))
    start = block * _DRAW_BLOCK
    local = weights[start : start + _DRAW_BLOCK]
    below = cdf[block - 1] if block else 0.0
    return start + _last_with_weight(
        local, int(np.searchsorted(np.cumsum(local, dtype=np.float64), target - below, side="right"))
    )


def _last_with_weight(weights: np.ndarray, pick: int) -> int:
    """``pick``, or where rounding sent it past the end, the last index that weighs anything."""
    return pick if pick < len(weights) else int(np.flatnonzero(weights)[-1])


def _mask_out(logits: np.ndarray, allowed: np.ndarray, rows: np.ndarray) -> None:
    """logits[rows[j], t] = -inf for every token t whose bit is clear in ``allowed[j]`` (int32 words).

    As the torch Sampler's _mask_out: only words not all-allowed (or, when most are not, only words
    not all-blocked) are unpacked, since masks are mostly whole words of one kind."""
    vocab = logits.shape[1]
    allowed = allowed.astype(np.int32, copy=False)
    partly_blocked = np.flatnonzero(allowed.reshape(-1) != -1)
    if len(partly_blocked) <= allowed.size // 2:
        row, token = np.divmod(token_positions(~allowed, partly_blocked, vocab), vocab)
        logits[rows[row], token] = -np.inf
        return
    row, token = np.divmod(token_positions(allowed, np.flatnonzero(allowed.reshape(-1) != 0), vocab), vocab)
    keep = logits[rows[row], token]
    logits[rows] = -np.inf
    logits[rows[row], token] = keep
