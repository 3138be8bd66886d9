"""ggml's tensor types as a GGUF file numbers them: name, weights per block and bytes per block.

Why our own table and not the `gguf` package's: importing `gguf` costs ~0.1 s (it loads its writer,
metadata and vocabulary modules too), which every engine start paid just to read a tensor table.
tests/test_gguf_file.py checks this table against the `gguf` package's, entry for entry.
"""

from __future__ import annotations

from typing import NamedTuple


class GGMLType(NamedTuple):
    name: str
    block_weights: int
    block_bytes: int


GGML_TYPES: dict[int, GGMLType] = {
    type_id: GGMLType(name, weights, size)
    for type_id, name, weights, size in (
        (0, "F32", 1, 4),
        (1, "F16", 1, 2),
        (2, "Q4_0", 32, 18),
        (3, "Q4_1", 32, 20),
        (6, "Q5_0", 32, 22),
        (7, "Q5_1", 32, 24),
        (8, "Q8_0", 32, 34),
        (9, "Q8_1", 32, 40),
        (10, "Q2_K", 256, 84),
        (11, "Q3_K", 256, 110),
        (12, "Q4_K", 256, 144),
        (13, "Q5_K", 256, 176),
        (14, "Q6_K", 256, 210),
        (15, "Q8_K", 256, 292),
        (16, "IQ2_XXS", 256, 66),
        (17, "IQ2_XS", 256, 74),
        (18, "IQ3_XXS", 256, 98),
        (19, "IQ1_S", 256, 50),
        (20, "IQ4_NL", 32, 18),
        (21, "IQ3_S", 256, 110),
        (22, "IQ2_S", 256, 82),
        (23, "IQ4_XS", 256, 136),
        (24, "I8", 1, 1),
        (25, "I16", 1, 2),
        (26, "I32", 1, 4),
        (27, "I64", 1, 8),
        (28, "F64", 1, 8),
        (29, "IQ1_M", 256, 56),
        (30, "BF16", 1, 2),
        (34, "TQ1_0", 256, 54),
        (35, "TQ2_0", 256, 66),
        (39, "MXFP4", 32, 17),
        (40, "NVFP4", 64, 36),
        (41, "Q1_0", 128, 18),
    )
}
