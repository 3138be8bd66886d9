"""Model families beyond plain Llama, each against Hugging Face token for token on tiny random models
made with transformers' own config classes: Phi-3 / Phi-3.5 / Phi-4 (fused q/k/v and gate/up,
LongRoPE, RoPE on part of each head), Llama 3.1+ rope scaling ("llama3"), YaRN (Qwen), Gemma 2 / 3
(sliding-window local layers, sandwich norms, GeGLU, soft-capping, two RoPE bases), windowed Mistral
and Phi-3, and SmolLM3 (layers without RoPE)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from chatapp.engine import LLM, SamplingParams
from chatapp.engine.models.config import load_model_config
from chatapp.engine.models.rope import RotaryEmbedding
from tests.gguf_models import write_hf_model_gguf
from tests.hf_reference import hf_model
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
PHI3 = {
    "phi3-mini-mha": dict(num_heads=4, num_kv_heads=4),  # Phi-3-mini: no GQA, whole-head RoPE
    "phi3.5-longrope-partial-gqa": dict(num_heads=4, num_kv_heads=2, **LONGROPE),
}
# A short original length, so every region of each scaling (kept, ramped, interpolated) is in use.
FAMILIES = {
    **{name: dict(arch="Phi3ForCausalLM", **fields) for name, fields in PHI3.items()},
    "llama3.1-rope": dict(
        arch="LlamaForCausalLM",
        num_heads=4,
        num_kv_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3-yarn": dict(
        arch="Qwen3ForCausalLM",
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # A window of 8 keys: every prompt and answer below runs past it. Small weights and random norm
    # weights, so a tiny Gemma's answers vary from token to token.
    "gemma3-local-global": dict(
        arch="Gemma3ForCausalLM",
        **(GEMMA := dict(num_heads=4, num_kv_heads=2, head_dim=16, init_std=0.02, sliding_window=8)),
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},  # Gemma 3 4B+: global layers only
    ),
    "gemma2-softcaps": dict(arch="Gemma2ForCausalLM", **GEMMA, query_pre_attn_scalar=24),
    # Mistral 7B v0.1 and Phi-3-mini-4k window every layer (4,096 and 2,047 keys): here 8.
    "mistral-window": dict(arch="MistralForCausalLM", num_heads=4, num_kv_heads=2, sliding_window=8),
    "phi3-mini-window": dict(arch="Phi3ForCausalLM", num_heads=4, num_kv_heads=4, sliding_window=8),
    "smollm3-nope": dict(arch="SmolLM3ForCausalLM", num_layers=4, num_heads=4, num_kv_heads=2),  # layer 3: no RoPE
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


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    """Hugging Face's eager attention (its SDPA path leaves Gemma 2's soft-capping out); a multimodal
    checkpoint through its own class."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    cls = AutoModelForImageTextToText if arch.endswith("ConditionalGeneration") else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    model = _hf_model(str(path))
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])
    if request.param.startswith("gemma"):
        randomise_norms(path)
    return path


def randomise_norms(path: Path) -> None:
    """Gemma initialises its norm weights (stored as w - 1) at 0: give them values that matter."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if "norm" in name:
            tensors[name] = torch.randn(tensor.shape, generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(PHI3))
def phi3(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), "Phi3ForCausalLM", **PHI3[request.param])


def test_config_reads_phi3s_rope(tmp_path: Path) -> None:
    mc = load_model_config(make_tiny_model(tmp_path / "m", "Phi3ForCausalLM", **LONGROPE))
    assert mc.architecture == "Phi3ForCausalLM" and mc.rotary_dim == 12
    assert mc.rope_scaling["rope_type"] == "longrope"
    assert mc.rope_scaling["original_max_position_embeddings"] == 2048 and mc.rope_scaling["factor"] == 2.0


def test_greedy_matches_hf_over_chunked_prefill_a_prefix_hit_and_preemption(family: Path) -> None:
    llm = _exact(family, kv_cache_memory_gib=0.02, max_num_batched_tokens=16)  # prompts arrive in chunks
    outs = llm.generate(PROMPTS, GREEDY_32)
    expected = []
    for out in outs:
        assert out.outputs[0].token_ids == _hf(family, out.prompt_token_ids, 32)
        expected.append(out.outputs[0].token_ids)
    # A follow-up turn: the first answer's blocks come from the prefix cache.
    first = outs[1]
    follow_up = first.prompt_token_ids + first.outputs[0].token_ids + llm.tokenizer.encode(" and then")
    again = llm.generate([follow_up], GREEDY_32)[0]
    assert again.num_cached_tokens >= 3 * llm.config.block_size
    assert again.outputs[0].token_ids == _hf(family, follow_up, 32)
    # A pool too small for every request at once: some are preempted and recomputed.
    tight = _exact(family, num_kv_blocks=8, block_size=16, max_num_batched_tokens=32)
    outs = tight.generate(PROMPTS, GREEDY_32)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_greedy_through_the_torch_path_matches_too(family: Path) -> None:
    """The Python forward (GPU, or no compiler) uses the same tables and partial rotation."""
    llm = _exact(family, kv_cache_memory_gib=0.02, cpu_kernels=False)
    for out in llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
        assert out.outputs[0].token_ids == _hf(family, out.prompt_token_ids, 12)


def test_rope_tables_equal_hugging_faces(family: Path) -> None:
    """cos and sin of every position (past the original length too) bit for bit as HF computes them;
    for Gemma 3 both bases (global layers scaled, local ones not)."""
    mc = load_model_config(family)
    rotary_emb = hf_model(str(family)).model.rotary_emb
    positions = torch.arange(256)
    x = torch.zeros(1, 1, mc.head_dim)
    tables = [
        (RotaryEmbedding(mc.head_dim, 256, mc.rope_theta, mc.rope_scaling, torch.float32, "cpu", mc.rotary_dim), ())
    ]
    if mc.local_rope_theta is not None:
        local = RotaryEmbedding(mc.head_dim, 256, mc.local_rope_theta, None, torch.float32, "cpu", mc.rotary_dim)
        tables = [(tables[0][0], ("full_attention",)), (local, ("sliding_attention",))]
    half = mc.rotary_dim // 2
    for ours, layer_type in tables:
        cos, sin = rotary_emb(x, positions[None], *layer_type)
        assert torch.equal(ours.cos, cos[0])
        assert torch.equal(ours.signed_sin, torch.cat((-sin[0][:, :half], sin[0][:, half:]), -1))


def test_gemma_local_layers_see_only_their_window(tmp_path: Path) -> None:
    """The window is what makes the answers above match: without it the same weights give other logits
    for a prompt longer than the window (and Hugging Face's answers follow the windowed model)."""
    fields = {k: v for k, v in FAMILIES["gemma3-local-global"].items() if k != "arch"}
    windowed = make_tiny_model(tmp_path / "w", "Gemma3ForCausalLM", **fields)
    unwindowed = make_tiny_model(tmp_path / "u", "Gemma3ForCausalLM", **{**fields, "sliding_window": 4096})
    randomise_norms(windowed)
    randomise_norms(unwindowed)
    ids = _exact(windowed, kv_cache_memory_gib=0.02).tokenizer.encode(PROMPTS[1])
    assert len(ids) > 8
    a = _exact(windowed, kv_cache_memory_gib=0.02).prompt_logits(ids)
    b = _exact(unwindowed, kv_cache_memory_gib=0.02).prompt_logits(ids)
    assert torch.equal(a[:8], b[:8])  # the first 8 positions see the same keys either way
    assert not torch.allclose(a[8:], b[8:], atol=1e-3)


def test_a_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path: Path) -> None:
    """google/gemma-3-4b-it and larger come as Gemma3ForConditionalGeneration: their text model (the
    weights under language_model.) answers as Hugging Face's does for a text-only prompt."""
    import transformers

    from tests.tiny_model import save_bundled_tokenizer

    text = transformers.Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    save_bundled_tokenizer(tmp_path)
    randomise_norms(tmp_path)
    llm = _exact(tmp_path, kv_cache_memory_gib=0.02)
    assert llm.core.runner.mc.architecture == "Gemma3ForCausalLM"
    for out in llm.generate(PROMPTS[:2], GREEDY_32):
        assert out.outputs[0].token_ids == _hf(tmp_path, out.prompt_token_ids, 32)


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


