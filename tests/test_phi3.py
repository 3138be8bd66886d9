"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM): fused q/k/v and gate/up, LongRoPE, RoPE on part of each
head. Tiny random models made with transformers' own Phi3Config are the reference, token for token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.models.config import load_model_config
from chatapp.engine.models.rope import RotaryEmbedding
from tests.hf_reference import hf_greedy, hf_model
from tests.tiny_model import make_tiny_model

# Phi-3.5-mini's kind of config at a tiny size: LongRoPE factors (short ones used within the
# pretraining length), max/original = 2 so the attention scaling is not 1, and Phi-4-mini's partial
# rotary factor (12 of each head's 16 dimensions rotate).
LONGROPE = dict(
    partial_rotary_factor=0.75,
    max_position_embeddings=4096,
    original_max_position_embeddings=2048,
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
        "long_factor": [1.5, 2.0, 3.5, 6.0, 9.0, 14.0],
    },
)
VARIANTS = {
    "phi3-mini-mha": dict(num_heads=4, num_kv_heads=4),  # Phi-3-mini: no GQA, whole-head RoPE
    "phi3.5-longrope-partial-gqa": dict(num_heads=4, num_kv_heads=2, **LONGROPE),
}
PROMPTS = [
    "Hello there",
    "The list: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve",
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a",
]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _exact(path: Path, **overrides) -> LLM:
    """Float32 weights and KV cache: the model Hugging Face runs, bit for bit."""
    return LLM(str(path), quantization=None, kv_cache_dtype="float32", **overrides)


def _hf(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    model = hf_model(str(path))
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), "Phi3ForCausalLM", **VARIANTS[request.param])


def test_config_reads_phi3s_rope(tmp_path: Path) -> None:
    mc = load_model_config(make_tiny_model(tmp_path / "m", "Phi3ForCausalLM", **LONGROPE))
    assert mc.architecture == "Phi3ForCausalLM" and mc.rotary_dim == 12
    assert mc.rope_scaling["rope_type"] == "longrope"
    assert mc.rope_scaling["original_max_position_embeddings"] == 2048 and mc.rope_scaling["factor"] == 2.0


def test_greedy_matches_hf_over_chunked_prefill_a_prefix_hit_and_preemption(phi3: Path) -> None:
    llm = _exact(phi3, kv_cache_memory_gib=0.02, max_num_batched_tokens=16)  # prompts arrive in chunks
    outs = llm.generate(PROMPTS, GREEDY_32)
    expected = []
    for out in outs:
        assert out.outputs[0].token_ids == _hf(phi3, out.prompt_token_ids, 32)
        expected.append(out.outputs[0].token_ids)
    # A follow-up turn: the first answer's blocks come from the prefix cache.
    first = outs[1]
    follow_up = first.prompt_token_ids + first.outputs[0].token_ids + llm.tokenizer.encode(" and then")
    again = llm.generate([follow_up], GREEDY_32)[0]
    assert again.num_cached_tokens >= 3 * llm.config.block_size
    assert again.outputs[0].token_ids == _hf(phi3, follow_up, 32)
    # A pool too small for every request at once: some are preempted and recomputed.
    tight = _exact(phi3, num_kv_blocks=8, block_size=16, max_num_batched_tokens=32)
    outs = tight.generate(PROMPTS, GREEDY_32)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_greedy_through_the_torch_path_matches_too(phi3: Path) -> None:
    """The Python forward (GPU, or no compiler) rotates part of each head the same way."""
    llm = _exact(phi3, kv_cache_memory_gib=0.02, cpu_kernels=False)
    for out in llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12)):
        assert out.outputs[0].token_ids == hf_greedy(phi3, out.prompt_token_ids, 12)


def test_longrope_tables_take_the_long_factors_past_the_pretraining_length(tmp_path: Path) -> None:
    """Each position's cos/sin equal Hugging Face's: short factors below original_max_position_embeddings
    (where HF runs any sequence that short) and long ones from it on (where HF runs any longer one)."""
    path = make_tiny_model(tmp_path / "m", "Phi3ForCausalLM", **LONGROPE)
    mc = load_model_config(path)
    ours = RotaryEmbedding(mc.head_dim, 4096, mc.rope_theta, mc.rope_scaling, torch.float32, "cpu", mc.rotary_dim)
    hf_rope = hf_model(str(path)).model.rotary_emb
    x = torch.zeros(1, 1, mc.head_dim)
    for positions in (torch.arange(0, 2048), torch.arange(2048, 4096)):
        cos, sin = hf_rope(x, positions[None])
        assert torch.equal(ours.cos[positions], cos[0])
        half = mc.rotary_dim // 2
        assert torch.equal(ours.signed_sin[positions][:, half:], sin[0][:, half:])
        assert torch.equal(ours.signed_sin[positions][:, :half], -sin[0][:, :half])
    never_long = dict(mc.rope_scaling, original_max_position_embeddings=10**9, factor=2.0)
    short = RotaryEmbedding(mc.head_dim, 4096, mc.rope_theta, never_long, torch.float32, "cpu", mc.rotary_dim)
    assert not torch.equal(ours.cos[2048:], short.cos[2048:])  # the long factors really apply there


