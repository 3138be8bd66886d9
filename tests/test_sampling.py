"""Sampling parameters: validation, seeds, top-k/top-p/min-p, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.request import Request
from chatapp.engine.sampler import Sampler


def req(tokens: list[int], output: list[int] = (), **params) -> Request:
    r = Request("r", tokens, SamplingParams(**params), frozenset(), 16, 10_000)
    for t in output:
        r.append_token(t)
    return r


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [1, 2]}, "stop"),
        ({"logit_bias": {5: 200}}, "logit_bias"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    reqs = [req([1], temperature=1.5, top_k=1) for _ in range(6)]
    assert Sampler()(logits.clone(), reqs).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {Sampler()(logits.clone(), [req([1], top_p=0.7)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 covers 0.7; tokens 2 and 3 are outside


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.08, 0.02]]))
    seen = {Sampler()(logits.clone(), [req([1], min_p=0.2)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # threshold 0.2 * 0.6 = 0.12


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log()[None].repeat(4000, 1)
    tokens = Sampler()(logits, [req([1]) for _ in range(4000)]).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_repeat_exactly_whatever_shares_the_batch() -> None:
    logits = torch.randn(1, 100)

    def draw(batch_extra: int) -> list[int]:
        seeded = req([1], seed=42)
        tokens = []
        for _ in range(20):
            rows = torch.cat([logits, torch.randn(batch_extra, 100)])
            others = [req([1]) for _ in range(batch_extra)]
            tokens.append(Sampler()(rows, [seeded] + others).token_ids[0])
        return tokens

    assert draw(0) == draw(3) == draw(7)


def test_frequency_and_presence_penalties_subtract_as_defined() -> None:
    r = req([9, 9], output=[3, 3, 3, 5], frequency_penalty=0.5, presence_penalty=0.25, temperature=0)
    row = torch.zeros(10)
    from chatapp.engine.sampler import _apply_penalties

    _apply_penalties(row, r)
    expected = torch.zeros(10)
    expected[3] = -(0.5 * 3 + 0.25)
    expected[5] = -(0.5 * 1 + 0.25)
    assert torch.allclose(row, expected)  # the prompt's 9s are not penalised by OpenAI penalties


def test_repetition_penalty_scales_seen_tokens_like_hf() -> None:
    r = req([1, 2], output=[3], repetition_penalty=2.0)
    row = torch.tensor([1.0, 4.0, -4.0, 6.0, 8.0])
    from chatapp.engine.sampler import _apply_penalties

    _apply_penalties(row, r)
    assert row.tolist() == [1.0, 2.0, -8.0, 3.0, 8.0]  # positive / 2, negative * 2, unseen untouched


def test_logit_bias_and_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits.clone(), [req([1], temperature=0, logit_bias={3: 10.0}, logprobs=2)])
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(lp.logprob, raw[3].item(), rel_tol=1e-6)  # logprobs of the model, before bias
    assert [t for t, _ in lp.top] == [0, 1]


def test_engine_seeded_runs_repeat_and_differ_across_seeds(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory_gib=0.02)
    prompts = ["The weather today", "Numbers:"]

    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_engine_frequency_penalty_stops_repetition() -> None:
    # The bundled model in float32: a random one does not repeat itself, and int8 would blur the counts.
    llm = LLM(kv_cache_memory_gib=0.05, quantization=None)
    prompt = "hello hello hello hello hello hello"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    penal = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.5))[0].outputs[0]
    hello = plain.token_ids[0]
    assert plain.token_ids.count(hello) >= 4  # greedy keeps saying hello
    assert penal.token_ids.count(hello) == 1  # each repeat costs 1.5 more: it moves on
