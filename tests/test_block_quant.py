"""4- and 8-bit block-quantized linear layers (chatapp/engine/block_quant.py, csrc/block_quant.cpp)."""

from __future__ import annotations

import pytest
import torch

from chatapp.engine import LLM, SamplingParams, cpu_kernels
from chatapp.engine.block_quant import BlockQuantLinear, dequantize, pack_q4, pack_q8
from chatapp.engine.config import EngineConfig
from tests.activation_reference import int8_activations
from tests.quality_checks import agreement, moon_landing_logits, teacher_forced_logits

PACKERS = {4: pack_q4, 8: pack_q8}


@pytest.fixture(scope="module")
def ext():
    ext = cpu_kernels.load()
    assert ext is not None, "the C++ CPU kernels must build here (gcc is part of the set-up)"
    return ext


def reference_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: int8 activations per row and block of 32 times the exact
    weights (a 4-bit block's minimum multiplies the sum of the quantized activations, so this holds
    for both kinds)."""
    w = dequantize(packed, bits, n).double()
    return int8_activations(x, 32) @ w.T


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_recovers_block_weights_exactly(bits: int) -> None:
    """Weights that already are blocks (a dequantized GGUF) pack with no error at all."""
    torch.manual_seed(bits)
    weight = torch.randn(40, 96) * 0.05  # 40: not a whole number of 16-channel tiles
    packed, error = PACKERS[bits](weight)
    assert 0 < error < (0.05 if bits == 4 else 0.002)  # random weights round once...
    blocks = dequantize(packed, bits, 40)
    repacked, again = PACKERS[bits](blocks)
    assert again == 0.0 and torch.equal(repacked, packed)  # ...and never again
    assert torch.equal(dequantize(repacked, bits, 40), blocks)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 96), (960, 576), (576, 1536)])
def test_kernel_computes_the_block_arithmetic(ext, bits: int, shape: tuple[int, int]) -> None:
    n, k = shape
    torch.manual_seed(n + bits)
    packed, _ = PACKERS[bits](torch.randn(n, k) * 0.05)
    x = torch.randn(70, k)  # more than the kernel's 64-row chunk
    x[3] = 0.0  # an all-zero row has scale 0, not NaN
    x[5, 7] = 400.0  # a massive activation coarsens its own block; the others keep 6-7 of their 7 bits
    y = ext.block_linear(x, packed, bits, n)
    expected = reference_linear(x, packed, bits, n)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[3], torch.zeros(n))
    dense = x @ dequantize(packed, bits, n).T  # and close to the float product of the same weights
    others = torch.arange(70) != 5
    assert float((y[others] - dense[others]).norm() / dense[others].norm()) < 0.02
    assert float((y[5] - dense[5]).norm() / dense[5].norm()) < 0.15


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_bitwise_batch_invariant_and_every_loop_gives_the_same_bits(ext, bits: int) -> None:
    """VNNI, AVX2 (what most laptops run) and the portable loop agree to the bit, batched or one row."""
    assert ext.block_quant_paths() == ["vnni", "avx2", "portable"], "these machines build every loop"
    torch.manual_seed(3)
    n, k = 200, 192
    packed, _ = PACKERS[bits](torch.randn(n, k) * 0.1)
    bias = torch.randn(n)
    x = torch.randn(100, k)
    x[7, :32] = torch.tensor([5.0, -5.0] * 16)  # codes at +-127 beside the weights' extreme codes
    batch = ext.block_linear(x, packed, bits, n, bias)
    for path in ext.block_quant_paths():
        assert torch.equal(ext.block_linear(x, packed, bits, n, bias, path=path), batch), path
        for i in (0, 7, 63, 64, 99):
            one = ext.block_linear(x[i : i + 1].clone(), packed, bits, n, bias, path=path)
            assert torch.equal(one[0], batch[i]), (path, i)
        assert torch.equal(ext.block_linear(x[10:80], packed, bits, n, bias, path=path), batch[10:80]), path
    strided = torch.randn(100, 2 * k)[:, :k]  # a view with a row stride, as the layer loop passes
    strided.copy_(x)
    assert torch.equal(ext.block_linear(strided, packed, bits, n, bias), batch)


def test_an_unknown_or_missing_loop_is_refused_by_name(ext) -> None:
    packed, _ = pack_q4(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="unknown kernel path 'neon'"):
        ext.block_linear(torch.randn(2, 64), packed, 4, 32, path="neon")


def test_block_linear_rejects_mismatched_packing(ext) -> None:
    packed, _ = pack_q4(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="in_features"):
        ext.block_linear(torch.randn(2, 96), packed, 4, 32)
    with pytest.raises(RuntimeError, match="tile size"):
        ext.block_linear(torch.randn(2, 64), packed, 8, 32)


def test_torch_fallback_uses_the_same_weights() -> None:
    torch.manual_seed(4)
    packed, _ = pack_q4(torch.randn(48, 64))
    layer = BlockQuantLinear.single(packed, 4, 64, 48, torch.ones(48), ext=None)
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), x @ dequantize(packed, 4, 48).T + 1, atol=1e-5)
    half = layer(x.bfloat16())  # a bfloat16 model on the CPU
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), layer(x), rtol=0.05, atol=0.1)


def test_config_accepts_int4_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import chatapp.engine.config as config_module

    monkeypatch.setattr(config_module, "_resolve_device", lambda device: device)  # no GPU needed to check
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", quantization="int4").finalize(checkpoint_dtype=None, model_max_len=128)
    with pytest.raises(ValueError, match="auto, gguf, int4, int8 or None"):
        EngineConfig(device="cpu", quantization="int3").finalize(checkpoint_dtype=None, model_max_len=128)
    assert EngineConfig(device="cpu").finalize(checkpoint_dtype=None, model_max_len=128).quantization == "auto"


@pytest.fixture(scope="module")
def bundled() -> tuple[LLM, LLM]:
    return LLM(quantization=None, kv_cache_memory_gib=0.1), LLM(kv_cache_memory_gib=0.1, runner="torch")


def test_auto_keeps_the_bundled_gguf_weights_exactly(bundled: tuple[LLM, LLM]) -> None:
    """SmolLM2's file is Q4_1 layers and a Q8_0 embedding: auto runs exactly those weights."""
    fp32, auto = bundled
    assert auto.config.quantization == "gguf"
    fmodel, qmodel = fp32.core.runner.model, auto.core.runner.model
    for i in (0, 29):
        for part, name in (
            ("self_attn", "qkv_proj"),
            ("self_attn", "o_proj"),
            ("mlp", "gate_up_proj"),
            ("mlp", "down_proj"),
        ):
            layer = getattr(getattr(qmodel.layers[i], part), name)
            assert isinstance(layer, BlockQuantLinear) and layer.kinds == (4,)  # q, k and v as one part
            weight = getattr(getattr(fmodel.layers[i], part), name).weight
            assert torch.equal(dequantize(layer.parts[0].packed, 4, layer.out_features), weight)
    head = qmodel.quantized_lm_head
    assert head.kinds == (8,)
    assert torch.equal(dequantize(head.parts[0].packed, 8, head.out_features), fmodel.embed_tokens.weight)


