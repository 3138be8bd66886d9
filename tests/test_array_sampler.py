"""ArraySampler (numpy, torch-free) against the torch Sampler: the same tokens and logprobs wherever
the result is deterministic, and draws from the same sets and distributions where it is not."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from chatapp.engine.array_sampler import (
    ArraySampler,
    _apply_penalties,
    _candidates,
    _largest,
    _mask_out,
    token_logprobs,
)
from chatapp.engine.request import Request
from chatapp.engine.sampler import Sampler, _top_k_top_p
from chatapp.engine.sampler import _apply_penalties as _torch_penalties
from chatapp.engine.sampler import _mask_out as _torch_mask_out
from chatapp.engine.sampling_params import SamplingParams


def req(tokens: list[int], output: list[int] = (), **params) -> Request:
    r = Request("r", tokens, SamplingParams(**params), frozenset(), 16, 10_000)
    for t in output:
        r.append_token(t)
    return r


def both(logits: np.ndarray, requests: list[Request], sampler: ArraySampler | None = None):
    """The two samplers' outputs on copies of the same logits."""
    ours = (sampler or ArraySampler())(logits.copy(), requests)
    theirs = Sampler()(torch.from_numpy(logits.copy()), requests)
    return ours, theirs


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draws(logits_row: np.ndarray, n: int, **params) -> np.ndarray:
    """``n`` tokens drawn for one row (as a batch of ``n`` equal rows: every row draws on its own)."""
    rows = np.repeat(logits_row[None].astype(np.float32), n, axis=0)
    return np.array(ArraySampler(seed=1)(rows, [req([1], **params) for _ in range(n)]).token_ids)


# -- greedy ------------------------------------------------------------------------------------


def test_plain_greedy_is_the_argmax_first_maximum_on_ties() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 1000)).astype(np.float32)
    logits[2, [10, 500]] = 9.0  # a tie: the first one wins, as in torch
    ours, theirs = both(logits, [req([1], temperature=0) for _ in range(5)])
    assert ours.token_ids == theirs.token_ids == logits.argmax(-1).tolist()
    assert ours.token_ids[2] == 10 and ours.logprobs == [None] * 5


def test_greedy_with_logit_bias_matches_torch() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    requests = [
        req([1], temperature=0, logit_bias={7: 20.0, 5000: 100.0}),  # an id past the vocabulary is ignored
        req([1], temperature=0, logit_bias={int(logits[1].argmax()): -100.0}),
        req([1], temperature=0),
    ]
    ours, theirs = both(logits, requests)
    assert ours.token_ids == theirs.token_ids
    assert ours.token_ids[0] == 7
    assert ours.token_ids[1] != logits[1].argmax()
    assert ours.token_ids[2] == logits[2].argmax()


# -- penalties ---------------------------------------------------------------------------------

PENALTIES = [
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"frequency_penalty": -0.5, "presence_penalty": 2.0, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalties_change_the_row_as_torch_does(penalties: dict) -> None:
    rng = np.random.default_rng(2)
    row = (rng.standard_normal(200) * 3).astype(np.float32)
    r = req([4, 9, 9, 250], output=[3, 3, 3, 5, 9, 199, 7000], **penalties)  # 250, 7000: past the vocabulary
    expected = torch.from_numpy(row.copy())
    _torch_penalties(expected, r)
    _apply_penalties(row, r)
    np.testing.assert_allclose(row, expected.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalised_greedy_choice_and_logprobs_match_torch(penalties: dict) -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 500)) * 2).astype(np.float32)
    requests = []
    for row in logits:
        top = np.argsort(-row)[:3].tolist()
        requests.append(
            req([top[0], 11], output=[top[0], top[1], top[1], top[0]], temperature=0, logprobs=4, **penalties)
        )
    ours, theirs = both(logits, requests)
    assert ours.token_ids == theirs.token_ids
    if penalties.get("repetition_penalty", 1.0) > 1 or penalties.get("presence_penalty", 0) > 0:
        assert ours.token_ids != logits.argmax(-1).tolist()  # the penalties did move the choice
    for mine, ref in zip(ours.logprobs, theirs.logprobs):
        assert math.isclose(mine.logprob, ref.logprob, abs_tol=1e-5)
        assert [t for t, _ in mine.top] == [t for t, _ in ref.top]
        np.testing.assert_allclose([v for _, v in mine.top], [v for _, v in ref.top], atol=1e-5)


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_the_raw_models_and_top_n_is_torch_topk() -> None:
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((5, 2000)) * 4).astype(np.float32)
    requests = [
        req([1], temperature=0, logprobs=0),
        req([1], temperature=0, logprobs=20, logit_bias={3: 50.0}),  # chosen by the bias, reported raw
        req([1], temperature=0.9, top_p=0.9, logprobs=5),
        req([1], temperature=0),  # no logprobs asked
        req([1], temperature=1.2, top_k=40, logprobs=1, repetition_penalty=1.2),
    ]
    ours, theirs = both(logits, requests)
    assert ours.token_ids[:2] == theirs.token_ids[:2] and ours.token_ids[1] == 3
    assert ours.logprobs[3] is None and theirs.logprobs[3] is None
    raw = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    for i, token in enumerate(ours.token_ids):
        lp = ours.logprobs[i]
        if lp is None:
            continue
        assert math.isclose(lp.logprob, raw[i, token].item(), abs_tol=1e-5)
        n = requests[i].params.logprobs
        values, ids = raw[i].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], values.numpy(), atol=1e-5)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert ours.logprobs[0].top == []


