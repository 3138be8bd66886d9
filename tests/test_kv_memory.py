"""The KV cache's type and size: float16 on the CPU by default, sized to the work, committed with use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatapp.engine import LLM, SamplingParams, model_runner
from chatapp.engine.config import EngineConfig
from chatapp.engine.model_runner import KV_CONTEXTS, _untouched_zeros
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kv") / "m", max_position_embeddings=512)


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))


def test_cpu_cache_is_float16_by_default_and_float32_on_request() -> None:
    cfg = EngineConfig(device="cpu").finalize(checkpoint_dtype=None, model_max_len=512)
    assert cfg.kv_cache_dtype == "float16"
    cfg = EngineConfig(device="cpu", kv_cache_dtype="fp32").finalize(checkpoint_dtype=None, model_max_len=512)
    assert cfg.kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(device="cpu", kv_cache_dtype="int3").finalize(checkpoint_dtype=None, model_max_len=512)
    with pytest.raises(ValueError, match="kv_cache_memory_gib must be more than 0"):
        EngineConfig(device="cpu", kv_cache_memory_gib=0).finalize(checkpoint_dtype=None, model_max_len=512)


def test_default_pool_holds_a_few_full_contexts_in_half_the_bytes(tiny: Path) -> None:
    llm = LLM(str(tiny), quantization=None)
    runner = llm.core.runner
    k, v = runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float16
    assert runner.num_blocks == KV_CONTEXTS * 512 // llm.config.block_size  # sized to the work, not to RAM
    assert llm.config.max_model_len == 512
    wide = LLM(str(tiny), quantization=None, kv_cache_dtype="float32", kv_cache_memory_gib=0.01)
    assert wide.core.runner.kv_caches[0][0].dtype == torch.float32
    assert wide.core.runner.bytes_per_block() == 2 * runner.bytes_per_block()
    assert wide.core.runner.num_blocks == int(0.01 * 2**30) // wide.core.runner.bytes_per_block()  # the user's cap
    # A half cache still answers like the float32 one on this model (greedy, same weights).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello there", "One, two, three, four"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in wide.generate(prompts, params)
    ]


def test_a_bfloat16_cache_on_the_cpu_runs_the_python_model_and_answers_as_float32(tiny: Path, tmp_path: Path) -> None:
    """Our C++ attention reads float16 and float32 caches; a bfloat16 one (kv_cache_dtype="bfloat16") takes
    the Python model's attention instead of failing at the first step, and follows the float32 cache's run
    within bfloat16's rounding (0.6% of the logits here; a wrong read would be off by their whole size)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    int8 = LLM(str(tiny), kv_cache_dtype="bfloat16", kv_cache_memory_gib=0.01)  # quantization="auto"
    assert int8.core.runner.cpu_forward is None and int8.config.quantization == "int8"  # our int8 kernels still
    assert all(len(o.outputs[0].token_ids) == 24 for o in int8.generate(["Hello there"], params))
    # A GGUF file keeps its own types (not de-quantised to float32, 7-9x its size).
    from tests.gguf_models import write_llama_gguf

    gguf = LLM(str(write_llama_gguf(tmp_path / "q4_k_m.gguf", mix="Q4_K_M")), kv_cache_dtype="bfloat16")
    assert gguf.config.quantization == "gguf" and gguf.core.runner.cpu_forward is None
    assert all(len(o.outputs[0].token_ids) == 24 for o in gguf.generate(["Hello there"], params))

    llm = LLM(str(tiny), quantization=None, kv_cache_dtype="bfloat16", kv_cache_memory_gib=0.01)
    runner = llm.core.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16 and runner.cpu_forward is None
    # The same Python model with a float32 cache: only the cache's rounding differs.
    wide = LLM(str(tiny), quantization=None, kv_cache_dtype="float32", kv_cache_memory_gib=0.01, cpu_kernels=False)
    # Logits, not tokens: this random model's top two differ by 0.3% after "One, two, three, four", and
    # bfloat16 swaps them.
    assert all(len(o.outputs[0].token_ids) == 24 for o in llm.generate(["One, two, three, four"], params))
    for out in wide.generate(["Hello there", "One, two, three, four"], params):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        a, b = wide.prompt_logits(ids), llm.prompt_logits(ids)
        assert float((a - b).norm() / a.norm()) < 0.02


def test_pool_is_held_to_the_memory_left_and_caps_the_context(tiny: Path, monkeypatch) -> None:
    """A long-context model on a small machine gets the context that fits, not an out-of-memory kill."""
    import psutil

    real = psutil.virtual_memory()
    probe = LLM(str(tiny), quantization=None, kv_cache_memory_gib=0.01)
    per_block = probe.core.runner.bytes_per_block()
    weights = probe.core.model_config.num_parameters() * 4  # float32
    spare_blocks = 10
    available = (
        weights + model_runner.WORKING_MEMORY_BYTES + int(spare_blocks * per_block / model_runner.KV_SHARE_OF_FREE)
    )

    class Small:
        def __getattr__(self, name):
            return getattr(real, name)

        @property
        def available(self) -> int:
            return available + per_block  # a little slack for rounding

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small())
    llm = LLM(str(tiny), quantization=None)
    assert spare_blocks <= llm.core.runner.num_blocks < KV_CONTEXTS * 512 // llm.config.block_size
    assert llm.config.max_model_len == llm.core.runner.num_blocks * llm.config.block_size < 512


def test_pool_memory_is_committed_only_where_written() -> None:
    before = _rss()
    pool = _untouched_zeros((64, 2**20), torch.float16)  # 128 MiB
    assert _rss() - before < 16 * 2**20
    pool[:16].fill_(1.0)  # 32 MiB written
    grown = _rss() - before
    assert 28 * 2**20 < grown < 48 * 2**20
    assert not pool[16:, ::2048].any() and pool.shape == (64, 2**20)  # the rest reads as zeros
    del pool


def test_context_and_cache_cap_come_from_the_command_line_over_settings(capsys) -> None:
    from chatapp.cli import build_parser
    from chatapp.settings import EngineSettings

    saved = EngineSettings(max_model_len=4096, kv_cache_memory_gib=3.0)
    pool = {"max_loaded_models": 3, "keep_alive_s": 300.0}  # the several-models defaults (issue 19)
    assert saved.options() == {"max_model_len": 4096, "kv_cache_memory_gib": 3.0, **pool}
    assert EngineSettings().options() == pool  # nothing else set: the engine sizes itself
    for argv in (
        ["serve", "--max-model-len", "8192", "--kv-cache-gib", "1.5", "--memory-gib", "12"],
        ["--max-model-len", "8192", "--kv-cache-gib", "1.5", "--memory-gib", "12", "serve"],
    ):
        args = build_parser().parse_args(argv)
        chosen = saved.options(
            max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_gib, memory_gib=args.memory_gib
        )
        assert chosen == {"max_model_len": 8192, "kv_cache_memory_gib": 1.5, "memory_gib": 12.0, **pool}
    args = build_parser().parse_args([])
    assert saved.options(max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_gib) == saved.options()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "0"])
    assert "must be more than 0" in capsys.readouterr().err
