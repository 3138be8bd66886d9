"""The torch-free CPU runner (array_runner.py) against the torch runner (model_runner.py) on GGUF files:
the same greedy tokens (batched, chunked, after a prefix hit and preemption), logprobs, prompt logits
and embeddings; model families' GGUF layouts; no torch in its process; clear refusals where it cannot
run; numpy RoPE tables equal to rope.py's; seeded sampling that repeats."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from chatapp.engine import LLM, SamplingParams, cpu_kernels
from chatapp.engine.models.rope import RotaryEmbedding
from chatapp.engine.models.rope_arrays import numpy_trig, rope_tables
from chatapp.engine.outputs import TokenLogprobs
from tests.gguf_models import write_hf_model_gguf, write_llama_gguf
from tests.test_model_families import GGUF_MODELS, randomise_norms
from tests.test_model_families import PROMPTS as FAMILY_PROMPTS
from tests.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
KV = 0.02  # GiB: a small pool, committed only as it fills
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away", "1 2 3"]
GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

# Synthetic Llama files (tests/gguf_models.py): K-quant mix, Q8_0 with tied embeddings, Q4_0, F16 projections
# (the float rows kernel reads them in the file) and F32 ones (the array model runs them as float32 layers).
LLAMA_FILES: dict[str, dict[str, Any]] = {
    "Q4_K_M": dict(mix="Q4_K_M", seed=5),
    "Q8_0-tied": dict(mix="Q8_0", tied=True, seed=1),
    "Q4_0": dict(mix="Q4_0", seed=2),
    "F16": dict(mix="F16", embed_type="Q8_0", seed=4),
    "F32": dict(mix="F32", embed_type="Q8_0", seed=4),
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("array-runner")


def llama_file(directory: Path, name: str) -> Path:
    """The synthetic file ``name`` of LLAMA_FILES, written once per module."""
    path = directory / f"tiny-{name}.gguf"
    if not path.exists():
        write_llama_gguf(path, **LLAMA_FILES[name])
    return path


@pytest.fixture(scope="module")
def q4_k_m(gguf_dir: Path) -> Path:
    return llama_file(gguf_dir, "Q4_K_M")


def engine(path: Path, runner: str, **overrides: Any) -> LLM:
    """An engine on ``path`` that runs on the runner asked for (checked)."""
    llm = LLM(str(path), kv_cache_memory_gib=KV, runner=runner, **overrides)
    expected = {"array": "ArrayRunner", "torch": "ModelRunner"}[runner]
    assert type(llm.core.runner).__name__ == expected
    return llm


def tokens(llm: LLM, prompts: list[str] | list[list[int]], params: SamplingParams = GREEDY_16) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# -- 1. greedy tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LLAMA_FILES))
def test_greedy_tokens_equal_the_torch_runners_batched_alone_and_chunked(
    gguf_dir: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each mix gives the torch runner's greedy tokens on the array runner: four prompts in one batch,
    each prompt alone, and the batch with prompts prefilled 3 tokens a step."""
    path = llama_file(gguf_dir, name)
    expected = tokens(engine(path, "torch"), PROMPTS)
    with caplog.at_level(logging.INFO, logger="chatapp.engine.models.gguf_weights"):
        array = engine(path, "array")
    assert array.config.quantization == "gguf"
    if name == "F32":  # its projections ran as float32 layers, not in a kernel's blocks
        assert "F32 is not a type our kernels run; de-quantised to float32" in caplog.text
    else:
        assert "de-quantised to float32" not in caplog.text
    assert tokens(array, PROMPTS) == expected
    assert [tokens(array, [p])[0] for p in PROMPTS] == expected
    assert tokens(engine(path, "array", max_num_batched_tokens=3), PROMPTS) == expected


