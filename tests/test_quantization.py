"""int8 linear layers stay close to float32 on the bundled model."""

from __future__ import annotations

import pytest
import torch

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.quantization import Int8Linear
from tests.quality_checks import agreement, moon_landing_logits


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    return LLM(quantization=None, kv_cache_memory_gib=0.1), LLM(quantization="int8", kv_cache_memory_gib=0.1)


def test_int8_linear_matches_float_per_token_with_outlier_rows() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 96) * 0.05, torch.randn(64)
    x = torch.randn(5, 96)
    x[0, 7] = 500.0  # a massive activation in one token must not wreck the others
    layer = Int8Linear(weight, bias, outliers=torch.tensor([7]))
    exact = x @ weight.T + bias
    rel = (layer(x) - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) < 0.02
    assert float((Int8Linear(weight, bias)(x[1:2]) - exact[1:2]).abs().max()) < 0.05  # the batch-1 path


def test_logit_error_and_greedy_agreement_are_bounded(pair: tuple[LLM, LLM]) -> None:
    fp32, int8 = pair
    a, b = moon_landing_logits(fp32, int8)
    assert float((a - b).abs().max()) < 10.0  # per-tensor activations reached 22
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.85
    result = agreement(fp32, int8, num_tokens=12)  # the benchmark's measure, on its 24 prompts
    assert result["greedy_agreement"] > 0.88  # measured 0.93; per-tensor activations gave 0.60


def test_int8_engine_answers_sensibly(pair: tuple[LLM, LLM]) -> None:
    _, int8 = pair
    out = int8.chat(
        [{"role": "user", "content": "How do I reverse a list in Python?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0]
    assert "reverse" in out.outputs[0].text.lower() or "[::-1]" in out.outputs[0].text
    assert int8.core.runner.model.quantized_lm_head is not None


def test_answers_do_not_depend_on_batch_or_chunking(pair: tuple[LLM, LLM]) -> None:
    """Greedy answers are the same alone, together, and with prompts cut into tiny chunks."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        "The history of Rome",
        "def quicksort(arr):",
        "My favourite food is",
        "1 2 3 4",
        "A long time ago in a galaxy far, far away there was",
    ]
    for llm in pair:
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert together == alone
    chunked = LLM(quantization="int8", kv_cache_memory_gib=0.05, max_num_batched_tokens=3)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == alone


def test_int8_linear_rows_are_bitwise_batch_invariant() -> None:
    torch.manual_seed(1)
    layer = Int8Linear(torch.randn(48, 64) * 0.1, torch.randn(48), outliers=torch.tensor([3, 9]))
    x = torch.randn(9, 64)
    x[2, 3] = 300.0
    batch = layer(x)
    assert all(torch.equal(layer(x[i : i + 1])[0], batch[i]) for i in range(9))
