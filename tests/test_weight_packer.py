"""A GGUF model's tiles packed after the engine is ready (weight_packer.py): the engine loads without them, a
step waits for them without blocking the loop, the model then computes exactly what an eagerly packed one does,
a failed packing fails every step with the file named, and an unloaded model's packing stops."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from chatapp.engine import LLM, SamplingParams, cpu_kernels
from chatapp.engine import huge_pages as huge_pages_module
from chatapp.engine.huge_pages import HUGE_PAGE, CollapseReport, WeightArena, collapse_in_background
from chatapp.engine.models.array_model import load_array_model
from chatapp.engine.models.gguf_file import GGUFModelFile
from chatapp.engine.weight_packer import PackingFailed, WeightPacker
from tests.gguf_models import write_llama_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("packer") / "tiny-Q4_K_M.gguf", mix="Q4_K_M", seed=11)


@pytest.fixture
def unstarted_packers(monkeypatch: pytest.MonkeyPatch) -> list[WeightPacker]:
    """Packers made while this fixture is active do not start on their own: the test starts them."""
    made: list[WeightPacker] = []
    monkeypatch.setattr(WeightPacker, "start", lambda self: made.append(self))
    return made


def forward_once(model, k_caches, v_caches) -> np.ndarray:
    """A 3-token prompt's final hidden states through ``model`` (one KV block of 16)."""
    tokens = np.array([17, 4000, 261], dtype=np.int64)
    return model.forward(
        tokens,
        np.arange(3),
        k_caches,
        v_caches,
        np.arange(3, dtype=np.int64),
        np.array([0, 3], dtype=np.int32),
        np.array([3], dtype=np.int32),
        np.zeros((1, 1), dtype=np.int32),
    )


def caches(mc) -> tuple[list[np.ndarray], list[np.ndarray]]:
    keys = [np.zeros((1, mc.num_kv_heads, mc.head_dim, 16), np.float32) for _ in range(mc.num_layers)]
    values = [np.zeros((1, 16, mc.num_kv_heads, mc.head_dim), np.float32) for _ in range(mc.num_layers)]
    return keys, values


def test_a_deferred_model_waits_for_its_tiles_and_then_computes_the_eager_models_bits(
    q4_k_m: Path, unstarted_packers: list[WeightPacker]
) -> None:
    ext = cpu_kernels.load()
    gguf = GGUFModelFile(q4_k_m)
    mc = gguf.model_config()
    eager = load_array_model(gguf, mc, 64, ext)
    assert eager.packer is None and unstarted_packers == []
    expected = forward_once(eager, *caches(mc))

    deferred = load_array_model(GGUFModelFile(q4_k_m), mc, 64, ext, defer_packing=True)
    (packer,) = unstarted_packers
    assert deferred.packer is packer and not packer.done
    result: list[np.ndarray] = []
    forward = threading.Thread(target=lambda: result.append(forward_once(deferred, *caches(mc))))
    forward.start()
    forward.join(0.5)
    assert forward.is_alive() and result == []  # nothing packed yet: the forward waits for the tiles
    thread = threading.Thread(target=_run_packer, args=(packer,))
    thread.start()
    forward.join(60)
    thread.join(60)
    assert packer.done and deferred.packer is None
    np.testing.assert_array_equal(result[0], expected)


def _run_packer(packer: WeightPacker) -> None:
    from chatapp.engine import weight_packer

    weight_packer._run(weakref.ref(packer))


def test_an_engine_is_ready_before_its_tiles_and_its_steps_wait_without_blocking(
    q4_k_m: Path, unstarted_packers: list[WeightPacker]
) -> None:
    eager = LLM(str(q4_k_m), kv_cache_memory_gib=0.02, runner="torch")  # packs as it loads
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)]
    del eager

    llm = LLM(str(q4_k_m), kv_cache_memory_gib=0.02, runner="array", huge_pages=False)
    (packer,) = unstarted_packers
    llm.core.add_request("early", llm.tokenizer.encode(PROMPTS[0]), GREEDY)
    steps: list[list] = []
    stepping = threading.Thread(target=lambda: steps.extend(llm.core.step() for _ in range(3)))
    stepping.start()
    stepping.join(30)  # each step gives the loop back within WEIGHTS_POLL_S, having computed nothing
    assert not stepping.is_alive() and steps == [[], [], []]
    assert [r.request_id for r in llm.core.scheduler.waiting] == ["early"] and not llm.core.scheduler.running
    llm.core.abort(["early"])
    thread = threading.Thread(target=_run_packer, args=(packer,))
    thread.start()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    thread.join(60)