def test_prefix_hits_and_preemption_keep_the_torch_runners_tokens(q4_k_m: Path) -> None:
    """A follow-up turn served from the prefix cache, and a pool so small requests are preempted and
    recomputed, give the torch runner's tokens; so does a float32 KV cache."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    torch_llm, array = engine(q4_k_m, "torch"), engine(q4_k_m, "array")
    first = torch_llm.generate([PROMPTS[2]], params)[0]
    follow_up = first.prompt_token_ids + first.outputs[0].token_ids + torch_llm.tokenizer.encode(" and then")
    expected = tokens(torch_llm, [follow_up], params)
    assert tokens(array, [PROMPTS[2]], params)[0] == first.outputs[0].token_ids
    again = array.generate([follow_up], params)[0]
    assert again.num_cached_tokens >= 2 * array.config.block_size
    assert [again.outputs[0].token_ids] == expected

    expected = tokens(torch_llm, PROMPTS, params)
    tight = engine(q4_k_m, "array", num_kv_blocks=6, block_size=16, max_num_batched_tokens=32)
    assert tokens(tight, PROMPTS, params) == expected
    assert tight.stats().num_preemptions > 0
    assert tokens(engine(q4_k_m, "array", kv_cache_dtype="float32"), PROMPTS, params) == tokens(
        engine(q4_k_m, "torch", kv_cache_dtype="float32"), PROMPTS, params
    )


# -- 2. logprobs and prompt logits -------------------------------------------------------------------


def assert_same_logprobs(ours: list[TokenLogprobs | None], theirs: list[TokenLogprobs | None], top: int) -> None:
    """Same chosen and top ids, logprobs within 1e-4, and ``top`` alternatives at each position."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if b is None:
            assert a is None, i
            continue
        assert a is not None and len(a.top) == len(b.top) == top, i
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4), i
        assert [t for t, _ in a.top] == [t for t, _ in b.top], i
        np.testing.assert_allclose([lp for _, lp in a.top], [lp for _, lp in b.top], atol=1e-4, rtol=0)


def test_logprobs_and_prompt_logits_equal_the_torch_runners(q4_k_m: Path) -> None:
    """Sampled and prompt logprobs (ids and values) and teacher-forced logits of every position."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    torch_llm, array = engine(q4_k_m, "torch"), engine(q4_k_m, "array")
    theirs, ours = torch_llm.generate(PROMPTS[:2], params), array.generate(PROMPTS[:2], params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        assert len(a.outputs[0].logprobs) == 8
        assert_same_logprobs(list(a.outputs[0].logprobs), list(b.outputs[0].logprobs), 3)
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and a.prompt_logprobs[0] is None
        assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs, 2)
        ids = b.prompt_token_ids + b.outputs[0].token_ids
        expected, got = torch_llm.prompt_logits(ids), array.prompt_logits(ids)
        assert got.shape == expected.shape == (len(ids), torch_llm.core.model_config.vocab_size)
        assert torch.allclose(got, expected, atol=1e-4, rtol=0)


# -- 3. embeddings ------------------------------------------------------------------------------------


def test_embeddings_equal_the_torch_runners_and_have_unit_length(q4_k_m: Path) -> None:
    """core.embed's mean-pooled vectors: the torch runner's within 1e-5, each of length 1."""
    torch_llm, array = engine(q4_k_m, "torch"), engine(q4_k_m, "array")
    prompts = [torch_llm.tokenizer.encode(p) for p in PROMPTS]
    ours, theirs = np.asarray(array.core.embed(prompts)), np.asarray(torch_llm.core.embed(prompts))
    assert ours.shape == theirs.shape == (len(PROMPTS), torch_llm.core.model_config.hidden_size)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(ours[0], ours[1], atol=1e-3)  # different prompts, different vectors


# -- 4. model families' GGUF layouts ------------------------------------------------------------------

FAMILIES = ["gemma3", "gemma2", "phi3.5-longrope-partial-gqa", "smollm3", "qwen3-yarn", "llama3.1-rope"]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_model_familys_gguf_gives_the_torch_runners_tokens(name: str, tmp_path: Path) -> None:
    """llama.cpp-style Q8_0 files (test_model_families.GGUF_MODELS): Gemma 3's local layers, window and
    two RoPE bases; Gemma 2's soft-caps; Phi-3.5's fused qkv/gate_up, LongRoPE and partial rotary;
    SmolLM3's layers without RoPE; Qwen3's q/k norms and YaRN; Llama 3.1's rope_freqs tensor. Prompts
    run past Gemma's 8-key window and are prefilled 16 tokens a step."""
    model_dir = make_tiny_model(tmp_path / name, **GGUF_MODELS[name])
    if name.startswith("gemma"):
        randomise_norms(model_dir)
    path = write_hf_model_gguf(model_dir, tmp_path / "Q8_0.gguf", "Q8_0")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    torch_llm = engine(path, "torch", max_num_batched_tokens=16)
    array = engine(path, "array", max_num_batched_tokens=16)
    theirs = torch_llm.generate(FAMILY_PROMPTS, params)
    ours = tokens(array, FAMILY_PROMPTS, params)
    for i, (a, out) in enumerate(zip(ours, theirs)):
        b = out.outputs[0].token_ids
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert first is None, f"{name}: prompt {i} ({FAMILY_PROMPTS[i]!r}) differs from output token {first}"
        # The logits too: a difference the argmax happens to survive would show here.
        ids = out.prompt_token_ids + b
        assert torch.allclose(array.prompt_logits(ids), torch_llm.prompt_logits(ids), atol=1e-4, rtol=0), i


