"""Turning a batch of logits into next tokens, each row with its own parameters.

Everything is batched except what is per-request by nature: logit bias,
penalties (they need the request's token history), grammar masks (guided
decoding: each row's own matcher state) and seeded noise (each seeded request
draws from its own generator, so a seed repeats exactly whatever else shares
the batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.request import Request

# SamplerOutput and samples_without_history stay importable from here (the engine's modules do).
from chatapp.engine.sampling_rules import SamplerOutput as SamplerOutput
from chatapp.engine.sampling_rules import plain_greedy, token_positions
from chatapp.engine.sampling_rules import samples_without_history as samples_without_history

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher


class Sampler:
    def __init__(self) -> None:
        self._grammar_masks = GrammarMasks()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row of ``logits`` [S, V] for ``requests`` (same order)."""
        if all(plain_greedy(r) for r in requests):
            # The common case of a GPU decode step, in one kernel: widening to float32 is exact,
            # so the half-precision argmax is the same token (ties too: the first maximum).
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        token_list = self._choose(logits, requests).tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            logprobs = [
                _token_logprobs(raw_logprobs[i], token_list[i], r.params.logprobs) for i, r in enumerate(requests)
            ]
        return SamplerOutput(token_list, logprobs)

    def device_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The same tokens as ``__call__``, left on the logits' device (nothing waits for them), for
        requests that all pass :func:`samples_without_history`."""
        assert all(samples_without_history(r) for r in requests)
        if all(plain_greedy(r) for r in requests):
            return logits.argmax(dim=-1)
        return self._choose(logits.float(), requests)

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's token from float32 ``logits`` (changed in place by bias, penalties and masks)."""
        for i, req in enumerate(requests):
            params = req.params
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), device=logits.device)
                ids = ids[ids < logits.shape[1]]
                bias = torch.tensor([params.logit_bias[int(t)] for t in ids], device=logits.device)
                logits[i, ids] += bias
            if params.uses_penalties:
                _apply_penalties(logits[i], req)
        guided = [(req.matcher, i) for i, req in enumerate(requests) if req.matcher is not None]
        if guided:
            self._grammar_masks.apply(logits, guided)

        greedy_tokens = logits.argmax(dim=-1)
        if all(r.params.greedy for r in requests):
            return greedy_tokens
        return torch.where(
            self._greedy_mask(requests, logits.device), greedy_tokens, self._sample_random(logits, requests)
        )

    @staticmethod
    def _greedy_mask(requests: list[Request], device: torch.device) -> torch.Tensor:
        return torch.tensor([r.params.greedy for r in requests], device=device)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
        vocab = logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a CDF search.
        noise = torch.empty_like(probs).exponential_()
        for i, req in enumerate(requests):
            if req.params.seed is not None:
                # Made at first use (Request holds no torch), and again when the held one is another
                # device's or the numpy sampler's.
                if not isinstance(req.generator, torch.Generator) or req.generator.device != device:
                    req.generator = torch.Generator(device=device).manual_seed(req.params.seed)
                noise[i].exponential_(generator=req.generator)
        return (probs / noise).argmax(dim=-1)


class GrammarMasks:
    """Guided rows' token masks, computed by llguidance on its own threads (one row per thread), then
    applied to those rows only: free requests in the same batch are untouched."""

    def __init__(self) -> None:
        self._executor: LLExecutor | None = None

    def apply(self, logits: torch.Tensor, guided: list[tuple[LLMatcher, int]]) -> None:
        import llguidance
        import llguidance.torch as llt

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        vocab = logits.shape[1]
        masks = llt.allocate_token_bitmask(len(guided), vocab)
        llt.fill_next_token_bitmask_par(self._executor, [(m, j) for j, (m, _i) in enumerate(guided)], masks)
        rows = [i for _m, i in guided]
        whole = rows == list(range(logits.shape[0]))
        sub = logits if whole else logits.index_select(0, torch.tensor(rows, device=logits.device))
        _mask_out(sub, masks.numpy())
        if not whole:
            logits.index_copy_(0, torch.tensor(rows, device=logits.device), sub)


def _mask_out(logits: torch.Tensor, allowed: np.ndarray) -> None:
    """logits[t] = -inf for every token t whose bit is clear in the row's int32 words ``allowed``.

    Only words that are not all-allowed (or, when most tokens are blocked, not all-blocked) are
    looked at: in a JSON string nearly every word is all-allowed, between fields nearly every word
    is all-blocked, and a masked fill over 16 x 49k logits took ~1.6 ms here."""
    vocab = logits.shape[1]
    allowed = allowed.astype(np.int32, copy=False)
    if not logits.is_contiguous():
        blocked = np.unpackbits((~allowed).view(np.uint8), axis=-1, bitorder="little")[:, :vocab].view(bool)
        logits.masked_fill_(torch.from_numpy(blocked).to(logits.device), float("-inf"))
        return
    flat = logits.view(-1)
    partly_blocked = np.flatnonzero(allowed.reshape(-1) != -1)
    if len(partly_blocked) <= allowed.size // 2:
        at = token_positions(~allowed, partly_blocked, vocab)
        flat[torch.from_numpy(at).to(logits.device)] = float("-inf")
        return
    kept = torch.from_numpy(token_positions(allowed, np.flatnonzero(allowed.reshape(-1) != 0), vocab))
    kept = kept.to(logits.device)
    keep = flat[kept]
    flat.fill_(float("-inf"))
    flat[kept] = keep


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
    remove |= before >= top_p[:, None]
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """Repetition penalty (HF: prompt and output) and OpenAI presence/frequency (output only)."""
    params = req.params
    vocab = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), device=row.device, dtype=torch.long)
        seen = seen[seen < vocab]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        output = torch.tensor(req.output_token_ids, device=row.device, dtype=torch.long)
        if output.numel():
            counts = torch.bincount(output[output < vocab], minlength=vocab).to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _token_logprobs(logprobs_row: torch.Tensor, token: int, top_n: int | None) -> TokenLogprobs | None:
    if top_n is None:
        return None
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = logprobs_row.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(logprobs_row[token]), top)