def test_a_failed_packing_fails_every_forward_naming_the_file() -> None:
    def broken() -> None:
        raise ValueError("tensor blk.0.attn_q.weight: truncated")

    packer = WeightPacker([lambda: None, broken, lambda: pytest.fail("no job runs after a failure")], "model.gguf")
    packer.start().join(60)
    assert packer.done and packer.failed
    for _ in range(2):
        with pytest.raises(PackingFailed, match=r"packing the weights of model\.gguf failed: .*blk\.0\.attn_q"):
            packer.wait()


def test_an_unloaded_models_packing_stops_at_its_next_job() -> None:
    gate, ran = threading.Event(), []
    packer = WeightPacker([gate.wait, lambda: ran.append("second")], "model.gguf")
    thread = packer.start()
    del packer
    gc.collect()
    gate.set()
    thread.join(60)
    assert not thread.is_alive() and ran == []


def test_huge_pages_wait_for_the_packing_and_never_follow_a_failed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    collapsed: list[int] = []
    monkeypatch.setattr(huge_pages_module, "START_DELAY_S", 0.0)

    def fake_collapse(mapping, address: int, length: int, before_page) -> CollapseReport:
        collapsed.append(length)
        return CollapseReport(pages=length // HUGE_PAGE)

    monkeypatch.setattr(huge_pages_module, "collapse", fake_collapse)
    monkeypatch.setattr(huge_pages_module.os, "setpriority", lambda *a: None)  # keep the test's own thread's
    for fails in (False, True):
        arena = WeightArena(2 * HUGE_PAGE)
        arena.zeros((HUGE_PAGE,))
        gate = threading.Event()

        def last_job(gate: threading.Event = gate, fails: bool = fails) -> None:
            gate.wait()
            if fails:
                raise OSError("read error")

        packer = WeightPacker([last_job], "model.gguf")
        packer.start()
        collapser = collapse_in_background(arena, "model.gguf", None, packer)
        assert collapser is not None
        collapser.join(0.3)
        assert collapser.is_alive() and collapsed == []  # the tiles are not filled yet
        gate.set()
        collapser.join(60)
        assert not collapser.is_alive()
        assert collapsed == ([] if fails else [HUGE_PAGE])
        collapsed.clear()


_EXIT_WHILE_PACKING = """
import numpy as np
from chatapp.engine import cpu_kernels
from chatapp.engine.weight_packer import WeightPacker
ext = cpu_kernels.load()
raw = np.zeros((4096, 4096 // 32 * 34), dtype=np.uint8)  # Q8_0 rows, packed without the GIL
out = np.zeros((256, 128, 544), dtype=np.uint8)
def job():
    for _ in range(50):
        ext.repack_gguf_array(raw, 8, 4096, None, out)
packer = WeightPacker([job, job], "model.gguf")  # held, as a loaded model holds its packer
packer.start()
print("exiting", flush=True)
"""


def test_a_process_that_exits_while_a_model_packs_exits_cleanly() -> None:
    """Without the exit hook the packing thread came back from C++ into a finalized interpreter: the process
    aborted ("terminate called without an active exception"). Stopping at exit is no failure: nothing is
    logged as one (Python's last-resort handler prints warnings and errors to stderr here)."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_PACKING], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "exiting"), done.stderr[-2000:]
    assert "terminate" not in done.stderr
    assert "failed" not in done.stderr, done.stderr[-2000:]


class _PackingRunner:
    """A loaded model's runner whose weights are packed once ``packed`` is set."""

    def __init__(self) -> None:
        self.packed = threading.Event()

    def weights_ready(self, timeout_s: float) -> bool:
        return self.packed.wait(timeout_s)


def test_the_next_model_loads_only_once_the_last_ones_weights_are_packed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory a packing model will commit is not yet in use: a plan for the next model made meanwhile would
    count it as free. So the engine starts no load while a model packs."""
    from types import SimpleNamespace

    from chatapp.engine.config import EngineConfig
    from chatapp.engine.process import EngineServer

    server = EngineServer(EngineConfig(model="default"), tmp_path)
    try:
        runner = _PackingRunner()
        server.default.core = SimpleNamespace(runner=runner)  # type: ignore[assignment]
        server.default.state = "ready"
        queued = server._new_slot("other.gguf", pinned=False)
        queued.state = "queued"
        started: list[str] = []
        monkeypatch.setattr(server, "_try_start", lambda slot: started.append(slot.spec))
        server._manage_models()
        assert started == []
        runner.packed.set()
        server._manage_models()
        assert started == ["other.gguf"]
    finally:
        server.sock.close(0)
        server.ctx.term()