# -- 5. no torch in the process -----------------------------------------------------------------------

_TORCH_FREE_ENGINE = """
import json, sys
from chatapp.engine import LLM, SamplingParams, cpu_kernels
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.02)
out = llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
torch_modules = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"runner": type(llm.core.runner).__name__, "tokens": out[0].outputs[0].token_ids,
                  "torch": torch_modules, "package_metadata_read": "importlib.metadata" in sys.modules}))
"""

_TORCH_FREE_IMPORTS = """
import json, sys
import chatapp.engine.process, chatapp.engine.launch
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def run_python(code: str, *args: str) -> Any:
    """Run ``code`` in a fresh interpreter; its last printed line, as JSON."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_gguf_file_loads_and_generates_without_importing_torch(q4_k_m: Path) -> None:
    """The default engine on a GGUF file on the CPU picks the array runner and never imports torch
    (nor does importing the engine process and launcher), and its tokens are the torch runner's."""
    result = run_python(_TORCH_FREE_ENGINE, str(q4_k_m), PROMPTS[0])
    assert result["runner"] == "ArrayRunner"
    assert result["torch"] == []
    assert not result["package_metadata_read"]  # importing importlib.metadata alone is ~25 ms of a start
    assert result["tokens"] == tokens(engine(q4_k_m, "torch"), [PROMPTS[0]], GREEDY_16)[0][:6]
    assert run_python(_TORCH_FREE_IMPORTS) == []


# -- 6. choosing the runner ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"quantization": None}, "quantization=None is the torch runner's"),
        ({"quantization": "int8"}, "quantization='int8' is the torch runner's"),
        ({"cpu_kernels": False}, "the C++ kernels are turned off"),
        ({"dtype": "bfloat16"}, "it runs on the CPU in float32 only"),
        ({"overlap_steps": True}, "overlapped steps are the torch runner's"),
        ({"kv_cache_dtype": "bfloat16"}, "its KV cache is float16 or float32, not bfloat16"),
    ],
)
def test_runner_array_says_why_it_cannot_run_a_config(q4_k_m: Path, overrides: dict[str, Any], why: str) -> None:
    """runner="array" refuses, naming the reason; runner="auto" takes the torch runner instead."""
    with pytest.raises(ValueError, match=r"runner='array' cannot run this model: .*" + re.escape(why)):
        LLM(str(q4_k_m), kv_cache_memory_gib=KV, runner="array", **overrides)
    if "dtype" not in overrides:  # (bfloat16 weights or cache on the CPU: the torch runner's slow path)
        assert type(LLM(str(q4_k_m), kv_cache_memory_gib=KV, **overrides).core.runner).__name__ == "ModelRunner"


def test_runner_choice_by_model_and_setting(q4_k_m: Path, tiny_llama: Path) -> None:
    """auto: a GGUF file runs on the array runner, a safetensors model on the torch one; "torch" forces
    the torch runner on a GGUF file; "array" on safetensors and an unknown runner name are errors."""
    assert type(LLM(str(q4_k_m), kv_cache_memory_gib=KV).core.runner).__name__ == "ArrayRunner"
    engine(q4_k_m, "torch")
    assert type(LLM(str(tiny_llama), kv_cache_memory_gib=KV).core.runner).__name__ == "ModelRunner"
    with pytest.raises(ValueError, match="runner='array' cannot run this model: the model is not a GGUF file"):
        LLM(str(tiny_llama), kv_cache_memory_gib=KV, runner="array")
    with pytest.raises(ValueError, match="runner must be auto, array or torch, got 'bogus'"):
        LLM(str(q4_k_m), kv_cache_memory_gib=KV, runner="bogus")


