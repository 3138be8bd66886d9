"""64 streaming clients at once against a KV pool far too small for them (issue 9), on a tiny random model.

Random prompt lengths (up to 1,500 tokens), random max_tokens, chat and text completions, and a
quarter of the clients hang up mid-stream. The pool holds one of the longest requests and little more, so the
engine must preempt and recompute. Every client that stayed gets its complete answer, token for
token the one the same request gets alone (greedy decoding is batch-invariant by design); the run
ends (a deadline guards against a deadlock) and leaves nothing behind: no request queued or running,
every KV block free.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.reliability_helpers import sse_data, stream_text
from tests.server_harness import ServedEngine, idle

pytestmark = pytest.mark.timeout(300)

CLIENTS = 64
MAX_PROMPT_TOKENS = 1500
MAX_NEW_TOKENS = 64
KV_BLOCKS = 128  # x 16 tokens: room for one of the longest requests (and then some), not for 64
DEADLINE_S = 200  # the whole crowd; far above a healthy run's time, so only a hang hits it
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river stone bread music garden window light paper "
    "table story engine cache block token model answer question reason water city night morning"
).split()


@dataclass
class Client:
    index: int
    route: str
    body: dict[str, Any]
    hang_up_after: int | None  # content events read before closing the connection; None: stays to the end
    start_delay: float
    events: list[Any] = field(default_factory=list)
    status: int | None = None


def make_clients(rng: random.Random) -> list[Client]:
    clients = []
    for i in range(CLIENTS):
        length = rng.randint(1, MAX_PROMPT_TOKENS)
        max_tokens = rng.randint(1, MAX_NEW_TOKENS)
        common = {"max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
        if i % 2:
            route = "/v1/completions"  # token ids: the exact length asked for
            body = {"prompt": [rng.randrange(3, 49152) for _ in range(length)], **common}
        else:
            route = "/v1/chat/completions"  # about one token per word, plus the chat template's few
            text = " ".join(rng.choice(WORDS) for _ in range(max(1, length - 20)))
            body = {"messages": [{"role": "user", "content": text}], **common}
        hang_up = rng.randint(1, max_tokens) if rng.random() < 0.25 else None
        clients.append(Client(i, route, body, hang_up, rng.uniform(0, 1)))
    return clients


async def run_client(http: httpx.AsyncClient, client: Client) -> None:
    await asyncio.sleep(client.start_delay)
    async with http.stream("POST", client.route, json={**client.body, "stream": True}) as response:
        client.status = response.status_code
        content_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            client.events += sse_data([line])
            event = client.events[-1]
            if isinstance(event, dict) and any(
                c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices", [])
            ):
                content_events += 1
            if client.hang_up_after is not None and content_events >= client.hang_up_after:
                return  # leaving the block closes the connection mid-stream


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-2k"), max_position_embeddings=2048)
    engine = {"model": str(model), "num_kv_blocks": KV_BLOCKS, "block_size": 16, "max_num_seqs": CLIENTS}
    with ServedEngine(tmp_path_factory.mktemp("runtime"), engine) as se:
        yield se


def test_64_streaming_clients_with_hang_ups_under_preemption(served: ServedEngine) -> None:
    clients = make_clients(random.Random(9))
    before = served.stats()

    async def crowd() -> None:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE_S, limits=limits) as http:
            async with asyncio.timeout(DEADLINE_S):
                await asyncio.gather(*(run_client(http, c) for c in clients))

    asyncio.run(crowd())
    after = served.wait_until(idle, timeout=30)
    assert idle(after), after  # nothing running or queued, every block free (cached prefixes count as free)
    assert after.num_running == after.num_waiting == 0 and after.kv_blocks_free == after.kv_blocks_total
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"

    stayed = [c for c in clients if c.hang_up_after is None]
    assert 0 < len(stayed) < CLIENTS
    for client in clients:  # whoever left, left without having seen an error
        assert client.status == 200
        assert not any(isinstance(e, dict) and "error" in e for e in client.events), (client.index, client.events)

    # Each stayer's answer against the same request alone, one at a time, on the same engine.
    with httpx.Client(base_url=served.url, timeout=120) as http:
        for client in stayed:
            whole = {k: v for k, v in client.body.items() if k != "stream_options"}  # only for streams
            solo = http.post(client.route, json=whole)
            assert solo.status_code == 200, solo.text
            expected = solo.json()
            choice = expected["choices"][0]
            solo_text = choice["text"] if "text" in choice else choice["message"]["content"]
            text, finish, usage = stream_text(client.events)
            assert client.events[-1] == "[DONE]", client.index
            assert (text, finish) == (solo_text, choice["finish_reason"]), client.index
            assert usage == expected["usage"], client.index
            assert usage["prompt_tokens"] <= MAX_PROMPT_TOKENS + 16
    assert idle(served.wait_until(idle, timeout=10))