def test_int4_logit_error_and_greedy_agreement_are_bounded(bundled: tuple[LLM, LLM]) -> None:
    fp32, auto = bundled
    a, b = moon_landing_logits(fp32, auto)
    assert float((a - b).abs().max()) < 6.0  # measured 2.4 here, 4.8 over the benchmark's prompts
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.85
    assert agreement(fp32, auto, num_tokens=12)["greedy_agreement"] > 0.88  # benchmark: 0.925 at 32 tokens
    out = auto.chat(
        [{"role": "user", "content": "How do I reverse a list in Python?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0]
    assert "reverse" in out.outputs[0].text.lower() or "[::-1]" in out.outputs[0].text


def test_int4_answers_do_not_depend_on_batch_or_chunking(bundled: tuple[LLM, LLM]) -> None:
    _, auto = bundled
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        "The history of Rome",
        "def quicksort(arr):",
        "My favourite food is",
        "1 2 3 4",
        "A long time ago in a galaxy far, far away there was",
    ]
    alone = [auto.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == alone
    chunked = LLM(kv_cache_memory_gib=0.05, max_num_batched_tokens=3)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == alone


def test_auto_keeps_int8_for_float_weights_and_int4_rounds_them(tmp_path) -> None:
    """A float model is not silently rounded to 4 bits; asked for, int4 works (here with a qkv bias)."""
    from tests.tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path / "q2", "Qwen2ForCausalLM", num_heads=4, num_kv_heads=1))
    assert LLM(path, kv_cache_memory_gib=0.02).config.quantization == "int8"
    fp32 = LLM(path, kv_cache_memory_gib=0.02, quantization=None)
    int4 = LLM(path, kv_cache_memory_gib=0.02, quantization="int4")
    dense = LLM(path, kv_cache_memory_gib=0.02, quantization="int4", cpu_kernels=False)  # same weights, in float
    qkv = int4.core.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, BlockQuantLinear) and qkv.bias is not None
    assert int4.core.runner.cpu_forward is not None and dense.core.runner.cpu_forward is None
    ids = fp32.tokenizer.encode(
        "The fox, tired at last, lay down under the old oak tree and watched the dog "
        "chase its own tail until the sun went down."
    )
    reference, logits = teacher_forced_logits(dense, ids), teacher_forced_logits(int4, ids)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # The kernel differs from the float product of its weights by its int8 activations only (measured
    # 0.08 on this deliberately touchy random model); rounding the weights to 4 bits costs more (0.43).
    assert rel(logits, reference) < 0.15
    assert rel(logits, teacher_forced_logits(fp32, ids)) < 0.6
