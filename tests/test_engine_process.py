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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from chatapp import paths
from chatapp.engine import LLM, SamplingParams, ipc, prestart
from chatapp.engine.api import EngineBusyError, EngineDeadError, EngineState, EngineStats, InvalidRequestError
from chatapp.engine.client import AsyncEngineClient, EngineModelMismatchError
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import context_length_error
from chatapp.engine.output_processor import OutputDelta

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]

SCRIPT = Path(__file__).with_name("engine_client_script.py")
MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Q: What is 2+2?\nA:",
    "Hi",
    "In the beginning",
    "import numpy as np",
    "Dear Sir or Madam,",
    "The weather today",
    "Roses are red,",
    "SELECT * FROM",
    "My favourite food is",
    "Water boils at",
    "The meaning of life is",
    "Translate to French: cat",
    "A haiku about autumn:",
    "Breaking news:",
    "Step 1: preheat the oven",
]
LONG = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)


def engine_config(model: Path) -> dict[str, Any]:
    return {"model": str(model), "num_kv_blocks": 4096, "max_num_seqs": 32}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like the tiny_llama fixture, with a long context (64k) so "long" requests outlast the tests' waits
    (the 5 s heartbeat timeout included) with room to spare: 8k tokens took the tiny model under 5 s."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-64k"), max_position_embeddings=65536)


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


async def wait_for_stats(c: AsyncEngineClient, ok: Any, within: float) -> EngineStats:
    """Poll stats until ok(stats); the bound is a correctness deadline (a hang fails), not a speed check."""
    deadline = time.monotonic() + within
    while True:
        stats = await c.stats()
        if ok(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def idle(stats: EngineStats) -> bool:
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


def idle_with_one_client(stats: EngineStats) -> bool:
    """Idle, and the other client gone: the two need not happen in the same poll."""
    return idle(stats) and stats.num_clients == 1


async def start_script(
    job: dict[str, Any], runtime: Path | None = None
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    env = {**os.environ, "CHATAPP_RUNTIME_DIR": str(runtime)} if runtime is not None else None
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        json.dumps(job),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line, "the client script exited before attaching"
    return proc, json.loads(line)


# -- 1. many concurrent streams from two processes, exact greedy text -----------------------


async def test_concurrent_clients_match_offline_greedy(
    client: AsyncEngineClient, tiny_model: Path, reference: dict[str, Any]
) -> None:
    mine, theirs = PROMPTS[:16], PROMPTS[16:]
    generated_before = (await client.stats()).generation_tokens_total  # the engine is shared by the module
    proc, hello = await start_script(
        {"mode": "generate", "config": engine_config(tiny_model), "prompts": theirs, "max_tokens": MAX_TOKENS}
    )
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
    assert stats.generation_tokens_total - generated_before == sum(len(reference[p][1]) for p in PROMPTS)


async def test_streams_gather_tokens_but_never_hold_the_first(client: AsyncEngineClient, tiny_model: Path) -> None:
    """A message carries the tokens of ~25 ms (stream_buffer.py); the first token comes alone, at once."""
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    deltas = await collect(client.generate("Count slowly:", params))
    offline = LLM(str(tiny_model), num_kv_blocks=64).generate(["Count slowly:"], params)[0].outputs[0]
    assert [t for d in deltas for t in d.token_ids] == offline.token_ids
    assert "".join(d.text for d in deltas) == offline.text
    assert len(deltas[0].token_ids) == 1
    assert len(deltas) < 300 / 2  # the tiny model makes a token in ~1 ms: 300 messages without the buffer


# -- 2. aborts: explicit, and by a reader that goes away ----------------------------------------


async def test_explicit_abort_stops_within_a_step_and_frees_blocks(client: AsyncEngineClient) -> None:
    stream = client.generate("Count forever:", LONG, request_id="explicit-abort")
    deltas = [await anext(stream), await anext(stream)]
    busy = await client.stats()
    assert busy.num_running == 1 and busy.kv_blocks_used > 0
    await client.abort("explicit-abort")
    # The engine handles the abort before this stats call (one socket, in order): blocks are free already.
    assert idle(await client.stats())
    deltas += await collect(stream)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert deltas[-1].num_output_tokens < 1000  # it did stop, long before the context was full
    assert idle(await client.stats())


async def test_an_idle_engine_gives_back_a_long_prompts_activation_memory(tmp_path: Path) -> None:
    """A prompt's big activations wait in the C++ kernels' pool between steps; once the engine has run nothing
    for IDLE_SECONDS it frees them (memory.py), and says so in its log. On a GGUF model: the C++ layer loop."""
    from chatapp.engine.memory import IDLE_SECONDS
    from tests.gguf_models import write_llama_gguf

    model = write_llama_gguf(tmp_path / "tiny-q8.gguf")  # hidden 256: a 1500-token prompt's gate/up is 6 MB
    c = await AsyncEngineClient.connect(EngineConfig(model=str(model)), runtime_dir=tmp_path / "rt")
    try:
        assert c.log_path is not None
        said = "of activation memory"
        await collect(c.generate(" ".join(["word"] * 1500), SamplingParams(temperature=0, max_tokens=1)))
        assert idle(await c.stats())
        deadline = time.monotonic() + IDLE_SECONDS + 30  # a correctness bound (it never came), not a speed check
        while said not in c.log_path.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        gave_back = [line for line in c.log_path.read_text().splitlines() if said in line]
        assert len(gave_back) == 1 and "gave back" in gave_back[0], gave_back
        mib = float(gave_back[0].split("gave back ")[1].split(" MiB")[0])
        assert mib >= 6, gave_back  # at least the gate/up block
    finally:
        await c.close()


async def test_aclose_aborts(client: AsyncEngineClient) -> None:
    stream = client.generate("Count forever:", LONG)
    await anext(stream)
    assert (await client.stats()).num_running == 1
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


async def test_stop_string_is_found_client_side_and_aborted(
    client: AsyncEngineClient, reference: dict[str, Any]
) -> None:
    prompt = PROMPTS[0]
    text, ids = reference[prompt]
    assert len(ids) == MAX_TOKENS  # no EOS early on: with ignore_eos the first tokens are the same
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, stop=stop)
    deltas = await collect(client.generate(prompt, params))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]
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