def test_token_logprobs_of_a_raw_row_match_torch() -> None:
    rng = np.random.default_rng(15)
    row = (rng.standard_normal(3000) * 5).astype(np.float32)
    raw = torch.log_softmax(torch.from_numpy(row), dim=-1)
    values, ids = raw.topk(7)
    scored = token_logprobs(row.copy(), 1234, 7)
    assert math.isclose(scored.logprob, raw[1234].item(), abs_tol=1e-5)
    assert [t for t, _ in scored.top] == ids.tolist()
    np.testing.assert_allclose([v for _, v in scored.top], values.numpy(), atol=1e-5)
    assert token_logprobs(row, 5, 0).top == []


# -- top-k, top-p, min-p -----------------------------------------------------------------------


def test_top_k_one_tiny_top_p_and_full_min_p_give_the_argmax() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 5000)).astype(np.float32)
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 1, "top_p": 0.5}):
        requests = [req([1], temperature=1.5, **params) for _ in range(6)]
        ours, theirs = both(logits, requests)
        assert ours.token_ids == theirs.token_ids == logits.argmax(-1).tolist(), params


def nucleus(logits_row: np.ndarray, top_k: int, top_p: float, temperature: float = 1.0) -> set[int]:
    """The tokens the torch Sampler's top-k/top-p rule keeps."""
    scaled = torch.from_numpy(logits_row[None] / np.float32(temperature))
    vocab = logits_row.shape[0]
    kept = _top_k_top_p(scaled, torch.tensor([top_k if top_k > 0 else vocab]), torch.tensor([top_p]))
    return set(torch.isfinite(kept[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "top_k, top_p, temperature",
    [
        (5, 1.0, 2.0),
        (-1, 0.8, 1.0),
        (-1, 0.5, 0.7),
        (20, 0.9, 1.5),
        (3000, 0.95, 1.0),
        (-1, 0.9, 4.0),
        (1500, 0.99, 4.0),
    ],
)
def test_draws_stay_inside_the_top_k_and_the_nucleus(top_k: int, top_p: float, temperature: float) -> None:
    rng = np.random.default_rng(6)
    row = (rng.standard_normal(4000) * 2.5).astype(np.float32)
    inside = nucleus(row, top_k, top_p, temperature)
    # The kept set itself is torch's, nuclei wider than the first window (1024) included.
    assert set(_candidates(row / np.float32(temperature), top_k, top_p).tolist()) == inside
    seen = set(draws(row, 3000, top_k=top_k, top_p=top_p, temperature=temperature).tolist())
    assert seen <= inside
    assert len(seen) >= min(len(inside), 3)


def vocabulary_rows() -> dict[str, np.ndarray]:
    """Rows of a real vocabulary's size: spread logits, few distinct values (ties everywhere), a grammar's mask
    (most tokens at -inf), a NaN among them."""
    rng = np.random.default_rng(8)
    spread = (rng.standard_normal(128_256) * 3).astype(np.float32)
    masked = np.full(49_152, -np.inf, dtype=np.float32)
    masked[rng.choice(49_152, 300, replace=False)] = rng.standard_normal(300).astype(np.float32)
    with_nan = spread[:49_152].copy()
    with_nan[[5, 40_000]] = np.nan
    return {
        "spread": spread,
        "ties": rng.integers(0, 6, 49_152).astype(np.float32),
        "masked": masked,
        "nan": with_nan,
    }


@pytest.mark.parametrize("kind", ["spread", "ties", "masked", "nan"])
def test_the_largest_values_are_argpartitions_whatever_the_row(kind: str) -> None:
    """_largest (a sampled threshold, then a partition of what clears it) keeps the values np.argpartition keeps
    over the whole row, ties and -inf included, for counts from 1 to past a sample's reach."""
    row = vocabulary_rows()[kind]
    for n in (1, 2, 40, 1024, 8192, 20_000):
        got = _largest(row, n)
        assert len(got) == n and len(set(got.tolist())) == n
        expected = np.argpartition(-row, n - 1)[:n]
        assert np.array_equal(np.sort(row[got]), np.sort(row[expected]), equal_nan=True), n


def sorted_nucleus(row: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The top-k/top-p rule by a full sort, in _candidates' own float steps (float32 weights, float64 sums): over
    a 128k row torch's float32 sums can place the last token of a wide nucleus the other way."""
    order = np.argsort(-row, kind="stable")[: top_k if top_k > 0 else len(row)]
    if top_p >= 1.0:
        return set(order.tolist())
    peak = row.max()
    above = np.cumsum(np.exp(row[order] - peak), dtype=np.float64) / np.exp(row - peak).sum(dtype=np.float64)
    kept = max(1, int(np.count_nonzero(np.concatenate([[0.0], above[:-1]]) < top_p)))
    return set(order[:kept].tolist())


@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (40, 0.9), (-1, 0.9), (-1, 0.5), (500, 0.95), (-1, 0.999)])
def test_a_full_vocabularys_nucleus_is_the_sorted_rules(top_k: int, top_p: float) -> None:
    row = vocabulary_rows()["spread"] / np.float32(0.8)
    got, expected = _candidates(row, top_k, top_p), sorted_nucleus(row, top_k, top_p)
    assert len(set(got.tolist())) == len(got)
    # which of the values tied at the cut are kept is unspecified: the kept values are not
    assert np.array_equal(np.sort(row[got]), np.sort(row[sorted(expected)]))


def test_top_p_is_measured_on_the_whole_row_as_in_torch() -> None:
    # Renormalised over the top 3 (0.75), token 2 would have 0.73 ranked above it and be cut at 0.6;
    # over the whole row it has 0.55 above it, so it stays.
    row = np.log(np.array([0.3, 0.25, 0.2, 0.15, 0.1], dtype=np.float32))
    assert nucleus(row, 3, 0.6) == {0, 1, 2}
    assert set(draws(row, 3000, top_k=3, top_p=0.6).tolist()) == {0, 1, 2}


def test_the_nucleus_keeps_as_many_tied_tokens_as_torch() -> None:
    # Ranked 0.4, then three tied 0.2s: the mass above the second reaches 0.5 at the third, so two
    # tokens stay (which of the ties is unspecified, as with torch's sort).
    row = np.log(np.array([0.2, 0.4, 0.2, 0.2], dtype=np.float32))
    kept = _candidates(row, -1, 0.5)
    assert len(kept) == len(nucleus(row, -1, 0.5)) == 2 and 1 in kept
    assert len(_candidates(row, 3, 0.99)) == len(nucleus(row, 3, 0.99)) == 3


def test_draws_stay_above_the_min_p_threshold() -> None:
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(64) * 2).astype(np.float32)
    probs = softmax(row.astype(np.float64))
    allowed = set(np.flatnonzero(probs >= 0.1 * probs.max()).tolist())
    assert 1 < len(allowed) < 64
    seen = set(draws(row, 4000, min_p=0.1).tolist())
    assert seen == allowed


