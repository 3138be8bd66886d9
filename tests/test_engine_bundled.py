"""The engine on the real bundled SmolLM2 against Hugging Face generate()."""

from __future__ import annotations

import pytest

from chatapp.engine import LLM, SamplingParams
from tests.hf_reference import bundled_hf_dir, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Explain quantum computing in simple terms. Quantum computing is a field that",
    "The quick brown fox",
    "In the year 2050, humanity had finally achieved interstellar travel. The first ship to leave "
    "the solar system was called",
    "Q: What is 2+2?\nA:",
    "Hi",
]
SYSTEM = (
    "You are a meticulous assistant for a small bakery. You answer questions about bread, pastries, "
    "opening hours and allergens. Keep every answer short, friendly and precise, and never invent "
    "prices or ingredients that were not mentioned. If unsure, say so and suggest calling the shop. "
    "The bakery opens at seven in the morning on weekdays and at eight on Saturdays; it is closed on "
    "Sundays and public holidays. Every loaf is baked on site from organic flour. Customers with nut "
    "allergies should know that almonds and hazelnuts are used in the same kitchen as everything else."
)
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def model_path():
    return bundled_hf_dir()


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    # A tiny token budget forces chunked prefill and mixes decodes with prefill chunks. Float32
    # weights and KV cache: the model Hugging Face runs (the CPU default caches keys in float16).
    return LLM(
        kv_cache_memory_gib=0.25,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        quantization=None,
        kv_cache_dtype="float32",
    )


def test_continuous_batch_with_chunked_prefill_matches_hf(llm: LLM, model_path) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    assert max(len(o.prompt_token_ids) for o in outs) > llm.config.max_num_batched_tokens  # really chunked
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_path, out.prompt_token_ids, 24), prompt
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_shared_system_prompt_hits_prefix_cache(llm: LLM, model_path) -> None:
    def wave(questions: list[str]) -> list:
        return llm.chat(
            [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions],
            SamplingParams(temperature=0, max_tokens=12),
        )

    wave(["When do you open on Sundays?", "Do you sell rye bread?"])
    before = llm.stats()
    second = wave(["Is the croissant vegan?", "Can I order a birthday cake?", "Do you have gluten-free rolls?"])
    after = llm.stats()
    shared_tokens = len(llm.tokenizer.render_chat([{"role": "system", "content": SYSTEM}], False))
    full_shared_blocks = shared_tokens // llm.config.block_size
    assert full_shared_blocks >= 6
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 3 * full_shared_blocks * llm.config.block_size
    for out in second:
        assert out.num_cached_tokens >= full_shared_blocks * llm.config.block_size
        assert out.outputs[0].token_ids == hf_greedy(model_path, out.prompt_token_ids, 12)


def test_multi_turn_follow_up_hits_every_full_block_of_the_earlier_turn(llm: LLM) -> None:
    history = [{"role": "user", "content": "Name three colours of the rainbow and describe each one."}]
    first = llm.chat(history, SamplingParams(temperature=0, max_tokens=60))[0]
    answer = first.outputs[0]
    computed = len(first.prompt_token_ids) + len(answer.token_ids) - 1  # the last sampled token is never fed
    history += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "And a fourth?"}]
    follow_up = llm.chat(history, SamplingParams(temperature=0, max_tokens=8))[0]
    bs = llm.config.block_size
    assert follow_up.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert follow_up.num_cached_tokens >= (computed // bs) * bs


def test_fully_cached_prompt_still_generates(llm: LLM) -> None:
    prompt = list(range(1000, 1000 + 4 * llm.config.block_size))  # exactly four full blocks
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 3 * llm.config.block_size
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_under_a_small_pool_keeps_outputs_identical(model_path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(kv_cache_memory_gib=0.25, quantization=None)
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS[:6], params)]
    del roomy
    tight = LLM(num_kv_blocks=10, block_size=16, max_num_batched_tokens=64, quantization=None)
    outs = tight.generate(PROMPTS[:6], params)
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert stats.kv_blocks_free == stats.kv_blocks_total == 10
    assert stats.num_running == stats.num_waiting == 0


def test_prompt_that_can_never_fit_finishes_with_an_error(model_path) -> None:
    small = LLM(num_kv_blocks=4, block_size=16)  # the pool caps the context at 64 tokens
    assert small.config.max_model_len == 64
    too_long, fine = small.generate([list(range(100, 200)), "Hello"], SamplingParams(temperature=0, max_tokens=4))
    assert too_long.outputs[0].finish_reason == "error"
    assert too_long.error.startswith("This model's maximum context length is 64 tokens")
    assert fine.outputs[0].finish_reason in ("stop", "length") and fine.outputs[0].token_ids
    assert small.stats().kv_blocks_free == 4


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert " 7," in free.text
    cut = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 7", "zzz"]))[0]
    out = cut.outputs[0]
    assert out.text == free.text[: free.text.index(" 7")]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_prompt_logprobs_are_the_teacher_forced_ones_over_chunks_and_past_the_cache(llm: LLM) -> None:
    """Each prompt token's logprob equals the full forward's, though the prompt runs in chunks of at
    most 16 tokens and was cached by a request before (prompt logprobs skip the prefix cache)."""
    import torch

    from tests.quality_checks import teacher_forced_logits

    ids = llm.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog, and in 1969 the first people walked on the moon."
    )
    llm.generate([ids], SamplingParams(max_tokens=1))  # now the prompt's full blocks are cached
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    reference = torch.log_softmax(teacher_forced_logits(llm, ids).float(), dim=-1)
    chosen = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in got[1:]]), chosen, atol=1e-4)
    top = reference[:-1].topk(3, dim=-1)
    assert [[t for t, _ in lp.top] for lp in got[1:]] == top.indices.tolist()
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids
