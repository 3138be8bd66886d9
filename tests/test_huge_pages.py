"""Packed weights carved from one arena and moved into 2 MB pages after loading (huge_pages.py): slices
zeroed, page-aligned and apart; the collapse really makes huge pages on a kernel that has MADV_COLLAPSE,
never changes a byte, and stops once the model is gone; an engine's answers do not depend on it."""

from __future__ import annotations

import gc
import os
import re
import weakref
from pathlib import Path

import numpy as np
import pytest

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.huge_pages import (
    BUSY_PAGE_INTERVAL_S,
    ENGINE_STEPS,
    HUGE_PAGE,
    IDLE_AFTER_S,
    SLICE_ALIGN,
    Pacer,
    StepActivity,
    WeightArena,
    collapse,
    wait_for_collapses,
)
from tests.gguf_models import write_llama_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def kernel_has_collapse() -> bool:
    """MADV_COLLAPSE came with Linux 6.1."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (6, 1)


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_slices_are_zeroed_page_aligned_and_apart_and_overflow_gets_its_own_mapping() -> None:
    arena = WeightArena(3 * HUGE_PAGE)
    shapes = [(5, 7, 100), (1000,), (3, 4096)]
    slices = [arena.zeros(s) for s in shapes]
    starts = [a.ctypes.data for a in slices]
    assert starts[0] % HUGE_PAGE == 0  # the first slice opens a 2 MB page
    assert all((p - starts[0]) % SLICE_ALIGN == 0 for p in starts)
    for a, b in zip(slices, slices[1:]):
        assert a.ctypes.data + a.nbytes <= b.ctypes.data
    for a, shape in zip(slices, shapes):
        assert a.shape == shape and a.dtype == np.uint8 and not a.any()
        a[...] = 7  # writable, and writing one leaves the others alone
    assert all((a == 7).all() for a in slices)
    inside = arena.address <= slices[-1].ctypes.data < arena.address + len(arena.mapping())
    assert inside
    big = arena.zeros((4 * HUGE_PAGE,))  # past the capacity: a mapping of its own
    assert not (arena.address <= big.ctypes.data < arena.address + len(arena.mapping()))
    assert big.nbytes == 4 * HUGE_PAGE and not big.any()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_collapse_makes_huge_pages_of_the_weights_without_changing_a_byte() -> None:
    arena = WeightArena(5 * HUGE_PAGE)
    weights = arena.zeros((3 * HUGE_PAGE + 12345,))
    weights[...] = np.random.default_rng(0).integers(0, 256, weights.size, dtype=np.uint8)
    before = weights.copy()
    address, length = arena.huge_page_span()
    assert (address, length) == (weights.ctypes.data, 3 * HUGE_PAGE)  # the partial 4th page stays small
    report = collapse(weakref.ref(arena.mapping()), address, length)
    assert report.pages == 3
    if kernel_has_collapse():
        assert (report.collapsed, report.stopped) == (3, None)
        assert huge_kb_at(address) >= 3 * HUGE_PAGE // 1024
    else:
        assert report.collapsed == 0 and "does not collapse" in (report.stopped or "")
    np.testing.assert_array_equal(weights, before)


def test_collapse_stops_once_the_model_is_unloaded() -> None:
    arena = WeightArena(2 * HUGE_PAGE)
    arena.zeros((HUGE_PAGE,))[...] = 1
    address, length = arena.huge_page_span()
    mapping = weakref.ref(arena.mapping())
    del arena
    gc.collect()
    report = collapse(mapping, address, length)
    assert (report.collapsed, report.stopped) == (0, "the model was unloaded")


class FakeEngine:
    """An engine's idle signal on a fake clock: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.step_end: float | None = None  # None: stepping
        self.slept: list[float] = []

    def idle_seconds(self) -> float:
        return 0.0 if self.step_end is None else self.now - self.step_end

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_pacer_lets_pages_go_at_once_while_the_engine_idles_and_one_per_interval_while_it_computes() -> None:
    engine = FakeEngine()
    engine.step_end = engine.now - IDLE_AFTER_S  # idle long enough
    pacer = Pacer(engine.idle_seconds, clock=lambda: engine.now, sleep=engine.sleep)
    for _ in range(5):
        pacer.wait()
    assert engine.slept == []  # idle: page after page
    engine.step_end = None  # a step runs (and keeps running)
    start = engine.now
    pacer.wait()
    assert engine.now - start == pytest.approx(BUSY_PAGE_INTERVAL_S, abs=0.03)
    pacer.wait()
    assert engine.now - start == pytest.approx(2 * BUSY_PAGE_INTERVAL_S, abs=0.06)
    engine.step_end = engine.now  # the step just ended: not idle yet, but a page is due soon
    before = engine.now
    pacer.wait()
    assert 0 < engine.now - before <= BUSY_PAGE_INTERVAL_S + 0.03


def test_step_activity_is_busy_while_any_models_step_runs() -> None:
    now = [10.0]
    steps = StepActivity(clock=lambda: now[0])
    now[0] = 11.0
    assert steps.idle_seconds() == 1.0
    with steps.step():  # model A's step
        assert steps.idle_seconds() == 0.0
        with steps.step():  # model B's, beside it
            now[0] = 12.0
        assert steps.idle_seconds() == 0.0  # A still runs
        now[0] = 13.0
    now[0] = 13.5
    assert steps.idle_seconds() == 0.5
    with pytest.raises(RuntimeError), steps.step():  # a step that fails still ends
        raise RuntimeError
    now[0] = 14.0
    assert steps.idle_seconds() == 0.5


def test_the_engine_reads_as_busy_while_a_model_steps(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", mix="Q8_0", seed=1)
    llm = LLM(str(path), kv_cache_memory_gib=0.02, runner="array", huge_pages=False)
    runner = llm.core.runner
    seen: list[float] = []
    forward = runner._forward

    def watched(flat: object) -> object:
        seen.append(ENGINE_STEPS.idle_seconds())
        return forward(flat)

    runner._forward = watched
    llm.generate(["Hello"], GREEDY)
    llm.core.embed([[1, 2, 3, 4]])  # embeddings run a forward too
    assert len(seen) == GREEDY.max_tokens + 1 and all(s == 0.0 for s in seen)
    assert 0.0 < ENGINE_STEPS.idle_seconds() < 5.0


def test_an_engines_weights_go_into_huge_pages_and_its_answers_stay_the_same(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny-Q4_K_M.gguf", mix="Q4_K_M", seed=5)  # a 10 MB Q6_K output head
    prompts = ["The capital of France is", "Once upon a time"]
    small = LLM(str(path), kv_cache_memory_gib=0.02, runner="array", huge_pages=False)
    expected = [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)]
    del small
    llm = LLM(str(path), kv_cache_memory_gib=0.02, runner="array")
    assert wait_for_collapses(120)
    arena = llm.core.runner.weight_arena
    head_start, span = arena.huge_page_span()
    assert span >= 4 * HUGE_PAGE
    if kernel_has_collapse():
        assert huge_kb_at(head_start) >= span // 1024
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