def test_sampling_follows_the_tempered_distribution() -> None:
    rng = np.random.default_rng(8)
    row = rng.standard_normal(8).astype(np.float32)
    tokens = draws(row, 20_000, temperature=0.7)
    freq = np.bincount(tokens, minlength=8) / len(tokens)
    np.testing.assert_allclose(freq, softmax(row.astype(np.float64) / 0.7), atol=0.015)


def test_draws_follow_the_distribution_across_blocks_of_the_vocabulary() -> None:
    # The draw picks a block of 1024 tokens, then a token in it: mass at both edges of blocks and
    # in the short last one, with nothing (-inf) everywhere else.
    row = np.full(3000, -np.inf, dtype=np.float32)
    where = [5, 1023, 1024, 2047, 2999]
    row[where] = np.log([1.0, 2.0, 3.0, 2.0, 2.0])
    tokens = draws(row, 20_000)
    assert set(tokens.tolist()) == set(where)
    np.testing.assert_allclose(
        np.bincount(tokens, minlength=3000)[where] / len(tokens), [0.1, 0.2, 0.3, 0.2, 0.2], atol=0.015
    )


def test_top_k_renormalises_over_the_kept_tokens() -> None:
    rng = np.random.default_rng(9)
    row = rng.standard_normal(8).astype(np.float32)
    top = np.argsort(-row)[:4]
    tokens = draws(row, 20_000, top_k=4)
    expected = np.zeros(8)
    expected[top] = softmax(row[top].astype(np.float64))
    np.testing.assert_allclose(np.bincount(tokens, minlength=8) / len(tokens), expected, atol=0.015)