def test_phi3_gguf_runs_the_models_own_tokens(phi3: Path, tmp_path: Path) -> None:
    """The same weights written as a llama.cpp-style Phi-3 GGUF (fused attn_qkv and ffn_up, LongRoPE
    factor tensors) in float32 give Hugging Face's tokens; in Q8_0 and Q4_0 they run natively and
    follow the float run of the de-quantised weights."""
    gguf32 = write_phi3_gguf(phi3, tmp_path / "phi3-f32.gguf", "F32")
    float_run = _exact(gguf32, kv_cache_memory_gib=0.02, max_num_batched_tokens=16)
    for out in float_run.generate(PROMPTS[:2], GREEDY_32):
        assert out.outputs[0].token_ids == _hf(phi3, out.prompt_token_ids, 32)
    for type_name in ("Q8_0", "Q4_0"):
        path = write_phi3_gguf(phi3, tmp_path / f"phi3-{type_name}.gguf", type_name)
        native = LLM(str(path), kv_cache_memory_gib=0.02)
        exact = _exact(path, kv_cache_memory_gib=0.02)
        assert native.config.quantization == "gguf"
        agree = total = 0
        for out in exact.generate(PROMPTS, GREEDY_32):
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            a, b = exact.prompt_logits(ids), native.prompt_logits(ids)
            assert float((a - b).norm() / a.norm()) < 0.05, type_name  # int8 activations only
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(ids)
        # Tiny random models have many near-tied logits: a wrong mapping agrees at ~0, these at 0.89-0.96.
        assert agree / total >= 0.85, type_name


def write_phi3_gguf(model_dir: Path, path: Path, type_name: str) -> Path:
    """A Phi-3 GGUF of a Hugging Face Phi3 checkpoint, laid out as llama.cpp's converter writes one."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file

    from tests.gguf_models import bundled_tokenizer_fields

    hf = json.loads((model_dir / "config.json").read_text())
    weights = {
        k.removeprefix("model."): v.float().numpy() for k, v in load_file(model_dir / "model.safetensors").items()
    }
    heads = hf["num_attention_heads"]
    head_dim = hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {}
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(hf["vocab_size"])
    if rope.get("rope_type") == "longrope":
        original = hf["original_max_position_embeddings"]
        factor = hf["max_position_embeddings"] / original
        writer.add_key_value("phi3.rope.scaling.original_context_length", original, GGUFValueType.UINT32)
        writer.add_key_value(
            "phi3.rope.scaling.attn_factor",
            float(np.sqrt(1 + np.log(factor) / np.log(original))),
            GGUFValueType.FLOAT32,
        )
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for key, (value, main, sub) in bundled_tokenizer_fields().items():
        writer.add_key_value(key, value, main, sub_type=sub)

    def put(name: str, values: np.ndarray, quantize: bool = True) -> None:
        if not quantize or type_name == "F32":
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
            return
        qtype = GGMLQuantizationType[type_name]
        writer.add_tensor(name, quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype), raw_dtype=qtype)

    put("token_embd.weight", weights["embed_tokens.weight"])
    put("output_norm.weight", weights["norm.weight"], quantize=False)
    if "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"])
    for i in range(hf["num_hidden_layers"]):
        src, dst = f"layers.{i}.", f"blk.{i}."
        put(dst + "attn_norm.weight", weights[src + "input_layernorm.weight"], quantize=False)
        put(dst + "ffn_norm.weight", weights[src + "post_attention_layernorm.weight"], quantize=False)
        put(dst + "attn_qkv.weight", weights[src + "self_attn.qkv_proj.weight"])
        put(dst + "attn_output.weight", weights[src + "self_attn.o_proj.weight"])
        put(dst + "ffn_up.weight", weights[src + "mlp.gate_up_proj.weight"])
        put(dst + "ffn_down.weight", weights[src + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