# GGUF files as llama.cpp's converter writes them. Its Gemma files imply the layer pattern (every 6th
# layer global in Gemma 3, every 2nd in Gemma 2) and query_pre_attn_scalar (the head size), so these
# tiny models keep to both.
GGUF_MODELS = {
    **{name: dict(arch="Phi3ForCausalLM", **fields) for name, fields in PHI3.items()},
    "gemma3": dict(
        arch="Gemma3ForCausalLM", **GEMMA, query_pre_attn_scalar=16, rope_scaling={"rope_type": "linear", "factor": 8.0}
    ),
    "gemma2": dict(arch="Gemma2ForCausalLM", **GEMMA, query_pre_attn_scalar=16),
    "smollm3": FAMILIES["smollm3-nope"],
    "qwen3-yarn": FAMILIES["qwen3-yarn"],
    "llama3.1-rope": FAMILIES["llama3.1-rope"],
}


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_a_llama_cpp_style_gguf_runs_the_models_own_tokens(name: str, tmp_path: Path) -> None:
    """The same weights written as llama.cpp writes the family's GGUF (Phi-3: fused attn_qkv and
    ffn_up, LongRoPE factor tensors; Gemma: norms stored with their 1 added, the extra norms;
    SmolLM3 and Llama: q/k rows permuted, every 4th SmolLM3 layer without RoPE; Llama 3.1: its rope
    frequency factors as a tensor; Qwen3: YaRN in the metadata) give
    Hugging Face's tokens in float32; in Q8_0 and Q4_0 they run natively and follow the float run of
    the de-quantised weights."""
    model_dir = make_tiny_model(tmp_path / name, **GGUF_MODELS[name])
    if name.startswith("gemma"):
        randomise_norms(model_dir)
    gguf32 = write_hf_model_gguf(model_dir, tmp_path / "f32.gguf", "F32")
    float_run = _exact(gguf32, kv_cache_memory_gib=0.02, max_num_batched_tokens=16)
    for out in float_run.generate(PROMPTS[:2], GREEDY_32):
        assert out.outputs[0].token_ids == _hf(model_dir, out.prompt_token_ids, 32)
    for type_name in ("Q8_0", "Q4_0"):
        path = write_hf_model_gguf(model_dir, tmp_path / f"{type_name}.gguf", type_name)
        native = LLM(str(path), kv_cache_memory_gib=0.02)
        exact = _exact(path, kv_cache_memory_gib=0.02)
        assert native.config.quantization == "gguf"
        agree = total = 0
        for out in exact.generate(PROMPTS, GREEDY_32):
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            a, b = exact.prompt_logits(ids), native.prompt_logits(ids)
            # int8 activations only: 2-4% per 2 layers here (the 4-layer SmolLM3 reaches 5.4% in Q4_0)
            assert float((a - b).norm() / a.norm()) < 0.07, type_name
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(ids)
        # Tiny random models have many near-tied logits: a wrong mapping agrees at ~0, these at 0.89-0.96.
        assert agree / total >= 0.85, type_name
