"""Rotary position embeddings (the rotate-half layout Hugging Face Llama uses)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "freq_factors":  # a GGUF file's rope_freqs tensor (llama.cpp divides by it)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
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


class RotaryEmbedding(torch.nn.Module):
    """Precomputed tables; a step looks up its positions once and every layer reuses them.

    rotate_half(x) * sin equals roll(x, D/2) * [-sin, sin], so a rotation is
    x * cos + roll(x) * signed_sin: four ops for q and k together, with the
    same float results as Hugging Face's formula.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # float32 throughout, as Hugging Face computes it, so positions rotate identically.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        cos, sin = freqs.cos(), freqs.sin()
        self.half = head_dim // 2
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), -1).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) shaped [T, 1, D] for a step's positions."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [T, heads, D] by the looked-up table."""
        cos, sin = table
        return x * cos + x.roll(self.half, dims=-1) * sin