# -- 5. a second client shares the engine; the socket is private ------------------------------


async def test_second_client_attaches_to_the_same_engine(client: AsyncEngineClient, tiny_model: Path) -> None:
    assert client.spawned_engine
    second = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)))
    try:
        assert second.engine_pid == client.engine_pid and not second.spawned_engine
        assert second.model_info == client.model_info
        assert (await second.stats()).num_clients == 2
        deltas = await collect(second.generate("Hi", SamplingParams(temperature=0, max_tokens=4)))
        assert deltas[-1].finished
    finally:
        await second.close()
    assert (await client.stats()).num_clients == 1  # the spawner's engine outlives the second client
    assert client.log_path is not None
    loads = [
        line
        for line in client.log_path.read_text().splitlines()
        if f" {client.engine_pid} INFO chatapp.engine.core: engine ready" in line
    ]
    assert len(loads) == 1  # one model load for both clients

    runtime = paths.runtime_dir()
    record = ipc.read_record(runtime)
    assert record is not None and record.pid == client.engine_pid
    sock_path = Path(record.socket.removeprefix("ipc://"))
    assert sock_path.parent == runtime
    assert stat.S_ISSOCK(sock_path.stat().st_mode)
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE((runtime / ipc.DISCOVERY_FILE).stat().st_mode) == 0o600


