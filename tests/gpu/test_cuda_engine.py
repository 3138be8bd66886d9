"""The engine on a CUDA GPU: Hugging Face equivalence, the KV cache's features, CUDA graphs, and the
KV pool sized from the memory the card has.

Hugging Face runs on the same GPU as the reference. Float32 must match it token for token (our
Triton attention's dots are IEEE float32 there); bfloat16 is held to the usual tolerance of
half-precision checks: where the two greedy sequences part, each one's token is among the other's
five most likely, i.e. they part at a near-tie, not because one of them is wrong.
"""

from __future__ import annotations

import gc
from functools import lru_cache

import torch

from chatapp.engine import LLM, SamplingParams
from tests.hf_reference import bundled_hf_dir
from tests.test_engine_bundled import PROMPTS

GIB = 2**30


@lru_cache(maxsize=2)
def hf_on_gpu(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_hf_dir(), dtype=dtype).to("cuda").eval()


def hf_greedy_with_top5(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    """HF generate()'s greedy tokens and, per step, its five most likely tokens."""
    ids = torch.tensor([prompt_ids], device="cuda")
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, [scores[0].topk(5).indices.tolist() for scores in out.scores]


def graph_replays(llm: LLM) -> int:
    graphs = llm.core.runner.decode_graphs
    assert graphs is not None, "decode steps on a GPU run from CUDA graphs by default"
    return graphs.replays


def test_bundled_model_matches_hf_token_for_token_in_float32() -> None:
    # A small step budget chunks the prompts and mixes decodes into prefill steps; once the
    # prompts are in, the 9 decodes replay the 16-row graph with 7 rows of padding.
    llm = LLM(
        device="cuda",
        dtype="float32",
        kv_cache_memory_gib=1,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert max(len(o.prompt_token_ids) for o in outs) > 24  # really chunked
    hf = hf_on_gpu(torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        expected, _ = hf_greedy_with_top5(hf, out.prompt_token_ids, 24)
        assert out.outputs[0].token_ids == expected, prompt
    assert graph_replays(llm) > 0
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def agreed_tokens(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy sequences share before they part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_bundled_model_follows_hf_in_bfloat16() -> None:
    llm = LLM(device="cuda", dtype="bfloat16", kv_cache_memory_gib=1)
    assert llm.core.runner.kv_caches[0][0].dtype == torch.bfloat16  # the KV cache follows the weights
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, logprobs=5))
    hf_bf16, hf_fp32 = hf_on_gpu(torch.bfloat16), hf_on_gpu(torch.float32)
    ours_from_truth = theirs_from_truth = 0
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0].token_ids
        theirs, their_top = hf_greedy_with_top5(hf_bf16, out.prompt_token_ids, 32)
        truth, _ = hf_greedy_with_top5(hf_fp32, out.prompt_token_ids, 32)
        ours_from_truth += agreed_tokens(ours, truth)
        theirs_from_truth += agreed_tokens(theirs, truth)
        if ours == theirs:
            continue
        # Where ours and HF's bfloat16 part, each picked a token the other ranks in its top five.
        at = agreed_tokens(ours, theirs)
        assert at < min(len(ours), len(theirs)), f"one stopped early at {at}: {prompt!r}"
        assert out.outputs[0].logprobs is not None
        our_top = [token for token, _ in out.outputs[0].logprobs[at].top]
        assert ours[at] in their_top[at] and theirs[at] in our_top, f"parted at token {at} of {prompt!r}"
    # And ours stays as close to the float32 answers as Hugging Face's own bfloat16 does.
    assert ours_from_truth >= 0.8 * theirs_from_truth, (ours_from_truth, theirs_from_truth)
    assert graph_replays(llm) > 0


def test_prefix_caching_chunked_prefill_and_preemption_keep_the_outputs(tiny_llama) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (5, 23, 47, 70, 90, 33)]
    again = prompts[3][:48] + torch.randint(3, 40000, (10,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(model=str(tiny_llama), device="cuda", dtype="float32", block_size=16)

    roomy = LLM(kv_cache_memory_gib=0.25, enable_prefix_caching=False, cuda_graphs=False, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts + [again], params)]
    del roomy
    gc.collect()

    # 20 blocks of 16 hold 320 tokens; the six requests want 268 prompt + 240 new ones at once.
    tight = LLM(num_kv_blocks=20, max_num_batched_tokens=32, long_prefill_token_threshold=16, **common)
    outs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    [repeat] = tight.generate([prompts[3]], params)  # its blocks are the newest in the cache now
    [cached] = tight.generate([again], params)
    stats = tight.stats()
    assert cached.num_cached_tokens == 48  # three full blocks of the earlier prompt
    assert [o.outputs[0].token_ids for o in outs] + [cached.outputs[0].token_ids] == expected
    assert repeat.outputs[0].token_ids == expected[3]
    assert len({tuple(ids) for ids in expected}) > 1, "a constant model would agree with anything"
    assert graph_replays(tight) > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total == 20


def _pool_bytes(llm: LLM) -> int:
    runner = llm.core.runner
    return runner.num_blocks * runner.bytes_per_block()


def settled_use() -> int:
    """Device memory in use once dropped objects are collected and the allocator's cache returned."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_kv_pool_is_sized_from_the_memory_the_card_has(tiny_llama) -> None:
    settled_use()  # earlier tests' engines and models are gone before this one measures
    total = torch.cuda.mem_get_info()[1]
    common = dict(model=str(tiny_llama), device="cuda", max_model_len=2048)

    first = LLM(gpu_memory_utilization=0.3, **common)
    used = settled_use()
    # The whole card's use lands at the engine's share, less the (tiny) activation peak.
    assert 0.3 * total - GIB < used < 0.3 * total + 0.5 * GIB, (used / GIB, 0.3 * total / GIB)

    # A second engine (or a second model in one engine) counts the first's memory as taken.
    second = LLM(gpu_memory_utilization=0.5, **common)
    assert abs(_pool_bytes(second) - 0.2 * total) < GIB, (_pool_bytes(second) / GIB, total / GIB)
    del first, second
    settled_use()

    capped = LLM(kv_cache_memory_gib=0.5, **common)
    assert 0.49 * GIB < _pool_bytes(capped) <= 0.5 * GIB
