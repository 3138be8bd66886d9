"""The kernels as a laptop without AVX-512 gets them: built for Haswell (AVX2, FMA, F16C), then run here.

Why a separate build: on these machines the native build has AVX-512, so its "avx2" loop sits beside
AVX-512 code (the activation quantizer, attention). A Haswell build proves the AVX2 loops compile and
run without any AVX-512 instruction, pick themselves as "best", and compute what the native build does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from chatapp.engine import LLM, SamplingParams, cpu_kernels, kernel_build
from tests.gguf_blocks import BLOCK_TYPES, random_blocks
from tests.gguf_models import write_llama_gguf


@pytest.fixture(scope="module")
def haswell(tmp_path_factory: pytest.TempPathFactory):
    key = kernel_build.build_key(torch.__version__)
    build_dir = tmp_path_factory.mktemp("haswell-kernels")
    return kernel_build.compile_extension(f"chatapp_cpu_kernels_haswell_{key}", build_dir, kernel_build.AVX2_MARCH)


@pytest.fixture(scope="module")
def native():
    ext = cpu_kernels.load()
    assert ext is not None
    return ext


def test_a_haswell_build_runs_its_avx2_loops_as_best(haswell) -> None:
    assert haswell.block_quant_paths() == ["avx2", "portable"]
    assert haswell.block_quant_fast()  # so GGUF files run in their own types there, not de-quantised
    with pytest.raises(RuntimeError, match="vnni loop was not compiled"):
        haswell.block_linear(torch.randn(1, 64), torch.zeros(2, 2, 320, dtype=torch.uint8), 4, 32, path="vnni")


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_haswell_results_equal_the_native_builds(haswell, native, type_name: str) -> None:
    rng = np.random.default_rng(11)
    n, k = 40, 1024
    raw = torch.from_numpy(random_blocks(type_name, n, k, rng))
    ggml_type = int(GGMLQuantizationType[type_name])
    packed, kind = haswell.repack_gguf(raw, ggml_type, k)
    assert torch.equal(packed, native.repack_gguf(raw, ggml_type, k)[0])
    torch.manual_seed(1)
    x = torch.randn(37, k) * torch.logspace(-2, 1, 37)[:, None]
    bias = torch.randn(n)
    y = haswell.block_linear(x, packed, kind, n, bias)
    assert torch.equal(haswell.block_linear(x, packed, kind, n, bias, path="portable"), y)
    assert torch.equal(haswell.block_linear(x[5:6].clone(), packed, kind, n, bias)[0], y[5])
    # The Haswell build's scalar quantizer gives the AVX-512 one's codes and scales, and every kind's
    # arithmetic uses only them (integer sums, then float scales in a fixed order): the same bits.
    assert torch.equal(y, native.block_linear(x, packed, kind, n, bias, path="avx2"))


@pytest.mark.parametrize("kind", [1, 2])  # F16 and BF16 rows (csrc/float_rows.cpp)
def test_haswell_float_rows_equal_the_native_builds(haswell, native, kind: int) -> None:
    """Two 256-bit halves per 16 lanes, then the same tree: the AVX-512 loop's bits."""
    rng = np.random.default_rng(kind)
    n, k = 37, 512
    raw = torch.from_numpy((rng.integers(0, 2**16, size=(n, k), dtype=np.uint16) & np.uint16(0xBFFF)).view(np.uint8))
    x = torch.randn(11, k) * torch.logspace(-2, 1, 11)[:, None]
    bias = torch.randn(n)
    y = haswell.block_linear(x, raw, kind, n, bias)
    assert torch.equal(haswell.block_linear(x, raw, kind, n, bias, path="portable"), y)
    assert torch.equal(haswell.block_linear(x[5:6].clone(), raw, kind, n, bias)[0], y[5])
    assert torch.equal(y, native.block_linear(x, raw, kind, n, bias))


def test_a_q4_k_m_model_answers_alike_on_the_haswell_build(haswell, tmp_path: Path, monkeypatch) -> None:
    """The whole layer loop on the Haswell build (attention on 256-bit halves, the AVX2 K-quant loops)
    gives the native build's logits to the bit: every kernel keeps one arithmetic whatever the vector
    width, and every kind uses only the activation codes and scales, which both builds compute alike."""
    path = write_llama_gguf(tmp_path / "tiny-q4km.gguf", mix="Q4_K_M", seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"
    here = LLM(str(path), kv_cache_memory_gib=0.02)
    expected = here.generate([prompt], params)[0]
    ids = expected.prompt_token_ids + expected.outputs[0].token_ids
    expected_logits = here.prompt_logits(ids)
    monkeypatch.setattr(cpu_kernels, "load", lambda: haswell)
    there = LLM(str(path), kv_cache_memory_gib=0.02)
    assert there.config.quantization == "gguf"
    assert there.generate([prompt], params)[0].outputs[0].token_ids == expected.outputs[0].token_ids
    assert torch.equal(there.prompt_logits(ids), expected_logits)
