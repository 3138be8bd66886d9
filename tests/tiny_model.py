"""Tiny randomly initialised models for fast engine tests.

They borrow the bundled SmolLM2 tokenizer (built from its GGUF file once and cached), so
prompts, chat templates and detokenisation are real; only the weights are tiny.
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(
    path: Path,
    arch: str = "LlamaForCausalLM",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
    init_std: float = 0.25,
    seed: int = 0,
    **config_fields: object,
) -> Path:
    """Write a random model of the given Llama-family architecture (HF format) to ``path``.

    config_fields: anything else for the config class (rope scaling, partial rotary, ...).
    """
    import transformers

    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "SmolLM3ForCausalLM": transformers.SmolLM3Config,
    }[arch]
    fields = dict(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
        sliding_window=None,
    )
    config = config_cls(**{**fields, **config_fields})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    save_bundled_tokenizer(path)
    return path


def save_bundled_tokenizer(path: Path) -> None:
    """The bundled model's tokenizer files (tokenizer.json, chat template, ...) into ``path``.

    Where the bundled model is not installed (a lent GPU machine, which takes only a small working
    tree), CHATAPP_TEST_TOKENIZER_DIR names a copy of those files.
    """
    import os
    import shutil

    from chatapp.engine.tokenizer import prepare_tokenizer_files
    from chatapp.store import bundled_gguf_path

    copy = os.environ.get("CHATAPP_TEST_TOKENIZER_DIR")
    source = Path(copy) if copy else prepare_tokenizer_files(bundled_gguf_path())
    shutil.copytree(source, path, dirs_exist_ok=True)


def write_llama_checkpoint(
    path: Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 2,
    seed: int = 0,
) -> Path:
    """A random Llama checkpoint in Hugging Face's layout, written tensor by tensor (no model object,
    so checkpoints of hundreds of MB take seconds), sharded with an index as the Hub's are."""
    import json

    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    config.architectures = ["LlamaForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(path / "config.json")
    gen = torch.Generator().manual_seed(seed)
    d = hidden_size // num_heads

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors: list[tuple[str, torch.Tensor]] = [("model.embed_tokens.weight", rand(49152, hidden_size))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", torch.ones(hidden_size, dtype=dtype)),
            (p + "post_attention_layernorm.weight", torch.ones(hidden_size, dtype=dtype)),
            (p + "self_attn.q_proj.weight", rand(num_heads * d, hidden_size)),
            (p + "self_attn.k_proj.weight", rand(num_kv_heads * d, hidden_size)),
            (p + "self_attn.v_proj.weight", rand(num_kv_heads * d, hidden_size)),
            (p + "self_attn.o_proj.weight", rand(hidden_size, num_heads * d)),
            (p + "mlp.gate_proj.weight", rand(intermediate_size, hidden_size)),
            (p + "mlp.up_proj.weight", rand(intermediate_size, hidden_size)),
            (p + "mlp.down_proj.weight", rand(hidden_size, intermediate_size)),
        ]
    tensors.append(("model.norm.weight", torch.ones(hidden_size, dtype=dtype)))
    if not tie_word_embeddings:
        tensors.append(("lm_head.weight", rand(49152, hidden_size)))
    per_shard = -(-len(tensors) // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = dict(tensors[s * per_shard : (s + 1) * per_shard])
        save_file(chunk, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_bundled_tokenizer(path)
    return path