# -- seeds -------------------------------------------------------------------------------------


def test_a_seeded_request_repeats_exactly_whatever_shares_the_batch() -> None:
    rng = np.random.default_rng(10)
    row = rng.standard_normal((1, 1000)).astype(np.float32)

    def run(batch_extra: int, seed: int = 42, **params) -> list[int]:
        seeded = req([1], seed=seed, **params)
        sampler = ArraySampler()  # a new one each run: the stream belongs to the request
        tokens = []
        for _ in range(20):
            rows = np.concatenate([row, rng.standard_normal((batch_extra, 1000)).astype(np.float32)])
            others = [req([1], top_p=0.9) for _ in range(batch_extra)]
            tokens.append(sampler(rows, [seeded, *others]).token_ids[0])
        return tokens

    assert run(0) == run(3) == run(15)
    assert run(0, top_k=50, temperature=0.8) == run(5, top_k=50, temperature=0.8)
    assert run(0, seed=-3) == run(4, seed=-3)  # a negative seed (int64 on the wire) works too
    assert run(0) != run(0, seed=43)


def test_two_requests_with_one_seed_draw_the_same_tokens_in_one_batch() -> None:
    rng = np.random.default_rng(11)
    logits = np.repeat(rng.standard_normal((1, 500)).astype(np.float32), 3, axis=0)
    requests = [req([1], seed=7), req([1]), req([1], seed=7)]
    sampler = ArraySampler()
    for _ in range(10):
        tokens = sampler(logits.copy(), requests).token_ids
        assert tokens[0] == tokens[2]


def test_each_sampler_replaces_the_others_generator() -> None:
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((1, 300)).astype(np.float32)
    fresh = req([1], seed=5)
    handed_over = req([1], seed=5)
    handed_over.generator = torch.Generator().manual_seed(99)  # as the torch Sampler leaves it
    sampler = ArraySampler()
    assert [sampler(logits.copy(), [fresh]).token_ids for _ in range(5)] == [
        sampler(logits.copy(), [handed_over]).token_ids for _ in range(5)
    ]
    assert isinstance(handed_over.generator, np.random.Generator)
    # ... and the torch Sampler makes its own over a numpy one, from the same seed as at first use.
    fresh, handed_over = req([1], seed=5), req([1], seed=5)
    handed_over.generator = np.random.default_rng(0)
    assert [Sampler()(torch.from_numpy(logits), [fresh]).token_ids for _ in range(5)] == [
        Sampler()(torch.from_numpy(logits), [handed_over]).token_ids for _ in range(5)
    ]


# -- grammar masks -----------------------------------------------------------------------------