async def test_calls_and_streams_racing_a_close_end_instead_of_waiting_forever(
    client: AsyncEngineClient, tiny_model: Path
) -> None:
    """A call or stream begun at any moment of close() ends, with its answer or EngineDeadError.

    (One sent while the bye was on its way, or while the receiver was being stopped, waited forever: the
    TUI's status poll did so as the app quit, and the app never exited.)"""
    second = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)))
    first_delta = asyncio.Event()

    async def read_forever() -> None:
        async for _ in second.generate("Count forever:", LONG):
            first_delta.set()

    late: list[asyncio.Task[Any]] = [asyncio.create_task(read_forever())]
    await first_delta.wait()
    closing = asyncio.create_task(second.close())
    while not closing.done():  # one call and one stream begun at every turn of the loop until closed
        late.append(asyncio.create_task(second.stats()))
        late.append(asyncio.create_task(collect(second.generate("Hi", SamplingParams(max_tokens=4)))))
        await asyncio.sleep(0)
    assert len(late) > 5  # the close took several turns: calls did race it
    _, pending = await asyncio.wait(late, timeout=30)  # a correctness deadline: a hang leaves them pending
    assert not pending
    for task in late:
        error = task.exception()
        assert error is None or isinstance(error, EngineDeadError), repr(error)
    assert isinstance(late[0].exception(), EngineDeadError)  # the stream running when close began
    assert idle(await wait_for_stats(client, idle_with_one_client, within=10))


async def test_other_model_attaches_or_refuses_as_asked(client: AsyncEngineClient, tiny_llama: Path) -> None:
    other = EngineConfig(model=str(tiny_llama))
    with pytest.raises(EngineModelMismatchError, match="serves"):
        await AsyncEngineClient.connect(other, on_model_mismatch="error")
    attached = await AsyncEngineClient.connect(other)
    try:
        assert attached.engine_pid == client.engine_pid
        assert attached.model_info.name == client.model_info.name
        assert attached.model_mismatch is not None and str(tiny_llama) in attached.model_mismatch
    finally:
        await attached.close()


# -- 4. a client process that dies never leaves requests behind ---------------------------------


async def test_killed_client_process_has_its_requests_aborted(client: AsyncEngineClient, tiny_model: Path) -> None:
    proc, hello = await start_script({"mode": "stream", "config": engine_config(tiny_model), "num_requests": 2})
    assert hello["attached"] == client.engine_pid
    assert proc.stdout is not None
    assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) == {"streaming": 2}
    busy = await client.stats()
    assert busy.num_running == 2 and busy.kv_blocks_used > 0 and busy.num_clients == 2
    proc.kill()
    await proc.wait()
    stats = await wait_for_stats(client, idle_with_one_client, within=ipc.CLIENT_TIMEOUT_S + 2)
    assert idle(stats) and stats.num_clients == 1, stats


async def test_frozen_client_is_dropped_after_the_heartbeat_timeout(
    client: AsyncEngineClient, tiny_model: Path
) -> None:
    proc, _ = await start_script({"mode": "stream", "config": engine_config(tiny_model), "num_requests": 1})
    assert proc.stdout is not None
    await asyncio.wait_for(proc.stdout.readline(), 30)
    proc.send_signal(signal.SIGSTOP)  # alive (its pid stays) but silent: only the heartbeat timeout finds it
    try:
        stopped = time.monotonic()
        assert (await client.stats()).num_running == 1
        stats = await wait_for_stats(client, idle_with_one_client, within=ipc.CLIENT_TIMEOUT_S + 3)
        assert idle(stats) and stats.num_clients == 1, stats
        assert time.monotonic() - stopped >= ipc.CLIENT_TIMEOUT_S - 1  # it was the timeout, not the pid check
    finally:
        proc.kill()
        proc.send_signal(signal.SIGCONT)
        await proc.wait()


# -- the engine survives bad input ----------------------------------------------------------------


