"""Rotary position embeddings (the rotate-half layout Hugging Face Llama uses)."""

from __future__ import annotations

import math
from typing import Any

import torch

from chatapp.engine.models.rope_arrays import attention_scaling, yarn_ramp


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False
) -> torch.Tensor:
    """Each rotated pair's frequency, as Hugging Face computes it (float32 throughout).

    long: LongRoPE's long-context factors instead of its short ones (other types ignore it).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "freq_factors":  # a GGUF file's rope_freqs tensor (llama.cpp divides by it)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, theta, scaling)
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {kind!r}")


def _yarn_inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (Qwen's long-context setting): pairs that turn fast keep their frequency, slow ones are
    interpolated by the factor, with a linear ramp between (the dimension range from beta_fast/slow)."""
    factor = float(scaling["factor"])
    low, high = yarn_ramp(rotary_dim, theta, scaling)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each pair's original (extrapolated) frequency
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


class RotaryEmbedding(torch.nn.Module):
    """Precomputed tables; a step looks up its positions once and every layer reuses them.

    rotate_half(x) * sin equals roll(x, D/2) * [-sin, sin], so a rotation is
    x * cos + roll(x) * signed_sin: four ops for q and k together, with the
    same float results as Hugging Face's formula.
    """

    cos: torch.Tensor  # buffers (register_buffer below)
    signed_sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        # float32 throughout, as Hugging Face computes it, so positions rotate identically.
        freqs = torch.outer(positions, inverse_frequencies(self.rotary_dim, theta, scaling).float())
        if scaling is not None and scaling["rope_type"] == "longrope":
            # Positions past the pretraining length take the long factors, earlier ones the short: a
            # position's rotation never depends on what else is in the batch or how a prompt was
            # chunked. (Hugging Face switches a whole forward pass to the long factors once its
            # longest sequence passes that length; below it, the two agree.)
            long = torch.outer(positions, inverse_frequencies(self.rotary_dim, theta, scaling, long=True).float())
            past = positions[:, None] >= scaling["original_max_position_embeddings"]
            freqs = torch.where(past, long, freqs)
        scale = attention_scaling(scaling)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.half_dim = self.rotary_dim // 2
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), -1).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) shaped [T, 1, rotary_dim] for a step's positions."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [T, heads, D] by the looked-up table (its first rotary_dim dimensions; the rest pass)."""
        cos, sin = table
        if self.rotary_dim == x.shape[-1]:
            return x * cos + x.roll(self.half_dim, dims=-1) * sin
        rot = x[..., : self.rotary_dim]
        return torch.cat((rot * cos + rot.roll(self.half_dim, dims=-1) * sin, x[..., self.rotary_dim :]), dim=-1)
