"""Model families and GGUF files on a CUDA GPU, where the Python model runs with our Triton kernels.

The GPU takes its own path through the loaders: a GGUF file's blocks are de-quantised into the model's
dtype tensor by tensor, families with windows or soft-caps use the torch attention (the Triton one
has neither), and decode steps replay CUDA graphs. In float32 each must give the tokens the CPU
suite proves: Hugging Face's on the same GPU for a family, and the CPU's float run of the same
de-quantised weights for a GGUF file of each type.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from chatapp.engine import LLM, SamplingParams
from tests.gguf_blocks import BLOCK_TYPES
from tests.gguf_models import write_hf_model_gguf, write_llama_gguf
from tests.test_model_families import FAMILIES, GGUF_MODELS, PROMPTS, randomise_norms
from tests.tiny_model import make_tiny_model

DEVICE = "cuda"
WINDOWED_OR_SOFT_CAPPED = {"gemma3-local-global", "gemma2-softcaps", "mistral-window", "phi3-mini-window"}
GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def gpu_float32(path: Path, **overrides) -> LLM:
    """Float32 weights and KV cache on the GPU, chunked prompts: the model Hugging Face runs."""
    return LLM(
        str(path),
        device=DEVICE,
        dtype="float32",
        quantization=None,
        kv_cache_dtype="float32",
        kv_cache_memory_gib=0.05,
        max_num_batched_tokens=16,
        **overrides,
    )


@lru_cache(maxsize=2)
def hf_model_on_gpu(path: str):
    """Hugging Face's eager attention (its SDPA path leaves Gemma 2's soft-capping out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.to(DEVICE).eval()


def hf_greedy(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    model = hf_model_on_gpu(str(path))
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], device=DEVICE)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def decode_graph_replays(llm: LLM) -> int:
    graphs = llm.core.runner.decode_graphs
    return 0 if graphs is None else graphs.replays


def tiny_family(name: str, where: Path, fields: dict) -> Path:
    path = make_tiny_model(where, **fields)
    if name.startswith("gemma"):
        randomise_norms(path)
    return path


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_matches_hf_on_the_gpu_in_float32(name: str, tmp_path: Path) -> None:
    path = tiny_family(name, tmp_path / name, FAMILIES[name])
    llm = gpu_float32(path)
    outs = llm.generate(PROMPTS, GREEDY_24)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 24), (name, out.prompt)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1, "a constant model would agree with anything"
    # Windows and soft-caps run in the torch attention, eagerly: the Triton kernel has neither yet.
    assert (decode_graph_replays(llm) > 0) == (name not in WINDOWED_OR_SOFT_CAPPED), name


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_each_familys_llama_cpp_style_gguf_matches_hf_on_the_gpu(name: str, tmp_path: Path) -> None:
    """The family's GGUF layout (fused Phi-3 projections, Gemma's norms with 1 added, permuted q/k
    rows, rope factor tensors) read by the GPU's loader into float32 gives HF's tokens."""
    model_dir = tiny_family(name, tmp_path / name, GGUF_MODELS[name])
    llm = gpu_float32(write_hf_model_gguf(model_dir, tmp_path / "f32.gguf", "F32"))
    for out in llm.generate(PROMPTS[:2], GREEDY_24):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, 24), name


def _ffn_up_rows(path: Path, layer: int) -> tuple[torch.Tensor, str]:
    """ffn_up of ``layer`` as the gguf package de-quantises it, and its type's name."""
    from gguf import GGUFReader

    [tensor] = [t for t in GGUFReader(str(path)).tensors if t.name == f"blk.{layer}.ffn_up.weight"]
    rows = quants.dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    return torch.from_numpy(rows.reshape(-1, rows.shape[-1]).astype("float32")), tensor.tensor_type.name


@pytest.mark.parametrize("mix", [*BLOCK_TYPES, "Q4_K_M", "Q3_K_M"])
def test_each_gguf_type_runs_on_the_gpu_as_its_de_quantised_weights(mix: str, tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / f"tiny-{mix}.gguf", mix=mix, tied=mix == "Q8_0")
    gpu = gpu_float32(path)
    assert gpu.config.quantization is None and gpu.config.device == "cuda"
    up, type_name = _ffn_up_rows(path, 1)
    gate_up = gpu.core.runner.model.layers[1].mlp.gate_up_proj.weight
    assert gate_up.device.type == "cuda" and gate_up.dtype == torch.float32
    assert torch.equal(gate_up[-up.shape[0] :].cpu(), up), type_name

    # The CPU's float run of the same file (its Python model, no kernels of ours) is the reference.
    cpu = LLM(
        str(path),
        device="cpu",
        quantization=None,
        kv_cache_dtype="float32",
        kv_cache_memory_gib=0.02,
        cpu_kernels=False,
    )
    expected = cpu.generate(PROMPTS, GREEDY_24)
    outs = gpu.generate(PROMPTS, GREEDY_24)
    for want, got in zip(expected, outs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, (mix, want.prompt)
        ids = want.prompt_token_ids + want.outputs[0].token_ids
        a, b = cpu.prompt_logits(ids), gpu.prompt_logits(ids).cpu()
        assert float((a - b).norm() / a.norm()) < 1e-3, mix  # a wrong weight is off by O(1)
    assert decode_graph_replays(gpu) > 0


def test_a_q4_k_m_file_loads_into_bfloat16_on_the_gpu(tmp_path: Path) -> None:
    """The GPU's default dtype: each block de-quantised straight into bfloat16, nothing in float32."""
    path = write_llama_gguf(tmp_path / "tiny-Q4_K_M.gguf", mix="Q4_K_M", seed=12)
    llm = LLM(str(path), device=DEVICE, kv_cache_memory_gib=0.05)
    model = llm.core.runner.model
    assert llm.config.dtype == "bfloat16"
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cuda"
    up, _ = _ffn_up_rows(path, 1)
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight[-up.shape[0] :].cpu(), up.bfloat16())
    outs = llm.generate(PROMPTS, GREEDY_24)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total