async def test_malformed_messages_get_errors_and_do_not_hurt_the_engine(client: AsyncEngineClient) -> None:
    import zmq
    import zmq.asyncio

    record = ipc.read_record(paths.runtime_dir())
    assert record is not None
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(record.socket)
    encoder, decoder = ipc.client_codec()
    try:
        await sock.send(b"\x93not msgpack of ours")
        await sock.send_multipart([b"two", b"frames"])
        await sock.send(encoder.encode(ipc.AddRequest("bad-params", [1, 2, 3], {"temperature": -1})))
        await sock.send(encoder.encode(ipc.AddRequest("bad-field", [1, 2, 3], {"no_such_field": 1})))
        await sock.send(encoder.encode(ipc.AddRequest("bad-ids", [10**9], {"max_tokens": 2})))
        await sock.send(encoder.encode(ipc.EmbedCall(7, [[]])))
        errors: dict[str, str] = {}
        reply = None
        while len(errors) < 3 or reply is None:
            msg = decoder.decode(await asyncio.wait_for(sock.recv(), 10))
            if isinstance(msg, ipc.Outputs):
                for out in msg.outputs:
                    assert out.finish_reason == "error"
                    errors[out.request_id] = out.error
            elif isinstance(msg, ipc.Reply):
                reply = msg
        assert "temperature" in errors["bad-params"] and "no_such_field" in errors["bad-field"]
        assert "token ids" in errors["bad-ids"]
        assert reply.call_id == 7 and reply.error_kind == "invalid"
        await sock.send(encoder.encode(ipc.Bye()))
    finally:
        sock.close()
        ctx.term()
    deltas = await collect(client.generate("Still alive?", SamplingParams(temperature=0, max_tokens=3)))
    assert deltas[-1].finish_reason == "length"
    assert idle(await wait_for_stats(client, idle_with_one_client, within=5))


async def test_embed(client: AsyncEngineClient) -> None:
    vectors = await client.embed(["hello world", [1, 2, 3], "hello world"])
    assert len(vectors) == 3 and vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    with pytest.raises(InvalidRequestError) as err:
        await client.embed(["fine", ""])
    assert err.value.param == "input"
    assert idle(await client.stats())


# -- 3. engine death, restart, model switch: on a private engine ------------------------------


@pytest.fixture(scope="module")
def private_runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rt")


