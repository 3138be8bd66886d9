"""What the engine needs to know about a model, read from its Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4 (fused qkv and gate_up, LongRoPE, partial rotary)
    "Gemma2ForCausalLM",  # local/global layers, sandwich norms, GeGLU, logit soft-capping
    "Gemma3ForCausalLM",  # Gemma 3 text (1B; GGUF files of every size): q/k norms, two RoPE bases
    "SmolLM3ForCausalLM",  # Llama with every 4th layer unrotated (NoPE)
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")  # Gemma 2's, by config and GGUF name
# Multimodal checkpoints whose text model we run (the vision tower's weights are left unread).
MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# Architectures whose attention Hugging Face limits to config.sliding_window at every layer: every
# layer is a local one (attention.py and the C++ kernel window it), the context is not capped.
_WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM")


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class UnsupportedModelError(ValueError):
    """The model exists but our engine cannot run it; the message says why."""


class ModelConfigError(ValueError):
    """A model directory's config.json is not JSON, or lacks (or garbles) a field every model has."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    checkpoint_dtype: torch.dtype | None
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that RoPE rotates (Phi-4-mini: 0.75)
    # Sliding windows (Gemma's local layers; every layer of a windowed Mistral or Phi-3).
    sliding_window: int | None = None  # keys a local layer sees: its own and the window - 1 before
    local_layers: tuple[bool, ...] = ()  # per layer: sliding-window (local) attention
    nope_layers: tuple[bool, ...] = ()  # per layer: no RoPE at all (SmolLM3's every 4th layer)
    # Gemma 2 / 3 (models/gemma.py); the defaults are the Llama family's.
    local_rope_theta: float | None = None  # the local layers' RoPE base (Gemma 3), unscaled
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    norm_weight_offset: float = 0.0  # checkpoint norm weights w stand for w + offset (Gemma: 1)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (the first ones); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    def layer_is_local(self, layer: int) -> bool:
        return bool(self.local_layers) and self.local_layers[layer]

    def layer_uses_rope(self, layer: int) -> bool:
        return not (self.nope_layers and self.nope_layers[layer])

    @property
    def attention_scale(self) -> float:
        return cast(float, (self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in float32 (halve for 16-bit caches)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def num_parameters(self) -> int:
        """Parameter count from the shapes, for memory estimates before a download."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


def _eos_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _checkpoint_dtype(name: str | None) -> torch.dtype | None:
    if name not in ("float16", "bfloat16", "float32"):
        return None
    import torch  # here: model facts read configs in clients, which do not load torch

    return cast(torch.dtype, getattr(torch, name))


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text config, as its text-only architecture's (others: as they are)."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in MULTIMODAL_TEXT_MODELS or not isinstance(hf.get("text_config"), dict):
        return hf
    text = dict(hf["text_config"], architectures=[MULTIMODAL_TEXT_MODELS[archs[0]]])
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if key in hf and text.get(key) is None:
            text[key] = hf[key]
    return text


def check_supported(hf_config: dict[str, Any]) -> str:
    """Return the architecture name, or raise UnsupportedModelError naming it."""
    hf_config = text_model_config(hf_config)
    archs = hf_config.get("architectures") or []
    arch = archs[0] if archs else f"<model_type {hf_config.get('model_type', 'unknown')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model architecture {arch} is not supported by chatapp's engine; "
            f"it runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _, scaling = _rope_params(hf_config)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} with rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return arch


def _rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers 4 or the transformers 5 layout.

    LongRoPE (Phi-3) and YaRN (Qwen) get what their tables need in the one dict:
    original_max_position_embeddings (Phi-3 configs keep it at the top level) and the factor.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            return theta, None
        scaling.setdefault("rope_type", scaling.get("type"))
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            return theta, None
    if scaling["rope_type"] in ("su", "yarn") and "short_factor" in scaling:  # Phi-3's older names
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] in ("longrope", "yarn"):
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        original = int(original or hf.get("max_position_embeddings") or 4096)
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = int(hf.get("max_position_embeddings") or original) / original
    return theta, scaling


def _partial_rotary_factor(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return float(hf.get("partial_rotary_factor") or 1.0)


def _gemma_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's extra fields, from the transformers 4 or 5 config layout."""
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if not layer_types:  # older configs: every n-th layer is global
        pattern = int(hf.get("sliding_window_pattern") or (6 if arch == "Gemma3ForCausalLM" else 2))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        theta = float(full.pop("rope_theta", 10000.0))
        kind = full.get("rope_type", full.get("type", "default"))
        scaling = None if kind == "default" else {**full, "rope_type": kind}
        local_theta = float(local.get("rope_theta", 10000.0))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"{arch} with rope scaling {kind!r} is not supported")
    else:
        theta, scaling = _rope_params(hf)
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{arch} with activation {activation!r} is not supported")
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "sliding_window": int(hf["sliding_window"]) if hf.get("sliding_window") else None,
        "local_layers": tuple(t == "sliding_attention" for t in layer_types),
        "local_rope_theta": local_theta if arch == "Gemma3ForCausalLM" else None,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
        **{key: optional_float(hf.get(key)) for key in SOFTCAP_FIELDS},
        "norm_weight_offset": 1.0,
        "qk_norm": arch == "Gemma3ForCausalLM",
    }


