"""The packed block kinds our C++ kernels run (csrc/block_quant.h): names, sizes and the GGUF types
they hold exactly. Torch-free, so the engine's torch-free CPU path (array_runner.py) can read them."""

from __future__ import annotations

BLOCK = 32  # input channels per scale
TILE = 16  # output channels per packed tile

# Packed kinds (csrc/block_quant.h): what each holds exactly.
KIND_Q4 = 4  # 4-bit codes, fp16 scale and minimum per 32: Q4_1
KIND_Q4S = 5  # 4-bit codes offset by 8, fp16 scale per 32: Q4_0 (its 18 bytes a block, no minimum to read)
KIND_Q5S = 6  # 5-bit codes offset by 16, fp16 scale per 32: Q5_0 (its 22 bytes a block)
KIND_Q5M = 7  # 5-bit codes, fp16 scale and minimum per 32: Q5_1 (its 24 bytes a block)
KIND_Q8 = 8  # 8-bit codes offset by 128, fp16 scale per 32: Q8_0
KIND_IQ4NL = 9  # 4-bit indices into IQ4_NL's 16 values, fp16 scale per 32: IQ4_NL (its 18 bytes a block)
KIND_Q4K, KIND_Q5K, KIND_Q6K = 104, 105, 106  # super-blocks of 256 with integer sub-block scales
KIND_IQ4X = 108  # IQ4_XS: 4-bit indices into 16 values, fp16 d per 256, int8 scale (ls - 32) per 32
K_KINDS = (KIND_Q4K, KIND_Q5K, KIND_Q6K, KIND_IQ4X)
SUPER_BLOCK = 256
# Float rows (csrc/float_rows.cpp): F16 / BF16 weights [N, K] as the file stores them, no tiles, read in place.
KIND_F16_ROWS, KIND_BF16_ROWS = 1, 2
ROW_KINDS = (KIND_F16_ROWS, KIND_BF16_ROWS)
ROW_LANES = 16  # a float rows kind's rows are summed 16 inputs at a time: K must be a multiple


# GGUF type -> the packed kind that holds it exactly (csrc/gguf_repack.cpp), and bytes per (tile, block).
KIND_FOR_GGUF_TYPE = {
    "Q4_0": KIND_Q4S,
    "Q4_1": KIND_Q4,
    "Q5_0": KIND_Q5S,
    "Q8_0": KIND_Q8,
    "Q5_1": KIND_Q5M,
    "Q4_K": KIND_Q4K,
    "Q5_K": KIND_Q5K,
    "Q6_K": KIND_Q6K,
    "IQ4_XS": KIND_IQ4X,
    "IQ4_NL": KIND_IQ4NL,
    # held exactly by a kind of another type (gguf_repack.cpp says how), at 1.9x the file's bytes
    "Q3_K": KIND_Q6K,
    # the file's own rows, read in place by csrc/float_rows.cpp (no repack)
    "F16": KIND_F16_ROWS,
    "BF16": KIND_BF16_ROWS,
}
TILE_BYTES = {
    KIND_Q4: 320,
    KIND_Q4S: 288,
    KIND_Q5S: 352,
    KIND_Q5M: 384,
    KIND_Q8: 544,
    KIND_IQ4NL: 288,
    KIND_Q4K: 2304,
    KIND_Q5K: 2816,
    KIND_Q6K: 3360,
    KIND_IQ4X: 2208,
}


def block_inputs(kind: int) -> int:
    """Input channels per packed block of this kind (a float rows kind's lanes)."""
    return SUPER_BLOCK if kind in K_KINDS else ROW_LANES if kind in ROW_KINDS else BLOCK


def packed_bytes(kind: int, rows: int, k: int) -> int:
    """Bytes a packing of this kind holds for ``rows`` outputs of ``k`` inputs (tiles padded to 16 rows)."""
    if kind in ROW_KINDS:
        return rows * k * 2
    return -(-rows // TILE) * (k // block_inputs(kind)) * TILE_BYTES[kind]


def packs(kind: int, k: int) -> bool:
    """Whether a row of ``k`` inputs fits this kind's blocks (else the weights run in float32)."""
    return k % block_inputs(kind) == 0