async def test_killed_engine_fails_every_client_fast_and_restarts(tiny_model: Path, private_runtime: Path) -> None:
    config = EngineConfig(**engine_config(tiny_model))
    first = AsyncEngineClient(config, runtime_dir=private_runtime)
    second = AsyncEngineClient(config, runtime_dir=private_runtime)
    seen: list[str] = []
    first.add_state_listener(lambda state, detail: seen.append(state))
    await asyncio.gather(first.start(), second.start())  # racing to an empty runtime dir: one engine
    assert seen[0] == "starting" and "loading" in seen and seen[-1] == "ready"
    assert second.engine_pid == first.engine_pid and first.spawned_engine != second.spawned_engine
    if second.spawned_engine:
        first, second = second, first
    try:
        started = [asyncio.Event(), asyncio.Event()]
        failed_at: list[float] = []

        async def read(c: AsyncEngineClient, event: asyncio.Event) -> None:
            try:
                async for _ in c.generate("Count forever:", LONG):
                    event.set()
            except EngineDeadError:
                failed_at.append(time.monotonic())
                raise

        tasks = [asyncio.create_task(read(c, e)) for c, e in zip((first, second), started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        old_pid = first.engine_pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGSTOP)  # so the call below is surely still pending when the engine dies
        pending_call = asyncio.create_task(second.stats())
        await asyncio.sleep(0.2)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, pending_call, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert len(failed_at) == 2 and max(failed_at) - killed < 2.0  # the fault-detection bound of the issue
        assert first.state is second.state is EngineState.DEAD  # the typed state, not a bare string
        with pytest.raises(EngineDeadError):
            await first.stats()
        with pytest.raises(EngineDeadError):
            await anext(first.generate("hi"))

        await first.restart()
        assert first.state is EngineState.READY and first.spawned_engine and first.engine_pid != old_pid
        await second.restart()
        assert second.engine_pid == first.engine_pid and not second.spawned_engine
        for c in (first, second):
            deltas = await collect(c.generate("Hello again", SamplingParams(temperature=0, max_tokens=5)))
            assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 5
    finally:
        await second.close()
        await first.close()
    assert first.state is EngineState.CLOSED
    assert ipc.read_record(private_runtime) is None  # the engine left with its last client


async def test_switch_model_reaches_every_client(tiny_model: Path, tiny_llama: Path, private_runtime: Path) -> None:
    config = EngineConfig(**engine_config(tiny_model))
    first = await AsyncEngineClient.connect(config, runtime_dir=private_runtime)
    second = await AsyncEngineClient.connect(config, runtime_dir=private_runtime)
    states: list[tuple[str, str]] = []

    async def watch() -> None:
        async for item in second.state_changes():
            states.append(item)

    watcher = asyncio.create_task(watch())
    try:
        running = second.generate("Count forever:", LONG)
        await anext(running)
        with pytest.raises(InvalidRequestError) as err:
            await first.switch_model(str(tiny_model.parent / "no-such-model"))
        assert err.value.param == "model"
        assert (await first.stats()).num_running == 1  # a bad name ends nothing

        switch = asyncio.create_task(first.switch_model(str(tiny_llama)))
        while second.state != "loading":
            await asyncio.sleep(0.01)
        with pytest.raises(EngineBusyError, match="not ready"):
            await anext(second.generate("hi"))
        info = await switch
        assert info.name == tiny_llama.name and info.max_model_len == 2048
        rest = await collect(running)
        assert rest[-1].finish_reason == "error" and "switching" in (rest[-1].error or "")
        assert first.model_info == info  # the caller has the new tokenizer when switch_model returns
        deadline = time.monotonic() + 10  # the other client follows as soon as it has read the broadcast
        while second.model_info != info and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert second.model_info == info and second.state == "ready"
        assert second.tokenizer is not None and second.tokenizer is not first.tokenizer
        assert [s for s, _ in states].count("loading") >= 1
        llm = LLM(str(tiny_llama), num_kv_blocks=1024, max_num_seqs=32)
        expected = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        deltas = await collect(second.generate("Hello", SamplingParams(temperature=0, max_tokens=8)))
        assert "".join(d.text for d in deltas) == expected
        assert idle(await first.stats())
    finally:
        await first.close()
        await second.close()
        await asyncio.wait_for(watcher, 5)
    assert states[-1][0] == "closed"


async def test_a_model_that_cannot_load_fails_start_clearly(tmp_path_factory: pytest.TempPathFactory) -> None:
    runtime = tmp_path_factory.mktemp("rt-bad")
    c = AsyncEngineClient(EngineConfig(model=str(runtime / "missing-model")), runtime_dir=runtime)
    with pytest.raises(InvalidRequestError, match="missing-model") as err:
        await c.start()
    assert err.value.param == "model" and c.state == "dead"
    await c.close()  # reaps the engine, which left once it had told its spawner why
    assert c.spawned_engine and ipc.read_record(runtime) is None


async def test_engine_outlives_the_process_that_spawned_it(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    runtime = tmp_path_factory.mktemp("rt-life")
    spawner, hello = await start_script({"mode": "exit", "config": engine_config(tiny_model)}, runtime)
    assert hello["spawned"]
    c = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)), runtime_dir=runtime)
    assert c.engine_pid == hello["attached"] and not c.spawned_engine
    try:
        assert spawner.stdin is not None
        spawner.stdin.write(b"exit\n")
        assert await asyncio.wait_for(spawner.wait(), 30) == 0
        stats = await wait_for_stats(c, lambda s: s.num_clients == 1, within=ipc.CLIENT_TIMEOUT_S + 2)
        assert stats.num_clients == 1 and stats.engine_pid == c.engine_pid
        deltas = await collect(c.generate("Still here", SamplingParams(temperature=0, max_tokens=4)))
        assert deltas[-1].finish_reason == "length" and c.state == "ready"
        record = ipc.read_record(runtime)
        assert record is not None and record.pid == c.engine_pid
    finally:
        await c.close()
    deadline = time.monotonic() + 10
    while record.process() is not None and time.monotonic() < deadline:  # the last client left: it exits
        await asyncio.sleep(0.05)
    assert record.process() is None and ipc.read_record(runtime) is None


async def test_a_damaged_gguf_file_fails_the_switch_and_the_engine_goes_on(
    tiny_model: Path, tmp_path: Path, private_runtime: Path
) -> None:
    """Switching the shared engine to a truncated GGUF file answers with an error naming the
    tensor, and the engine comes back on the model it had: other clients keep their engine."""
    from tests.gguf_models import write_llama_gguf

    whole = write_llama_gguf(tmp_path / "whole.gguf", mix="Q4_K", seed=1)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    config = EngineConfig(**engine_config(tiny_model))
    client = await AsyncEngineClient.connect(config, runtime_dir=private_runtime)
    try:
        before = client.model_info
        with pytest.raises(InvalidRequestError, match=r"cut\.gguf is truncated: tensor [\w.]+ ends past the end"):
            await client.switch_model(str(cut))
        deadline = time.monotonic() + 120
        while client.state != "ready" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert client.state == "ready"
        assert (client.model_info.name, client.model_info.path) == (before.name, before.path)  # reloaded
        deltas = await collect(client.generate("Hello", SamplingParams(temperature=0, max_tokens=4)))
        assert deltas[-1].finish_reason == "length"
    finally:
        await client.close()