def _smollm3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3: which layers skip RoPE (no_rope_layers[i] is 1 where a layer rotates), and the
    optional window of those NoPE layers."""
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    fields: dict[str, Any] = {"nope_layers": tuple(not bool(x) for x in uses_rope)}
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
        fields["local_layers"] = tuple(not bool(x) for x in uses_rope)
    return fields


def check_sizes(mc: ModelConfig) -> None:
    """ValueError for sizes no model has: a zero, negative, NaN or inconsistent count from a corrupt or
    hand-edited config, which would otherwise divide by zero or size a tensor negatively deep in the engine."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):  # fmt: skip
        if getattr(mc, name) < 1:
            raise ValueError(f"the model's {name} is {getattr(mc, name)}")
    if mc.num_heads % mc.num_kv_heads:
        raise ValueError(f"{mc.num_heads} attention heads do not share {mc.num_kv_heads} KV heads evenly")
    if not 0 < mc.partial_rotary_factor <= 1:
        raise ValueError(f"the rotary dimension is {mc.partial_rotary_factor:g} x the head size of {mc.head_dim}")
    if not (math.isfinite(mc.rope_theta) and mc.rope_theta > 0):
        raise ValueError(f"the RoPE base frequency is {mc.rope_theta}")
    if not (math.isfinite(mc.rms_norm_eps) and mc.rms_norm_eps >= 0):
        raise ValueError(f"the RMS norm epsilon is {mc.rms_norm_eps}")


def model_config_from_dict(hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    hf = text_model_config(hf)
    arch = check_supported(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    family = _gemma_fields(arch, hf) if arch in GEMMA_ARCHITECTURES else {}  # fields beyond the Llama family's
    theta, scaling = (family.pop("rope_theta"), family.pop("rope_scaling")) if family else _rope_params(hf)
    max_len = int(hf.get("max_position_embeddings") or 4096)
    window = hf.get("sliding_window")
    if arch == "SmolLM3ForCausalLM":
        family = _smollm3_fields(hf)
    elif window and arch in _WINDOWED and window < max_len:
        family = {"sliding_window": int(window), "local_layers": (True,) * int(hf["num_hidden_layers"])}
    elif window and hf.get("use_sliding_window"):  # Qwen2's per-layer rule: not ours; stay exact by capping
        max_len = min(max_len, int(window))
    eos = _eos_ids(hf.get("eos_token_id")) | _eos_ids((generation_config or {}).get("eos_token_id"))
    tie_default = arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM", *GEMMA_ARCHITECTURES)
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_len,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family.pop("qk_norm", arch == "Qwen3ForCausalLM"),
        eos_token_ids=frozenset(eos),
        bos_token_id=hf.get("bos_token_id"),
        checkpoint_dtype=_checkpoint_dtype(hf.get("torch_dtype") or hf.get("dtype")),
        partial_rotary_factor=_partial_rotary_factor(hf),
        **family,
    )
    check_sizes(config)
    return config


def load_model_config(model_dir: Path) -> ModelConfig:
    """A model directory's config; a broken config.json (a bad edit, a cut download) is a ModelConfigError
    naming the file and the field, not a KeyError from deep in here."""
    config_path = model_dir / "config.json"
    hf = read_json_object(config_path, ModelConfigError)
    gen_path = model_dir / "generation_config.json"
    gen = read_json_object(gen_path, ModelConfigError) if gen_path.exists() else None
    try:
        return model_config_from_dict(hf, gen)
    except UnsupportedModelError:
        raise
    except KeyError as exc:
        raise ModelConfigError(f"{config_path} lacks the field {exc.args[0]!r}") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ModelConfigError(f"{config_path} has a field of the wrong kind or size ({exc})") from None


def read_json_object(path: Path, error: type[ValueError]) -> dict[str, Any]:
    """A model file that must hold a JSON object (config.json, tokenizer_config.json); ``error`` naming the
    file where it is not JSON, not UTF-8, or not an object."""
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value
