"""Several models in one engine process (issue 19), on tiny random models.

Each model has its own EngineCore (runner, KV pool, scheduler) in the one engine process; a request
names its model, which is loaded on demand within the engine's memory budget.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.api import EngineStats, InvalidRequestError
from chatapp.engine.client import AsyncEngineClient
from chatapp.engine.config import EngineConfig
from chatapp.engine.model_pool import WORKING_BYTES, MemoryBudget, ModelDoesNotFitError, ModelSlot
from chatapp.engine.output_processor import OutputDelta

pytestmark = pytest.mark.timeout(120)
on_one_engine = pytest.mark.asyncio(loop_scope="module")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS: dict[str, Any] = {"num_kv_blocks": 512, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three different tiny models: a (the engine's default), b and c (loaded on demand)."""
    from tests.tiny_model import make_tiny_model

    return {
        "a": make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=1, max_position_embeddings=65536),
        "b": make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=2, hidden_size=96, num_heads=6, num_kv_heads=3),
        "c": make_tiny_model(tmp_path_factory.mktemp("model-c"), seed=3, num_layers=3),
    }


@pytest.fixture(scope="module")
def alone(models: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """Greedy token ids of every prompt on each model alone (the offline LLM, in this process)."""
    ref = {}
    for key, path in models.items():
        llm = LLM(str(path), **OPTIONS)
        outs = llm.generate(PROMPTS, GREEDY)
        ref[key] = {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}
        del llm
        gc.collect()
    return ref


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(models: dict[str, Path], alone: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    c = await AsyncEngineClient.connect(
        EngineConfig(model=str(models["a"]), **OPTIONS), runtime_dir=tmp_path_factory.mktemp("runtime")
    )
    yield c
    await c.close()


async def collect(agen: Any) -> list[OutputDelta]:
    return [delta async for delta in agen]


def token_ids(deltas: list[OutputDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def wait_idle(c: AsyncEngineClient, within: float = 20.0) -> EngineStats:
    """Poll until nothing runs and every KV block is free (a deadline against hangs, not a speed check)."""
    deadline = time.monotonic() + within
    while True:
        stats = await c.stats()
        if (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


@on_one_engine
async def test_concurrent_streams_on_two_models_match_each_model_alone(
    client: AsyncEngineClient, models: dict[str, Path], alone: dict[str, dict[str, list[int]]]
) -> None:
    b = str(models["b"])
    jobs = [collect(client.generate(p, GREEDY)) for p in PROMPTS]  # the default model: a
    jobs += [collect(client.generate(p, GREEDY, model=b)) for p in PROMPTS]
    results = await asyncio.gather(*jobs)
    for prompt, deltas in zip(PROMPTS, results[: len(PROMPTS)]):
        assert token_ids(deltas) == alone["a"][prompt]
    for prompt, deltas in zip(PROMPTS, results[len(PROMPTS) :]):
        assert token_ids(deltas) == alone["b"][prompt]
    assert alone["a"] != alone["b"]  # two different models really answered

    statuses = await client.models()
    assert [(m.default, m.state) for m in statuses] == [(True, "ready"), (False, "ready")]
    assert statuses[1].info is not None and statuses[1].info.path == str(models["b"].resolve())
    assert statuses[1].footprint_bytes > WORKING_BYTES
    assert (await wait_idle(client)).kv_blocks_used == 0

    # A view narrows the client to one model: what a server route or a TUI pane holds.
    view = client.bind(b)
    await view.ready()
    assert view.model_info.path == str(models["b"].resolve())
    ids = token_ids(await collect(view.generate(PROMPTS[0], GREEDY)))
    assert ids == alone["b"][PROMPTS[0]]


@on_one_engine
async def test_a_model_loads_on_demand_while_the_other_streams(
    client: AsyncEngineClient, models: dict[str, Path], alone: dict[str, dict[str, list[int]]]
) -> None:
    """The load runs beside the loop: the default model's stream goes on producing tokens meanwhile."""
    events: list[tuple[float, str]] = []
    unsubscribe = client.add_model_listener(
        lambda spec, state, _detail: events.append((time.monotonic(), state)) if spec.endswith("model-c0") else None
    )
    arrivals: list[float] = []
    long = SamplingParams(temperature=0, max_tokens=60_000, ignore_eos=True)
    stream = client.generate(PROMPTS[0], long)
    first = await stream.__anext__()
    arrivals.append(time.monotonic())
    assert not first.finished

    async def read() -> None:
        async for _delta in stream:
            arrivals.append(time.monotonic())

    reader = asyncio.create_task(read())
    c_answer = await collect(client.generate(PROMPTS[1], GREEDY, model=str(models["c"])))
    loading = next(t for t, s in events if s == "loading")
    ready = next(t for t, s in events if s == "ready")
    during = [t for t in arrivals if loading <= t <= ready]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if loading <= b <= ready]
    longest = max(gaps, default=0.0)
    print(f"load took {ready - loading:.3f} s; {len(during)} deltas arrived meanwhile; longest gap {longest:.3f} s")
    assert len(during) >= 2, "the default model's stream stalled while another model loaded"
    assert token_ids(c_answer) == alone["c"][PROMPTS[1]]
    reader.cancel()  # cancelling the reader closes the stream, which aborts the request
    await asyncio.gather(reader, return_exceptions=True)
    unsubscribe()
    assert (await wait_idle(client)).kv_blocks_used == 0


@on_one_engine
async def test_a_model_that_cannot_load_fails_only_its_own_requests(
    client: AsyncEngineClient, tmp_path: Path, alone: dict[str, dict[str, list[int]]]
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    default_answer = asyncio.create_task(collect(client.generate(PROMPTS[2], GREEDY)))
    with pytest.raises(InvalidRequestError, match="could not load the model"):
        await collect(client.generate("hello", GREEDY, model=str(broken)))
    with pytest.raises(InvalidRequestError, match="model"):
        await client.load_model(str(tmp_path / "does-not-exist"))
    assert token_ids(await default_answer) == alone["a"][PROMPTS[2]]
    assert all(m.spec != str(broken) for m in await client.models())


@on_one_engine
async def test_lru_unload_under_a_budget_that_fits_one_model_beside_the_default(
    models: dict[str, Path], alone: dict[str, dict[str, list[int]]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Budget: the default model plus one more. Asking for c unloads b (idle, least recently used), and
    asking for b again unloads c; a model too big for the budget is refused with the figures."""
    probe = await AsyncEngineClient.connect(
        EngineConfig(model=str(models["a"]), **OPTIONS), runtime_dir=tmp_path_factory.mktemp("probe")
    )
    try:
        await probe.load_model(str(models["b"]))
        await probe.load_model(str(models["c"]))
        sizes = {Path(m.spec).name: m.footprint_bytes for m in await probe.models()}
    finally:
        await probe.close()
    a, b, c = sizes["model-a0"], sizes["model-b0"], sizes["model-c0"]
    budget_gib = (a + max(b, c) + min(b, c) // 2) / 2**30  # a and one of b, c; never all three

    client = await AsyncEngineClient.connect(
        EngineConfig(model=str(models["a"]), memory_gib=budget_gib, **OPTIONS),
        runtime_dir=tmp_path_factory.mktemp("budget"),
    )
    states: list[tuple[str, str]] = []
    client.add_model_listener(lambda spec, state, _d: states.append((Path(spec).name, state)))
    try:
        for key in ("b", "c", "b"):
            deltas = await collect(client.generate(PROMPTS[0], GREEDY, model=str(models[key])))
            assert token_ids(deltas) == alone[key][PROMPTS[0]]
            held = [Path(m.spec).name for m in await client.models()]
            assert held == ["model-a0", f"model-{key}0"]
        assert ("model-b0", "unloaded") in states and ("model-c0", "unloaded") in states
        assert token_ids(await collect(client.generate(PROMPTS[1], GREEDY))) == alone["a"][PROMPTS[1]]
        assert (await wait_idle(client)).kv_blocks_used == 0

        huge = tmp_path_factory.mktemp("huge-model")
        (huge / "config.json").write_text((models["b"] / "config.json").read_text())
        with open(huge / "model.safetensors", "wb") as f:
            f.truncate(int((budget_gib + 1) * 2**30))  # sparse: its size is what the budget reads
        with pytest.raises(InvalidRequestError, match="memory budget is"):
            await client.load_model(str(huge))
    finally:
        await client.close()


def _slot(name: str, footprint: int, idle: bool, last_used: float) -> ModelSlot:
    slot = ModelSlot(name, pinned=False, state="ready", footprint_bytes=footprint, last_used=last_used)
    slot.num_requests = 0 if idle else 1
    return slot


def test_budget_plan_unloads_least_recently_used_idle_models_and_waits_for_busy_ones() -> None:
    gib = 2**30
    budget = MemoryBudget(budget_gib=4.0, max_loaded=3)
    default = _slot("default", 1 * gib, idle=True, last_used=0.0)
    old, recent = _slot("old", 1 * gib, True, 1.0), _slot("recent", 1 * gib, True, 2.0)
    plan = budget.plan(int(1.2 * gib), [default, recent, old], None, keep=default)
    assert plan is not None and plan.evict == [old]  # the least recently used; never the default
    # Its KV pool may take what is left: the budget less the two models kept, its weights and working memory.
    assert plan.kv_cap_bytes == 4 * gib - 2 * gib - int(1.2 * gib) - WORKING_BYTES

    busy = _slot("busy", 2 * gib, idle=False, last_used=0.5)
    assert budget.plan(int(1.2 * gib), [default, busy], None, keep=default) is None  # wait for room
    with pytest.raises(ModelDoesNotFitError, match="memory budget is 4.00 GiB"):
        budget.plan(5 * gib, [default], None, keep=default)

    few = MemoryBudget(budget_gib=None, max_loaded=2)
    plan = few.plan(1, [default, recent, old], 123, keep=default)
    assert plan is not None and plan.evict == [old, recent] and plan.kv_cap_bytes == 123


@on_one_engine
async def test_a_model_loaded_on_demand_is_unloaded_after_keep_alive(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    client = await AsyncEngineClient.connect(
        EngineConfig(model=str(models["a"]), keep_alive_s=0.5, **OPTIONS),
        runtime_dir=tmp_path_factory.mktemp("keep-alive"),
    )
    unloaded = asyncio.Event()
    client.add_model_listener(lambda _spec, state, _d: unloaded.set() if state == "unloaded" else None)
    try:
        await collect(client.generate(PROMPTS[0], GREEDY, model=str(models["b"])))
        await asyncio.wait_for(unloaded.wait(), 30)  # a deadline against a hang, not a speed check
        assert [m.default for m in await client.models()] == [True]  # the default model stays
        # Asked for again, it loads again.
        assert await collect(client.generate(PROMPTS[0], GREEDY, model=str(models["b"])))
    finally:
        await client.close()
