"""Our forward pass matches Hugging Face for every supported Llama-family variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.models.config import UnsupportedModelError, check_supported
from tests.hf_reference import hf_greedy
from tests.tiny_model import make_tiny_model

VARIANTS = {
    "llama-untied-gqa": dict(
        arch="LlamaForCausalLM", tie_word_embeddings=False, hidden_size=96, num_heads=6, num_kv_heads=2
    ),
    "mistral-mha": dict(arch="MistralForCausalLM", num_heads=4, num_kv_heads=4),
    "qwen2-qkv-bias": dict(arch="Qwen2ForCausalLM", num_heads=4, num_kv_heads=1),
    "qwen3-qk-norm": dict(arch="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_dim=32),
}
PROMPTS = ["Hello there", "The list: one, two, three, four, five, six, seven, eight, nine, ten", "x"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_hf(variant: str, tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / variant, **VARIANTS[variant])
    if variant == "qwen2-qkv-bias":  # HF initialises biases to zero: make them matter
        _randomise_biases(path)
    # Float32 weights and KV cache: bit for bit the model Hugging Face runs.
    llm = LLM(
        str(path), kv_cache_memory_gib=0.02, max_num_batched_tokens=16, quantization=None, kv_cache_dtype="float32"
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 10)


def _randomise_biases(path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(path))


def test_unsupported_rope_scaling_is_named() -> None:
    config = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        check_supported(config)


def test_unknown_engine_option_is_a_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="unknown engine option.*blok_size"):
        LLM(str(tiny_llama), blok_size=16)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"block_size": 12}, "power of two"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_invalid_engine_options(tiny_llama: Path, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama), **overrides)


def test_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    from chatapp.store import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="no local model named"):
        LLM("nobody/nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_config_is_resolved_once_and_never_changed_after(tiny_llama: Path) -> None:
    """The user's config is frozen; the engine's is resolved from it once, with what loading decided."""
    import dataclasses

    from chatapp.engine.config import EngineConfig, ResolvedConfig

    asked = EngineConfig(model=str(tiny_llama), quantization="auto", kv_cache_memory_gib=0.01)
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.max_model_len = 1  # type: ignore[misc]
    llm = LLM(str(tiny_llama), quantization="auto", kv_cache_memory_gib=0.01)
    runner = llm.core.runner
    assert runner.config.quantization == "auto" and runner.quantization == "int8"  # the runner's own record
    final = llm.config
    assert isinstance(final, ResolvedConfig)
    assert final.quantization == "int8" and final.num_kv_blocks == runner.num_blocks
    assert final.max_model_len == min(2048, runner.num_blocks * final.block_size)
    assert None not in (final.max_num_seqs, final.max_num_batched_tokens, final.long_prefill_token_threshold)