# -- 4. an engine started ahead of its client (prestart.py) ---------------------------------------


async def test_a_prestarted_engine_is_the_one_the_client_spawns(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    runtime = tmp_path_factory.mktemp("rt-pre")
    os.chmod(runtime, 0o700)
    waiting = prestart.start(runtime)
    assert waiting is not None and prestart.start(runtime) is None  # one at a time
    c = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)), runtime_dir=runtime)
    try:
        assert c.spawned_engine and c.engine_pid == waiting.pid
        deltas = [d async for d in c.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
        assert sum(len(d.token_ids) for d in deltas) == 4
    finally:
        await c.close()
    assert await asyncio.to_thread(waiting.wait, 60) == 0


async def test_a_prestarted_engine_leaves_when_the_client_attaches_to_a_running_one(
    client: AsyncEngineClient, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert prestart.start(paths.runtime_dir()) is None  # an engine runs there: nothing is started
    runtime = tmp_path_factory.mktemp("rt-pre2")
    os.chmod(runtime, 0o700)
    waiting = prestart.start(runtime)
    assert waiting is not None
    # A client of the running engine (another runtime directory) finds its record and attaches:
    # the waiting engine is let go, exits on its closed stdin and never writes a record.
    other = await AsyncEngineClient.connect(EngineConfig(**engine_config(tiny_model)))
    try:
        assert not other.spawned_engine
        deadline = time.monotonic() + 60  # gone, not a zombie: the client reaps it without being asked
        # Its reaper thread records the exit status just after the pid is gone: wait for both.
        while (psutil.pid_exists(waiting.pid) or waiting.returncode is None) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not psutil.pid_exists(waiting.pid) and waiting.returncode == 0
        assert ipc.read_record(runtime) is None
    finally:
        await other.close()


async def test_prestart_names_the_files_ipc_does() -> None:
    assert (prestart.DISCOVERY_FILE, prestart.LOCK_FILE, prestart.LOG_FILE) == (
        ipc.DISCOVERY_FILE,
        ipc.LOCK_FILE,
        ipc.LOG_FILE,
    )


async def test_a_prestart_keeps_one_previous_engine_log(tmp_path: Path) -> None:
    (tmp_path / ipc.LOG_FILE).write_bytes(b"x" * (5 * 2**20 + 1))
    lock = ipc.DiscoveryLock(tmp_path)  # another client spawning: its engine's log is left alone
    assert lock.try_acquire()
    waiting = prestart.start(tmp_path)
    lock.release()
    assert waiting is not None
    prestart.dismiss()
    assert await asyncio.to_thread(waiting.wait, 60) == 0
    assert not (tmp_path / f"{ipc.LOG_FILE}.1").exists()
    waiting = prestart.start(tmp_path)
    assert waiting is not None
    prestart.dismiss()
    assert await asyncio.to_thread(waiting.wait, 60) == 0
    assert (tmp_path / f"{ipc.LOG_FILE}.1").stat().st_size == 5 * 2**20 + 1
    assert (tmp_path / ipc.LOG_FILE).stat().st_size < 2**20  # a fresh log for the new engine


@pytest.mark.parametrize("kernels_off", [False, True])
async def test_a_prestarted_engine_makes_the_cpu_load_path_ready_while_it_waits(
    tmp_path: Path, kernels_off: bool
) -> None:
    """While it waits for its config, a prestarted engine loads torch's C++ libraries (not its Python
    module) and imports the CPU load path, so a load starts without them; none of it when the C++
    kernels are turned off, or where a GPU may serve instead."""
    script = """
import io, json, sys
from chatapp.engine import launch
sys.stdin = io.TextIOWrapper(io.BytesIO(b""))  # no config comes: main returns once its waiting is done
assert launch.main(["--config-stdin", "--runtime-dir", sys.argv[1]]) == 0
maps = open("/proc/self/maps").read()
print(json.dumps({"libtorch_cpu": "libtorch_cpu.so" in maps, "torch": "torch" in sys.modules,
                  "load_path": all(m in sys.modules for m in ("chatapp.engine.array_runner", "numpy.random"))}))
"""
    env = {k: v for k, v in os.environ.items() if k != "CHATAPP_NO_CPU_KERNELS"}
    if kernels_off:
        env["CHATAPP_NO_CPU_KERNELS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    from chatapp.engine.config import no_gpu_here

    assert json.loads(done.stdout) == {
        "libtorch_cpu": not kernels_off and no_gpu_here(),
        "torch": False,
        "load_path": True,
    }


_SLOW_TO_LOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int saw_go = 0;
/* Runs inside dlopen, as libtorch_cpu's initializers do: says it started, then waits up to 10 s for "go". */
__attribute__((constructor)) static void wait_for_go(void) {
  const char* dir = getenv("CHATAPP_TEST_LOAD_DIR");
  char path[4096];
  if (!dir) return;
  snprintf(path, sizeof path, "%s/started", dir);
  fclose(fopen(path, "w"));
  snprintf(path, sizeof path, "%s/go", dir);
  for (int i = 0; i < 1000; ++i) {
    if (access(path, F_OK) == 0) { saw_go = 1; return; }
    usleep(10000);
  }
}
"""


async def test_the_torch_preload_leaves_the_interpreter_free_while_a_library_loads(tmp_path: Path) -> None:
    """The preload's dlopen lets go of the interpreter's lock (ctypes.CDLL holds it on Python 3.11): the
    engine reads its config and the model's header while libtorch_cpu's initializers run (~0.17 s). Shown
    with a library whose initializer waits for a file that only Python on the main thread writes."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds the CPU kernels at install; none found"
    source, lib = tmp_path / "slow.c", tmp_path / "libslow.so"
    source.write_text(_SLOW_TO_LOAD_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True, capture_output=True)
    script = """
import ctypes, os, sys, threading, time
from pathlib import Path
from chatapp.engine import cpu_kernels
lib, here = Path(sys.argv[1]), Path(sys.argv[2])
loading = threading.Thread(target=cpu_kernels._dlopen_releasing_the_interpreter, args=(lib,))
loading.start()
deadline = time.monotonic() + 30
while not (here / "started").exists() and time.monotonic() < deadline:
    time.sleep(0.005)  # Python runs here only while the loading thread does not hold the interpreter
(here / "go").touch()
loading.join()
print(ctypes.c_int.in_dll(ctypes.CDLL(str(lib)), "saw_go").value)
"""
    env = {**os.environ, "CHATAPP_TEST_LOAD_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(lib), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", "the library's initializer ran out its wait: the interpreter stood still"


ENGINE_ENTRIES = {
    # the engine process: no config comes, so main returns once the engine is imported
    "process": """
import io, sys
from chatapp.engine import launch
sys.stdin = io.TextIOWrapper(io.BytesIO(b""))
assert launch.main(["--config-stdin", "--runtime-dir", sys.argv[1]]) == 0
""",
    # the offline API in a user's process
    "LLM": """
from chatapp.engine import LLM
""",
}


@pytest.mark.parametrize("entry", sorted(ENGINE_ENTRIES))
async def test_the_engine_holds_numpys_openblas_to_one_thread_and_leaves_the_environment_alone(
    tmp_path: Path, entry: str
) -> None:
    script = (
        ENGINE_ENTRIES[entry]
        + """
import ctypes, glob, os, sys
import numpy
assert "OPENBLAS_NUM_THREADS" not in os.environ  # a torch built with OpenBLAS keeps its threads
libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "*openblas*"))
lib = ctypes.CDLL(libs[0])
names = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")
print(next(getattr(lib, n)() for n in names if hasattr(lib, n)))
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
