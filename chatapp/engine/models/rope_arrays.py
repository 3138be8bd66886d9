"""RoPE tables in numpy, for the torch-free CPU engine (array_runner.py).

The same formulas as rope.py (Hugging Face's, float32 throughout), each op in the order and
precision torch runs it, and cos/sin from torch's own kernels through our extension (``trig``), so
the tables equal rope.py's bit for bit and both runners give the same tokens. With numpy's cos
and sin instead they differ in the last bit of one value in six.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

F32 = np.float32
Trig = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""float32 angles -> (cos, sin): our extension's cos_sin (torch's kernels) or numpy_trig."""


def numpy_trig(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.cos(angles), np.sin(angles)


def _power(base: float, exponents: np.ndarray) -> np.ndarray:
    """base ** exponents rounded to float32 as torch rounds a Python float's power of a float32 tensor."""
    powers: np.ndarray = np.power(np.float64(base), exponents.astype(np.float64)).astype(F32)
    return powers


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False
) -> np.ndarray:
    """Each rotated pair's frequency (rope.inverse_frequencies in numpy)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(F32) / F32(rotary_dim)
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = np.asarray(scaling["long_factor" if long else "short_factor"], dtype=F32)
        longrope: np.ndarray = F32(1.0) / (factors * _power(theta, exponents))
        return longrope
    inv_freq = F32(1.0) / _power(theta, exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = F32(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "freq_factors":
        return inv_freq / np.asarray(scaling["factors"], dtype=F32)
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling)
    if kind == "llama3":
        low = F32(scaling.get("low_freq_factor", 1.0))
        high = F32(scaling.get("high_freq_factor", 4.0))
        old_len = F32(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        # torch divides a Python number by a tensor as reciprocal(tensor) * number
        wavelen = (F32(1.0) / inv_freq) * F32(2 * math.pi)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = ((F32(1.0) / wavelen) * old_len - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        frequencies: np.ndarray = np.where(medium, smoothed, scaled).astype(F32)
        return frequencies
    raise ValueError(f"unsupported rope type {kind!r}")


def yarn_ramp(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[float, float]:
    """YaRN's (low, high) pair indices: pairs below low keep their frequency (they turn fast), pairs
    above high are interpolated by the factor, with a linear ramp between (from beta_fast/slow).
    Plain numbers, shared by both tables (rope.py's too)."""
    original = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    return low, high


def _yarn(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling["factor"])
    low, high = yarn_ramp(rotary_dim, theta, scaling)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1)
    keep = 1 - ramp
    pos_freqs = _power(theta, np.arange(0, rotary_dim, 2).astype(F32) / F32(rotary_dim))
    blended: np.ndarray = (F32(1.0) / (F32(factor) * pos_freqs)) * (1 - keep) + (F32(1.0) / pos_freqs) * keep
    return blended.astype(F32)


def attention_scaling(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (LongRoPE and YaRN keep attention's sharpness at long range); else 1."""
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
        return mscale(factor)
    original = int(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    rotary_dim: int | None,
    trig: Trig,
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, signed_sin), float32 [max_positions, rotary_dim], as rope.RotaryEmbedding's buffers."""
    dim = rotary_dim or head_dim
    positions = np.arange(max_positions, dtype=F32)
    freqs = np.outer(positions, inverse_frequencies(dim, theta, scaling)).astype(F32)
    if scaling is not None and scaling["rope_type"] == "longrope":
        long = np.outer(positions, inverse_frequencies(dim, theta, scaling, long=True)).astype(F32)
        past = positions[:, None] >= scaling["original_max_position_embeddings"]
        freqs = np.where(past, long, freqs)
    scale = F32(attention_scaling(scaling))
    cos, sin = trig(np.ascontiguousarray(freqs, dtype=F32))
    cos, sin = cos * scale, sin * scale
    return np.concatenate((cos, cos), -1).astype(F32), np.concatenate((-sin, sin), -1).astype(F32)
