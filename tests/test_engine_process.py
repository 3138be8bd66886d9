"""The background engine process and AsyncEngineClient (issue 3), on tiny random models.

One engine (in the session's private runtime dir) is shared by the tests that
leave it healthy; tests that kill or switch an engine get their own runtime
dir and so their own engine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from chatapp import paths
from chatapp.engine import LLM, SamplingParams
from chatapp.engine import ipc
from chatapp.engine.api import EngineBusyError, EngineDeadError, InvalidRequestError
from chatapp.engine.client import AsyncEngineClient, EngineModelMismatchError
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import context_length_error
from chatapp.engine.output_processor import OutputDelta

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]

SCRIPT = Path(__file__).with_name("engine_client_script.py")
MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
    "The quick brown fox", "Q: What is 2+2?\nA:", "Hi", "In the beginning",
    "import numpy as np", "Dear Sir or Madam,", "The weather today", "Roses are red,",
    "SELECT * FROM", "My favourite food is", "Water boils at", "The meaning of life is",
    "Translate to French: cat", "A haiku about autumn:", "Breaking news:", "Step 1: preheat the oven",
]
LONG = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)


def engine_config(model: Path) -> dict[str, Any]:
    return {"model": str(model), "num_kv_blocks": 1024, "max_num_seqs": 32}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like the tiny_llama fixture, with a longer context so "long" requests outlast the tests' waits."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-8k"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Any]:
    """Greedy outputs of the offline LLM (in this process), before any engine process runs."""
    llm = LLM(str(tiny_model), **{k: v for k, v in engine_config(tiny_model).items() if k != "model"})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    ref = {p: (o.outputs[0].text, o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}
    del llm
    gc.collect()
    return ref


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(tiny_model: Path, reference: dict[str, Any]) -> Any:
    """The shared engine's first client: it spawns the engine."""
    c = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)))
    yield c
    await c.close()


async def collect(agen: Any) -> list[OutputDelta]:
    return [delta async for delta in agen]


async def wait_for_stats(c: AsyncEngineClient, ok: Any, within: float) -> dict[str, Any]:
    """Poll stats until ok(stats); the bound is a correctness deadline (a hang fails), not a speed check."""
    deadline = time.monotonic() + within
    while True:
        stats = await c.stats()
        if ok(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def idle(stats: dict[str, Any]) -> bool:
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0


async def start_script(job: dict[str, Any]) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), json.dumps(job),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line, "the client script exited before attaching"
    return proc, json.loads(line)


# -- 1. many concurrent streams from two processes, exact greedy text -----------------------


async def test_concurrent_clients_match_offline_greedy(client: AsyncEngineClient, tiny_model: Path,
                                                       reference: dict[str, Any]) -> None:
    mine, theirs = PROMPTS[:16], PROMPTS[16:]
    proc, hello = await start_script({"mode": "generate", "config": engine_config(tiny_model),
                                      "prompts": theirs, "max_tokens": MAX_TOKENS})
    assert hello == {"attached": client.engine_pid, "spawned": False}
    assert proc.stdin is not None and proc.stdout is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    proc.stdin.write(b"go\n")
    streams = [collect(client.generate(p, params)) for p in mine]
    results = await asyncio.gather(*streams, asyncio.wait_for(proc.stdout.readline(), 60))
    other = json.loads(results[-1])["results"]
    assert await asyncio.wait_for(proc.wait(), 30) == 0

    for prompt, deltas in zip(mine, results[:-1]):
        text, ids = reference[prompt]
        assert "".join(d.text for d in deltas) == text, prompt
        assert [t for d in deltas for t in d.token_ids] == ids, prompt
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        last = deltas[-1]
        assert last.finish_reason in ("length", "stop") and last.num_output_tokens == len(ids)
    for prompt, res in zip(theirs, other):
        assert (res["text"], res["token_ids"]) == reference[prompt], prompt
    stats = await client.stats()
    assert idle(stats), stats
    assert stats["generation_tokens_total"] >= sum(len(reference[p][1]) for p in PROMPTS)


# -- 2. aborts: explicit, and by a reader that goes away ----------------------------------------


async def test_explicit_abort_stops_within_a_step_and_frees_blocks(client: AsyncEngineClient) -> None:
    stream = client.generate("Count forever:", LONG, request_id="explicit-abort")
    deltas = [await anext(stream), await anext(stream)]
    busy = await client.stats()
    assert busy["num_running"] == 1 and busy["kv_blocks_used"] > 0
    await client.abort("explicit-abort")
    # The engine handles the abort before this stats call (one socket, in order): blocks are free already.
    assert idle(await client.stats())
    deltas += await collect(stream)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert deltas[-1].num_output_tokens < 1000  # it did stop, long before the context was full
    assert idle(await client.stats())


async def test_aclose_aborts(client: AsyncEngineClient) -> None:
    stream = client.generate("Count forever:", LONG)
    await anext(stream)
    assert (await client.stats())["num_running"] == 1
    await stream.aclose()
    assert idle(await client.stats())  # the abort was sent by aclose(), ahead of this call


async def test_dropped_iterator_aborts(client: AsyncEngineClient) -> None:
    stream = client.generate("Count forever:", LONG)
    await anext(stream)
    del stream
    gc.collect()  # the event loop's async-generator finaliser schedules aclose()
    stats = await wait_for_stats(client, idle, within=5)
    assert idle(stats), stats
    assert not client._streams


async def test_cancelled_reader_aborts(client: AsyncEngineClient) -> None:
    started = asyncio.Event()

    async def read() -> None:
        async for _ in client.generate("Count forever:", LONG):
            started.set()

    task = asyncio.create_task(read())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert idle(await client.stats())


async def test_stop_string_is_found_client_side_and_aborted(client: AsyncEngineClient,
                                                           reference: dict[str, Any]) -> None:
    prompt = PROMPTS[0]
    text, _ = reference[prompt]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    deltas = await collect(client.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop)))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert "".join(d.text for d in deltas) == text[:text.index(stop)]
    assert idle(await wait_for_stats(client, idle, within=5))


async def test_bad_requests_are_rejected_before_sending(client: AsyncEngineClient) -> None:
    info = client.model_info
    too_long = [5] * info.max_model_len
    with pytest.raises(InvalidRequestError) as err:
        await anext(client.generate(too_long, SamplingParams(max_tokens=10)))
    assert err.value.param == "prompt"
    assert str(err.value) == context_length_error(info.max_model_len, len(too_long), 10)
    with pytest.raises(InvalidRequestError) as err:
        await anext(client.generate(messages=[{"role": "user", "content": "hi " * info.max_model_len}]))
    assert err.value.param == "messages" and "maximum context length" in str(err.value)
    with pytest.raises(InvalidRequestError, match="empty") as err:
        await anext(client.generate(""))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="token ids"):
        await anext(client.generate([1, info.vocab_size]))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        await anext(client.generate("hi", messages=[{"role": "user", "content": "hi"}]))
    with pytest.raises(InvalidRequestError) as err:
        await anext(client.generate(messages=[{"role": "wizard", "content": "hi"}]))
    assert err.value.param == "messages"
    assert idle(await client.stats())