# -- 7. RoPE tables -----------------------------------------------------------------------------------

_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
    "long_factor": [1.5, 2.0, 3.5, 6.0, 9.0, 14.0],
    "original_max_position_embeddings": 2048,
    "factor": 2.0,
}
# name: (head_dim, rotary_dim, theta, scaling, positions)
ROPE_CASES: dict[str, tuple[int, int | None, float, dict[str, Any] | None, int]] = {
    "none": (64, None, 10000.0, None, 2048),
    "none-partial": (64, 32, 10000.0, None, 2048),
    "linear": (64, None, 10000.0, {"rope_type": "linear", "factor": 8.0}, 2048),
    "llama3": (
        128,
        None,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        2048,
    ),
    "yarn": (32, None, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 2048),
    "yarn-mscale-untruncated": (
        64,
        None,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "truncate": False,
        },
        2048,
    ),
    "yarn-attention-factor": (
        64,
        None,
        10000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 1.2},
        2048,
    ),
    "longrope-partial": (16, 12, 10000.0, _LONGROPE, 4096),  # positions past 2048 take the long factors
    "freq_factors": (
        64,
        None,
        500000.0,
        {"rope_type": "freq_factors", "factors": tuple(np.linspace(1.0, 8.0, 32).tolist())},
        2048,
    ),
    "freq_factors-partial": (
        64,
        32,
        10000.0,
        {"rope_type": "freq_factors", "factors": tuple(np.linspace(1.0, 4.0, 16).tolist())},
        2048,
    ),
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_numpy_rope_tables_equal_the_torch_buffers(name: str) -> None:
    """With our extension's cos/sin (torch's kernels, what the array model uses) the tables equal
    RotaryEmbedding's buffers bit for bit; with numpy's cos/sin within 1e-6."""
    head_dim, rotary_dim, theta, scaling, positions = ROPE_CASES[name]
    ext = cpu_kernels.load()
    assert ext is not None
    ref = RotaryEmbedding(head_dim, positions, theta, scaling, torch.float32, torch.device("cpu"), rotary_dim)
    width = rotary_dim or head_dim
    exact = rope_tables(head_dim, positions, theta, scaling, rotary_dim, ext.cos_sin)
    close = rope_tables(head_dim, positions, theta, scaling, rotary_dim, numpy_trig)
    for ours, near, theirs in zip(exact, close, (ref.cos.numpy(), ref.signed_sin.numpy())):
        assert ours.dtype == near.dtype == np.float32 and ours.shape == near.shape == theirs.shape == (positions, width)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        np.testing.assert_allclose(near, theirs, atol=1e-6, rtol=0)


# -- 8. seeded sampling -------------------------------------------------------------------------------


def test_seeded_sampling_repeats_for_a_seed_and_differs_for_another(q4_k_m: Path) -> None:
    """temperature 1: a seed gives the same tokens again, alone or beside an unseeded request; another
    seed gives other tokens."""
    array = engine(q4_k_m, "array")

    def sample(seed: int, *others: str) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        outs = array.generate([PROMPTS[0], *others], [params, *[other] * len(others)])
        return outs[0].outputs[0].token_ids

    first = sample(7)
    assert len(first) == 16
    assert sample(7) == first
    assert sample(7, PROMPTS[1]) == first
    assert sample(8) != first


def test_a_one_row_lookup_is_a_view_and_any_other_the_index_arrays_rows() -> None:
    from chatapp.engine.models.array_model import rows_of

    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    one = rows_of(table, np.array([3]))
    assert one.tolist() == [[12.0, 13.0, 14.0, 15.0]] and np.shares_memory(one, table)
    assert rows_of(table, np.array([4, 0, 4])).tolist() == table[[4, 0, 4]].tolist()
    assert rows_of(table, np.array([-1])).tolist() == table[[-1]].tolist()  # numpy's meaning, as before
    with pytest.raises(IndexError):
        rows_of(table, np.array([5]))
