"""Many clients at once, clients that leave, and clients that time out (issue 6), on a tiny random model.

What matters here is the server's bookkeeping, not the text: every request
either finishes with the same tokens it would get alone, or is aborted in
the engine as soon as its client is gone, leaving every KV block free.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server_harness import ServedEngine, idle

pytestmark = pytest.mark.timeout(180)

PROMPTS = [f"Request number {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(32)]
ENDLESS = 100_000  # more than the context holds: such a request only ends when aborted


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-8k"), max_position_embeddings=8192)
    engine = {"model": str(model), "num_kv_blocks": 2048, "max_num_seqs": 64}
    with ServedEngine(tmp_path_factory.mktemp("runtime"), engine) as se:
        yield se


@pytest.fixture(scope="module")
def model(served: ServedEngine) -> str:
    return served.client.model_info.name


def test_32_concurrent_streams_match_solo_runs(served: ServedEngine, model: str) -> None:
    sdk = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    solo = [
        sdk.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text for p in PROMPTS
    ]

    async def stream(client: AsyncOpenAI, messages_prompt: str) -> tuple[str, str | None, int]:
        text, finish, ids = "", None, set()
        async for chunk in await client.completions.create(
            model=model, prompt=messages_prompt, max_tokens=24, temperature=0, stream=True
        ):
            ids.add(chunk.id)
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, len(ids)

    async def all_at_once() -> list[tuple[str, str | None, int]]:
        async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(stream(client, p) for p in PROMPTS))

    before = served.stats().prompt_tokens_total
    results = asyncio.run(all_at_once())
    assert [r[0] for r in results] == solo
    assert all(r[1] == "length" and r[2] == 1 for r in results)
    assert served.stats().prompt_tokens_total > before  # really went through the engine again
    assert idle(served.wait_until(idle))


def test_n_choices_share_the_prompt_through_the_prefix_cache(served: ServedEngine, model: str) -> None:
    sdk = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    prompt = "A prompt no other test uses, long enough to fill several KV blocks: " + "lorem ipsum " * 40
    prompt_len = len(served.client.tokenizer.encode(prompt))
    block_size = served.client.model_info.block_size
    full_blocks = (prompt_len - 1) // block_size
    before = served.stats()
    out = sdk.completions.create(model=model, prompt=prompt, max_tokens=4, n=3, seed=5)
    after = served.stats()
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == prompt_len  # counted once, as OpenAI does
    # The two later choices found every full block of the prompt in the cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * full_blocks > 0
    assert after.prompt_tokens_total - before.prompt_tokens_total < prompt_len + 2 * block_size


def test_disconnect_mid_stream_aborts_in_the_engine(served: ServedEngine, model: str) -> None:
    before = served.stats().generation_tokens_total
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": ENDLESS, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{served.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]
        assert all(line.startswith("data: ") or line == "" for line in got)
        assert served.stats().num_running == 1
    # The connection is closed: the request must be gone from the engine within a step or so.
    stats = served.wait_until(idle, timeout=5)
    assert idle(stats)
    generated = stats.generation_tokens_total - before
    assert generated < served.client.model_info.max_model_len // 2  # stopped long before the context's end


def test_200_short_timeouts_abort_and_the_server_stays_responsive(served: ServedEngine, model: str) -> None:
    before = served.stats().generation_tokens_total

    async def impatient(client: AsyncOpenAI, i: int) -> BaseException | None:
        """Gives up after 1 s in all (httpx's timeouts are per read, and a stream keeps reading)."""
        try:
            async with asyncio.timeout(1.0):
                if i % 2:
                    async with await client.completions.create(
                        model=model, prompt=PROMPTS[i % 32], max_tokens=ENDLESS, stream=True
                    ) as stream:
                        async for _ in stream:
                            pass
                else:
                    await client.chat.completions.create(
                        model=model, max_tokens=ENDLESS, messages=[{"role": "user", "content": PROMPTS[i % 32]}]
                    )
        except (TimeoutError, openai.APITimeoutError) as exc:
            return exc
        return None

    async def crowd() -> list[BaseException | None]:
        async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=0.5) as client:
            return await asyncio.gather(*(impatient(client, i) for i in range(200)))

    outcomes = asyncio.run(crowd())
    assert all(o is not None for o in outcomes)

    start = time.monotonic()
    sdk = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=5)
    answer = sdk.chat.completions.create(  # greedy: a sampled answer may end before its 4 tokens
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert time.monotonic() - start < 5 and answer.usage.completion_tokens == 4

    stats = served.wait_until(idle, timeout=10)
    assert idle(stats)
    # Every request was aborted: nowhere near 200 full contexts were generated.
    assert stats.generation_tokens_total - before < 200 * 200
