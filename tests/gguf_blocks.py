"""Random but valid GGUF blocks of every type our kernels take (the `gguf` package writes only some).

Codes and integer scales are random bytes; the fp16 scale fields get sane magnitudes, so the
weights they make are finite and of a chosen size. Tests and benchmarks/gguf_files.py use it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# type -> (byte offsets of fp16 scales, byte offsets of fp16 minimums), per block
_FP16_FIELDS = {
    "Q4_0": ([0], []),
    "Q4_1": ([0], [2]),
    "Q5_0": ([0], []),
    "Q5_1": ([0], [2]),
    "Q8_0": ([0], []),
    "Q4_K": ([0, 2], []),
    "Q5_K": ([0, 2], []),
    "Q6_K": ([208], []),
    "Q3_K": ([108], []),
    "IQ4_NL": ([0], []),
    "IQ4_XS": ([0], []),
    "Q2_K": ([80], [82]),
}
# A typical |weight| per unit of the fp16 scale, to aim the weights' size: codes x integer scales.
_SCALE_UNIT = {
    "Q4_0": 8,
    "Q4_1": 8,
    "Q5_0": 16,
    "Q5_1": 16,
    "Q8_0": 64,
    "Q4_K": 8 * 32,
    "Q5_K": 16 * 32,
    "Q6_K": 32 * 64,
    "Q3_K": 4 * 32,
    "IQ4_NL": 64,
    "IQ4_XS": 64 * 16,
    "Q2_K": 2 * 8,
}
WIDENED_TYPES = ("Q3_K",)
"""Types held exactly by another type's packed kind, at more bytes a weight (csrc/gguf_repack.cpp)."""
FLOAT32_TYPES = ("Q2_K",)
"""Types no kind holds: the engine runs them de-quantised to float32."""
BLOCK_TYPES = tuple(t for t in _FP16_FIELDS if t not in WIDENED_TYPES + FLOAT32_TYPES)
"""Types with a packed kind of their own."""


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, weight_size: float = 0.05) -> np.ndarray:
    """uint8 [rows, row bytes]: ``rows`` rows of ``k`` weights in GGUF type ``type_name``."""
    qtype = GGMLQuantizationType[type_name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    scales, mins = _FP16_FIELDS[type_name]
    unit = weight_size / _SCALE_UNIT[type_name]
    for offset in scales:
        d = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * unit).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    for offset in mins:
        m = (rng.uniform(-1.0, 0.0, size=blocks.shape[:2]) * weight_size).astype(np.float16)
        blocks[..., offset : offset + 2] = m.view(np.uint8).reshape(*m.shape, 2)
    return blocks.reshape(rows, -1)