@pytest.mark.parametrize("blocked_share", [0.02, 0.98])
def test_masking_rows_matches_masked_fill(blocked_share: float) -> None:
    """Both ways of masking (the blocked entries, or all then the allowed restored) touch only the
    guided rows, exactly where their bits are clear."""
    rng = np.random.default_rng(13)
    blocked = rng.random((2, 1000)) < blocked_share
    blocked[0, 100:400] = blocked_share > 0.5
    padded = np.zeros((2, 1024), dtype=bool)
    padded[:, :1000] = ~blocked
    words = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    expected = logits.copy()
    expected[[3, 1]] = np.where(blocked, -np.inf, logits[[3, 1]])
    _mask_out(logits, words, np.array([3, 1]))
    np.testing.assert_array_equal(logits, expected)
    reference = torch.from_numpy(expected[[3, 1]].copy())
    _torch_mask_out(reference, words)  # masking twice changes nothing
    np.testing.assert_array_equal(reference.numpy(), expected[[3, 1]])


def allowed_now(matcher, vocab: int) -> np.ndarray:
    import llguidance.numpy as lln

    mask = lln.allocate_token_bitmask(1, vocab)
    lln.fill_next_token_bitmask(matcher, mask, 0)
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def guided_steps(make_matcher, vocab: int, steps: int) -> None:
    """Guided rows (greedy and sampled) between free ones, step after step: each guided token is
    allowed by its mask, greedy ones are the torch Sampler's, free rows are left alone."""
    rng = np.random.default_rng(14)
    greedy, sampled = req([1], temperature=0, logprobs=2), req([1], temperature=1.0, seed=3)
    greedy.matcher, sampled.matcher = make_matcher(), make_matcher()
    requests = [req([1], temperature=0), greedy, req([1], temperature=0), sampled]
    sampler = ArraySampler()
    for _ in range(steps):
        logits = rng.standard_normal((4, vocab)).astype(np.float32)
        masks = [allowed_now(r.matcher, vocab) for r in (greedy, sampled)]
        ours, theirs = both(logits, requests, sampler)
        assert ours.token_ids[1] == theirs.token_ids[1]
        assert masks[0][ours.token_ids[1]] and masks[1][ours.token_ids[3]]
        assert ours.token_ids[1] == np.where(masks[0], logits[1], -np.inf).argmax()
        assert [ours.token_ids[0], ours.token_ids[2]] == [logits[0].argmax(), logits[2].argmax()]
        assert math.isclose(ours.logprobs[1].logprob, theirs.logprobs[1].logprob, abs_tol=1e-5)
        for r, token in ((greedy, ours.token_ids[1]), (sampled, ours.token_ids[3])):
            if not r.matcher.is_stopped():
                r.append_token(token)
                assert r.error is None
        if greedy.matcher.is_stopped() and sampled.matcher.is_stopped():
            break


@pytest.mark.parametrize("regex", [r"[a-c]+x[0-9]{2,5}", r"(.|\n)*"])
def test_guided_rows_on_a_byte_tokenizer(regex: str) -> None:
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = LLTokenizer("byte")
    grammar = LLMatcher.grammar_from_regex(regex)
    guided_steps(lambda: LLMatcher(tokenizer, grammar), tokenizer.vocab_size, steps=12)


def bundled_tokenizer_json() -> str:
    """The bundled model's tokenizer.json (CHATAPP_TEST_TOKENIZER_DIR where that model is absent)."""
    from chatapp.engine.tokenizer import prepare_tokenizer_files
    from chatapp.store import bundled_gguf_path

    copy = os.environ.get("CHATAPP_TEST_TOKENIZER_DIR")
    directory = Path(copy) if copy else prepare_tokenizer_files(bundled_gguf_path())
    return (directory / "tokenizer.json").read_text()


@pytest.mark.parametrize(
    "spec",
    [
        {"json_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"regex": r"(.|\n)*"},  # nearly everything allowed: the other way of masking
        {"choice": ["sunny", "cloudy", "rain"]},
    ],
)
def test_guided_rows_with_the_bundled_tokenizer(spec: dict) -> None:
    from chatapp.engine.guided import GrammarCompiler, GuidedDecoding

    compiler = GrammarCompiler(bundled_tokenizer_json(), 49152, frozenset({2}))
    guided_steps(lambda: compiler.matcher(GuidedDecoding(**spec)), 49152, steps=8)


# -- no torch ----------------------------------------------------------------------------------


def test_the_array_sampler_loads_without_torch() -> None:
    code = (
        "import sys\n"
        "import chatapp.engine.array_sampler, chatapp.engine.request, chatapp.engine.sampling_rules\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent, timeout=60)
