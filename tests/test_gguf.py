"""GGUF files read in place: every type exact, our kernels' arithmetic, whole files, bad files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from chatapp.engine import LLM, SamplingParams, cpu_kernels
from chatapp.engine.block_quant import K_KINDS, KIND_FOR_GGUF_TYPE, BlockQuantLinear, block_inputs, dequantize
from chatapp.engine.models.config import UnsupportedModelError
from chatapp.engine.models.gguf_file import GGUFError, GGUFTensor
from chatapp.engine.models.gguf_weights import EmbeddingTable
from tests.activation_reference import int8_activations
from tests.gguf_blocks import BLOCK_TYPES, WIDENED_TYPES, random_blocks
from tests.gguf_models import LlamaShape, write_llama_gguf

KIND_OF = {
    "Q4_0": 5,
    "Q4_1": 4,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 104,
    "Q5_K": 105,
    "Q6_K": 106,
    "IQ4_NL": 9,
    "IQ4_XS": 108,
}


@pytest.fixture(scope="module")
def ext():
    ext = cpu_kernels.load()
    assert ext is not None and ext.block_quant_paths() == ["vnni", "avx2", "portable"], (
        "these machines build every loop"
    )
    return ext


def repack(ext, raw: np.ndarray, type_name: str, k: int) -> tuple[torch.Tensor, int]:
    return ext.repack_gguf(torch.from_numpy(raw), int(GGMLQuantizationType[type_name]), k)


# --- every type, exactly ------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_every_type_keeps_the_files_weights_bit_for_bit(ext, type_name: str) -> None:
    """Our packing de-quantises to exactly what gguf's own de-quantisation gives, on random blocks."""
    rng = np.random.default_rng(len(type_name))
    for rows, k in ((40, 512), (16, 256), (3, 1024)):  # 40 and 3: tiles padded with empty channels
        raw = random_blocks(type_name, rows, k, rng)
        packed, kind = repack(ext, raw, type_name, k)
        assert kind == KIND_OF[type_name]
        ours = dequantize(packed, kind, rows).numpy()
        theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])
        assert ours.shape == theirs.shape == (rows, k)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


ROW_DECODED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_embedding_rows_are_the_files_weights_bit_for_bit(ext, type_name: str) -> None:
    """A step's token embedding lookup (EmbeddingTable): the extension decodes the types it takes, `gguf` the
    rest, and either way each row has gguf's bits, in the tokens' order, repeats and all."""
    rng = np.random.default_rng(11 + len(type_name))
    raw = random_blocks(type_name, 50, 512, rng)
    type_id = int(GGMLQuantizationType[type_name])
    assert ext.dequantizes_gguf_rows(type_id) == (type_name in ROW_DECODED_TYPES)
    table = EmbeddingTable(GGUFTensor("token_embd.weight", type_name, type_id, (50, 512), raw, 0), ext)
    ids = np.array([7, 3, 7, 49, 0], dtype=np.int64)
    ours = table.rows(ids)
    theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])[ids]
    assert ours.dtype == np.float32 and ours.shape == (5, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    if type_name in ROW_DECODED_TYPES:  # rows of the wrong length are refused, not read past
        with pytest.raises(RuntimeError, match="do not match"):
            ext.dequantize_gguf_rows(raw[:, :-2], type_id, 512, np.empty((50, 512), np.float32))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_rows_taken_in_another_order_pack_as_those_rows_would(ext, type_name: str) -> None:
    """row_order (llama.cpp's q/k rows put back in rotate-half order) on whole tiles and a padded one: the
    whole-tile writers take each channel's row through it as the channel-by-channel path does."""
    rng = np.random.default_rng(7 + len(type_name))
    raw = random_blocks(type_name, 40, 512, rng)
    order = rng.permutation(40)
    type_id = int(GGMLQuantizationType[type_name])
    reordered, _ = ext.repack_gguf(torch.from_numpy(raw), type_id, 512, torch.from_numpy(order))
    expected, _ = repack(ext, np.ascontiguousarray(raw[order]), type_name, 512)
    assert torch.equal(reordered, expected)


@pytest.mark.parametrize("type_name", [*WIDENED_TYPES, "IQ4_NL", "IQ4_XS"])
def test_decoded_types_keep_the_files_weights_bit_for_bit(ext, type_name: str) -> None:
    """Q3_K (held by Q6_K's kind), IQ4_NL and IQ4_XS (by kinds that look their indices' values up) packed and
    de-quantised give exactly what gguf's own de-quantisation of the file's blocks gives, every code and
    packed scale bit clear and set too."""
    rng = np.random.default_rng(17)
    block_bytes, d = {"Q3_K": (110, slice(108, 110)), "IQ4_NL": (18, slice(0, 2)), "IQ4_XS": (136, slice(0, 2))}[
        type_name
    ]
    for rows, k in ((40, 512), (3, 1024)):  # 40 and 3: tiles padded with empty channels
        raw = random_blocks(type_name, rows, k, rng)
        extremes = []
        for fill in (0x00, 0xFF):
            extreme = raw.copy().reshape(rows, -1, block_bytes)
            kept = extreme[..., d].copy()
            extreme[...] = fill
            extreme[..., d] = kept
            extremes.append(extreme.reshape(rows, -1))
        for blocks in (raw, *extremes):
            packed, kind = repack(ext, blocks, type_name, k)
            assert kind == KIND_FOR_GGUF_TYPE[type_name]
            ours = dequantize(packed, kind, rows).numpy()
            theirs = quants.dequantize(blocks, GGMLQuantizationType[type_name])
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


# Bytes a decode step reads per weight over the file's own: single-stream decode streams every weight once,
# so a packing larger than the file is that much slower. IQ4_XS keeps its 6-bit scales as whole bytes (1.5% over
# the file); every other kind is the file's size exactly (Q4_K's and Q5_K's 6-bit scales packed as tightly).
PACKED_OVER_FILE = {"IQ4_XS": 2208 / 2176}


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_a_packing_is_the_files_size_but_for_the_bytes_its_kind_needs(ext, type_name: str) -> None:
    rows, k = 64, 1024  # whole tiles: no padding channels
    raw = random_blocks(type_name, rows, k, np.random.default_rng(3))
    packed, _ = repack(ext, raw, type_name, k)
    assert packed.numel() / raw.nbytes == pytest.approx(PACKED_OVER_FILE.get(type_name, 1.0))


def reference_product(x: torch.Tensor, weights: torch.Tensor, block: int) -> torch.Tensor:
    """The kernels' defined arithmetic in float64: each row's activations rounded to int8 as the kernels
    round them (tests/activation_reference.py) times the exact weights. (Minimums of blocks of 32 multiply
    the quantized activations' sum, so they fit this too.)"""
    return int8_activations(x, block) @ weights.double().T


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_kernels_compute_the_exact_weights_product(ext, type_name: str) -> None:
    """VNNI, AVX2 and portable loops agree to the bit, rows never depend on their batch, and all equal
    the float64 product of int8 activations with the file's exact weights up to float32 rounding."""
    rng = np.random.default_rng(7)
    n, k = 40, 1024
    raw = random_blocks(type_name, n, k, rng)
    packed, kind = repack(ext, raw, type_name, k)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    torch.manual_seed(0)
    x = torch.randn(70, k) * torch.logspace(-2, 1, 70)[:, None]  # rows of very different sizes
    x[3, :300] = 0.0  # a block of zeros
    bias = torch.randn(n)
    y = ext.block_linear(x, packed, kind, n, bias)
    expected = reference_product(x, weights, block_inputs(kind)) + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    for path in ext.block_quant_paths():
        assert torch.equal(ext.block_linear(x, packed, kind, n, bias, path=path), y), path
        # one row (a decode step) fetching ahead either way the VNNI loop can (tile_walk.h: DecodePrefetch)
        for prefetch in ("t1", "nta"):
            ext.set_decode_prefetch(prefetch)
            try:
                for i in (0, 3, 69):
                    got = ext.block_linear(x[i : i + 1].clone(), packed, kind, n, bias, path=path)[0]
                    assert torch.equal(got, y[i]), (path, prefetch, i)
            finally:
                ext.set_decode_prefetch("auto")
        # an odd number of rows in the last pass (the batched loops take rows 8 at a time, then 4, 2 and 1)
        assert torch.equal(ext.block_linear(x[:69], packed, kind, n, bias, path=path), y[:69]), path
        # decode batches: 2-8 rows run either the rows loops (sums in registers) or the pair loops (tile_walk.h)
        for loop in ("rows", "pairs"):
            ext.set_decode_batch_loop(loop)
            try:
                for rows in range(2, 14):
                    got = ext.block_linear(x[:rows], packed, kind, n, bias, path=path)
                    assert torch.equal(got, y[:rows]), (path, loop, rows)
            finally:
                ext.set_decode_batch_loop("auto")
        # a prompt's rows (more than 8) run the pair loops or one tile at a time (tile_walk.h: PromptTileLoop)
        for loop in ("single", "pairs"):
            ext.set_prompt_tile_loop(loop)
            try:
                for rows in (9, 13, 69, 70):
                    got = ext.block_linear(x[:rows], packed, kind, n, bias, path=path)
                    assert torch.equal(got, y[:rows]), (path, loop, rows)
            finally:
                ext.set_prompt_tile_loop("auto")
    strided = torch.zeros(70, k + 64)[:, :k]
    strided.copy_(x)
    assert torch.equal(ext.block_linear(strided, packed, kind, n, bias), y)


def test_decode_batches_take_the_pair_loops_on_intel_and_the_rows_loops_elsewhere(ext) -> None:
    """auto: the loop measured faster on each CPU family so far (tile_walk.h); an override holds until reset."""
    vendor = next(
        (line.split(":")[1].strip() for line in Path("/proc/cpuinfo").open() if line.startswith("vendor_id")), ""
    )
    assert ext.decode_batch_loop() == ("pairs" if vendor == "GenuineIntel" else "rows")
    try:
        for loop in ("rows", "pairs"):
            ext.set_decode_batch_loop(loop)
            assert ext.decode_batch_loop() == loop
        with pytest.raises(RuntimeError, match="unknown decode batch loop 'tiles'"):
            ext.set_decode_batch_loop("tiles")
    finally:
        ext.set_decode_batch_loop("auto")
    assert ext.decode_batch_loop() == ("pairs" if vendor == "GenuineIntel" else "rows")


def on_amd_family_25() -> bool:
    """Whether this machine's CPU is AMD family 25 (Zen 3 / Zen 4), as /proc/cpuinfo says."""
    lines = [line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line]
    fields = {key.strip(): value.strip() for key, value in lines}
    return fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"


def test_one_row_loops_fetch_non_temporally_on_amd_family_25_only(ext) -> None:
    """auto: prefetchnta where it was measured faster (Zen 4), prefetcht1 elsewhere (tile_walk.h); an override
    holds until reset."""
    amd_25 = on_amd_family_25()
    assert ext.decode_prefetch() == ("nta" if amd_25 else "t1")
    try:
        for setting in ("t1", "nta"):
            ext.set_decode_prefetch(setting)
            assert ext.decode_prefetch() == setting
        with pytest.raises(RuntimeError, match="unknown decode prefetch 't0'"):
            ext.set_decode_prefetch("t0")
    finally:
        ext.set_decode_prefetch("auto")
    assert ext.decode_prefetch() == ("nta" if amd_25 else "t1")


def test_prompts_run_one_tile_at_a_time_on_amd_family_25_for_k_quants_and_q8_0(ext) -> None:
    """auto: the one-tile loops where they were measured faster (Zen 4: K-quants and Q8_0), the pair loops
    elsewhere and for the 4- and 5-bit blocks of 32 (tile_walk.h); an override holds for every kind until reset."""
    kinds = {KIND_FOR_GGUF_TYPE[t] for t in BLOCK_TYPES}
    single_on_zen4 = {kind for kind in kinds if kind in K_KINDS or kind == KIND_FOR_GGUF_TYPE["Q8_0"]}
    assert single_on_zen4 and kinds - single_on_zen4  # both sorts are asked about below

    def auto(kind: int) -> str:
        return "single" if on_amd_family_25() and kind in single_on_zen4 else "pairs"

    assert {kind: ext.prompt_tile_loop(kind) for kind in kinds} == {kind: auto(kind) for kind in kinds}
    try:
        for loop in ("single", "pairs"):
            ext.set_prompt_tile_loop(loop)
            assert {ext.prompt_tile_loop(kind) for kind in kinds} == {loop}
        with pytest.raises(RuntimeError, match=r"unknown prompt tile loop 'rows' \(auto, single or pairs\)"):
            ext.set_prompt_tile_loop("rows")
    finally:
        ext.set_prompt_tile_loop("auto")
    assert {kind: ext.prompt_tile_loop(kind) for kind in kinds} == {kind: auto(kind) for kind in kinds}


# K-quant blocks with every code and scale at its largest: (block bytes, where d sits, the bytes of codes and
# scales, and a super-block's sum over its activations' signs: scale x code x 127 per input).
EXTREME_K_BLOCKS = {
    "Q4_K": (144, 0, slice(4, 144), 63 * 15 * 127),  # codes 15, scales 63 (and minimums 63, dmin 0)
    "Q5_K": (176, 0, slice(4, 176), 63 * 31 * 127),  # codes 31
    "Q6_K": (210, 208, slice(0, 208), 127 * 31 * 127),  # codes 63 (31 after the offset), scales 127
}


@pytest.mark.parametrize("type_name", sorted(EXTREME_K_BLOCKS))
def test_k_quant_sums_past_float32_precision_agree_on_every_path(ext, type_name: str) -> None:
    """The K kinds sum their scaled dots in float32 (kquant.cpp says why): every loop must round the same way
    where the sums pass 2^24 and float32 rounds them. Codes and scales at their largest and activations of
    +-1 (int8 codes +-127) make a super-block's sum about 10^7-10^8."""
    block_bytes, d_at, filled, per_sign = EXTREME_K_BLOCKS[type_name]
    n, k, rows = 32, 1024, 9
    block = np.zeros((n, k // 256, block_bytes), dtype=np.uint8)
    block[..., filled] = 0xFF
    if type_name == "Q6_K":
        block[..., 192:208] = 127  # int8 scales
    d = np.full(block.shape[:2], 2.0**-20, dtype=np.float16)
    block[..., d_at : d_at + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    if type_name != "Q6_K":
        block[..., 2:4] = 0  # dmin
    raw = block.reshape(n, -1)
    packed, kind = repack(ext, raw, type_name, k)
    rng = np.random.default_rng(5)
    signs = np.where(rng.random((rows, k)) < 0.1, -1.0, 1.0)
    exact = per_sign * signs.reshape(rows, k // 256, 256).sum(-1)
    assert ((np.abs(exact) > 2**24) & (exact % 8 != 0)).any()  # sums float32 cannot hold: they round
    x = torch.from_numpy(signs).float()
    y = ext.block_linear(x, packed, kind, n, None)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    assert torch.allclose(y.double(), x.double() @ weights.double().T, rtol=1e-6)
    for path in ext.block_quant_paths():
        assert torch.equal(ext.block_linear(x, packed, kind, n, None, path=path), y), path
        for i in range(rows):
            assert torch.equal(ext.block_linear(x[i : i + 1].clone(), packed, kind, n, None, path=path)[0], y[i])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K"])
def test_threads_sharing_a_linear_compute_every_tile_once(ext, type_name: str) -> None:
    """Two threads split a linear's tiles as they go (one takes tiles from the back of the other's share
    when it runs out): over many calls, one row and a batch, every output equals the one-thread result
    bit for bit. The inputs alternate, so a tile left unwritten would show the other input's values."""
    rng = np.random.default_rng(11)
    n, k = 37 * 16 + 5, 512  # 38 tiles, the last one partial
    raw = random_blocks(type_name, n, k, rng)
    packed, kind = repack(ext, raw, type_name, k)
    torch.manual_seed(1)
    inputs = [torch.randn(rows, k) for rows in (1, 1, 9, 9)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [ext.block_linear(x, packed, kind, n, None) for x in inputs]
        torch.set_num_threads(2)
        for call in range(400):
            i = call % len(inputs)
            assert torch.equal(ext.block_linear(inputs[i], packed, kind, n, None), alone[i]), (call, i)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mix", [("Q4_K", "Q6_K"), ("Q5_K", "Q6_K", "IQ4_XS", "Q4_K"), ("Q4_0", "Q8_0", "Q6_K")])
def test_a_projection_stored_in_several_kinds_has_each_parts_bits(ext, mix: tuple[str, ...]) -> None:
    """block_linear_parts (a Q4_K_M file's qkv: q and k in Q4_K, v in Q6_K) runs all the parts' tiles as one
    parallel call (the K kinds) or part by part (other mixes): every output has the bits of its part run alone,
    on every loop, for one row (written in place) and for batches, on one thread and on two sharing the tiles.
    The parts end in partial tiles, so a tile spilling into the next part's columns would show."""
    rng = np.random.default_rng(5)
    k = 512
    outs = [37 * 16 + 5, 3 * 16 + 3, 32, 16 * 5 + 9][: len(mix)]
    packed, kinds = [], []
    for type_name, n in zip(mix, outs, strict=True):
        part, kind = repack(ext, random_blocks(type_name, n, k, rng), type_name, k)
        packed.append(part)
        kinds.append(kind)
    torch.manual_seed(2)
    x = torch.randn(21, k)
    bias = torch.randn(sum(outs))
    starts = np.cumsum([0, *outs])

    def alone(rows: torch.Tensor, path: str, with_bias: bool = True) -> torch.Tensor:
        parts_bias = [bias[starts[i] : starts[i + 1]] if with_bias else None for i in range(len(mix))]
        return torch.cat(
            [ext.block_linear(rows, packed[i], kinds[i], outs[i], parts_bias[i], path=path) for i in range(len(mix))],
            dim=1,
        )

    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for path in ext.block_quant_paths():
                for rows in (1, 2, 5, 8, 9, 21):
                    expected = alone(x[:rows], path)
                    for _ in range(20 if rows in (1, 9) else 1):
                        got = ext.block_linear_parts(x[:rows], packed, kinds, outs, bias, path=path)
                        assert torch.equal(got, expected), (count, path, rows)
            assert torch.equal(ext.block_linear_parts(x[:3], packed, kinds, outs, None), alone(x[:3], "best", False))
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="one kind and one output count per packed part"):
        ext.block_linear_parts(x, packed, kinds[:1], outs, None)
    with pytest.raises(RuntimeError, match="one value per output"):
        ext.block_linear_parts(x, packed, kinds, outs, bias[:-1])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_a_prompts_big_output_written_past_the_caches_keeps_every_bit(ext, type_name: str) -> None:
    """A prompt-sized output (1 MiB or more: tile_walk.h's streaming_outputs) is written with non-temporal
    stores, a smaller one with ordinary stores: every row must come out the same either way, with its bias,
    on one thread or two, and equal the float64 product of the file's weights."""
    rng = np.random.default_rng(13)
    n, k, rows = 1024, 256, 300  # 300 x 1024 floats: 1.2 MB, streamed; 60 rows: 240 KB, not
    raw = random_blocks(type_name, n, k, rng)
    packed, kind = repack(ext, raw, type_name, k)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    torch.manual_seed(2)
    x, bias = torch.randn(rows, k), torch.randn(n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ext.block_linear(x, packed, kind, n, bias)
        torch.set_num_threads(2)
        big = ext.block_linear(x, packed, kind, n, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(big, alone)
    in_pieces = torch.cat([ext.block_linear(x[i : i + 60], packed, kind, n, bias) for i in range(0, rows, 60)])
    assert torch.equal(big, in_pieces)
    expected = reference_product(x, weights, block_inputs(kind)) + bias.double()
    assert torch.allclose(big.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


_POOL_PROBE = """
import json, resource
import numpy as np, torch
from gguf import GGMLQuantizationType, quants
from chatapp.engine import cpu_kernels
ext = cpu_kernels.load()
n, k = 1024, 256
raw = quants.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q8_0)
packed, kind = ext.repack_gguf(torch.from_numpy(raw), int(GGMLQuantizationType.Q8_0), k)
x = torch.randn(600, k)  # outputs of 600 x 1024 floats: 2.4 MB, 600 pages
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = ext.block_linear(x, packed, kind, n)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del y
print(json.dumps(faults))
"""


def test_a_big_output_reuses_the_memory_the_last_one_freed() -> None:
    """A prompt's activations (1 MiB or more) come from a pool of freed blocks (csrc/activation_pool.h): the second
    output of a size maps no new pages. glibc alone gave the second and fourth 600 new pages each (a fresh mmap or
    heap grown anew, as freed big blocks go back to the kernel). In a process of its own: glibc's state in this
    one depends on the tests before."""
    probe = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    faults = json.loads(probe.stdout.strip().splitlines()[-1])
    assert faults[0] >= 600, faults  # the first output maps its pages in
    assert max(faults[1:]) < 60, faults  # the later ones reuse them


_RELEASE_AFTER_TWO = """    if len(faults) == 2:
        released = [ext.release_idle_activations(), ext.release_idle_activations()]
"""
_RELEASE_PROBE = _POOL_PROBE.replace("    del y\n", "    del y\n" + _RELEASE_AFTER_TWO).replace(
    "print(json.dumps(faults))", "print(json.dumps([faults, released]))"
)


def test_an_idle_release_gives_the_pools_blocks_back() -> None:
    """release_idle_activations (an idle engine's call, memory.py) frees what the pool holds, once: the next output
    of that size maps its pages in again."""
    assert _RELEASE_PROBE != _POOL_PROBE
    probe = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    faults, released = json.loads(probe.stdout.strip().splitlines()[-1])
    assert released == [600 * 1024 * 4, 0], released  # the one 2.4 MB output waiting in the pool, then nothing
    assert max(faults[1:2]) < 60 and faults[2] >= 600, faults  # reused before the release, mapped anew after it
    assert faults[3] < 60, faults  # and pooled again


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_the_fused_swiglu_projection_has_the_bits_of_silu_then_the_linear(ext, type_name: str) -> None:
    """The MLP's down projection of a kind of blocks of 32 computes silu(gate) * up row by row as it quantizes
    (block_linear_swiglu): every row, on every loop and at every batch size, equals silu_and_mul then
    block_linear bit for bit. The K kinds, which quantize in their own loops, are refused by name."""
    rng = np.random.default_rng(17)
    n, k = 96, 320  # 320: the SwiGLU row's last vectors go one at a time (not four in lockstep)
    raw = random_blocks(type_name, n, k, rng)
    packed, kind = repack(ext, raw, type_name, k)
    torch.manual_seed(4)
    gate_up = torch.randn(70, 2 * k) * 3
    bias = torch.randn(n)
    for path in ext.block_quant_paths():
        for rows in (1, 3, 9, 70):  # one row, registers-only batches, and the 64-row passes
            x = gate_up[:rows]
            fused = ext.block_linear_swiglu(x, packed, kind, n, bias, path=path)
            assert torch.equal(fused, ext.block_linear(ext.silu_and_mul(x), packed, kind, n, bias, path=path)), (
                path,
                rows,
            )
    k_raw = random_blocks("Q4_K", n, 256, rng)
    k_packed, k_kind = repack(ext, k_raw, "Q4_K", 256)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        ext.block_linear_swiglu(torch.randn(2, 512), k_packed, k_kind, n)


FLOAT_ROWS = {"F16": 1, "BF16": 2}


def random_float_rows(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, 2 k]: F16 or BF16 rows of random bits, subnormals included, |w| < 2 (no inf or NaN)."""
    halves = rng.integers(0, 2**16, size=(n, k), dtype=np.uint16) & np.uint16(0xBFFF)
    return halves.view(np.uint8)


@pytest.mark.parametrize("type_name", sorted(FLOAT_ROWS))
def test_float_rows_compute_the_exact_weights_product(ext, type_name: str) -> None:
    """The float rows kernel reads F16/BF16 rows as the file has them: its weights are gguf's values, every
    loop gives the same bits, rows never depend on their batch or on the threads, and the product is the
    float64 one up to float32 rounding (activations are not rounded)."""
    rng = np.random.default_rng(23)
    n, k = 37, 1024
    raw = random_float_rows(type_name, n, k, rng)
    packed, kind = torch.from_numpy(raw), FLOAT_ROWS[type_name]
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    assert torch.equal(dequantize(packed, kind, n), weights)
    torch.manual_seed(0)
    x = torch.randn(70, k) * torch.logspace(-2, 1, 70)[:, None]
    bias = torch.randn(n)
    y = ext.block_linear(x, packed, kind, n, bias)
    expected = x.double() @ weights.double().T + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    for path in ext.block_quant_paths():
        assert torch.equal(ext.block_linear(x, packed, kind, n, bias, path=path), y), path
        for i in (0, 3, 69):
            assert torch.equal(ext.block_linear(x[i : i + 1].clone(), packed, kind, n, bias, path=path)[0], y[i])
        for rows in range(2, 14):  # the vector loops take rows 4 (or 2) at a time, then 2 and 1
            assert torch.equal(ext.block_linear(x[:rows], packed, kind, n, bias, path=path), y[:rows]), (path, rows)
    strided = torch.zeros(70, k + 64)[:, :k]
    strided.copy_(x)
    assert torch.equal(ext.block_linear(strided, packed, kind, n, bias), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.block_linear(x, packed, kind, n, bias), y)
    finally:
        torch.set_num_threads(threads)


def test_float_rows_refuse_rows_that_do_not_match(ext) -> None:
    raw = torch.from_numpy(random_float_rows("F16", 8, 64, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        ext.block_linear(torch.randn(1, 40), raw[:, :80].contiguous(), 1, 8)
    with pytest.raises(RuntimeError, match="weight rows hold 64 inputs, x has 128"):
        ext.block_linear(torch.randn(1, 128), raw, 1, 8)
    with pytest.raises(RuntimeError, match="8 rows for 9 outputs"):
        ext.block_linear(torch.randn(1, 64), raw, 1, 9)


def test_repack_rejects_rows_that_do_not_match_the_type(ext) -> None:
    raw = random_blocks("Q4_K", 16, 512, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="row bytes"):
        repack(ext, raw, "Q4_K", 1024)
    with pytest.raises(RuntimeError, match="256-weight blocks"):
        repack(ext, raw[:, :100], "Q4_K", 200)
    with pytest.raises(RuntimeError, match="no packed kind"):
        ext.repack_gguf(torch.from_numpy(raw), int(GGMLQuantizationType.Q2_K), 512)


def test_torch_fallback_runs_the_same_weights_for_k_kinds(ext) -> None:
    raw = random_blocks("Q6_K", 32, 512, np.random.default_rng(1))
    packed, kind = repack(ext, raw, "Q6_K", 512)
    assert kind in K_KINDS
    layer = BlockQuantLinear.single(packed, kind, 512, 32, None, ext=None)
    x = torch.randn(3, 512)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weights))


# --- whole files --------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-files")


@pytest.mark.parametrize("mix", [*BLOCK_TYPES, "Q4_K_M", "Q3_K_M"])
def test_a_gguf_file_runs_in_its_own_types_close_to_its_float_model(gguf_dir: Path, mix: str) -> None:
    """Each type's file runs natively ("gguf") and follows the float model of the same weights: the
    only difference is the int8 rounding of activations (as in llama.cpp), so the next-token choice
    agrees at nearly every position of a 32-token greedy continuation."""
    path = write_llama_gguf(gguf_dir / f"tiny-{mix}.gguf", mix=mix, tied=mix == "Q8_0")
    native = LLM(str(path), kv_cache_memory_gib=0.02)
    exact = LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    assert native.config.quantization == "gguf" and exact.config.quantization is None
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    agree = total = 0
    for out in exact.generate(PROMPTS, params):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        a, b = exact.prompt_logits(ids), native.prompt_logits(ids)
        assert float((a - b).norm() / a.norm()) < 0.03
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9


def test_q4_k_m_keeps_every_tensor_in_its_own_type(gguf_dir: Path) -> None:
    path = write_llama_gguf(gguf_dir / "tiny-mixed.gguf", mix="Q4_K_M", seed=3)
    model = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch").core.runner.model
    layer0, layer1 = model.layers[0], model.layers[1]
    assert layer0.self_attn.qkv_proj.kinds == (104, 106)  # q and k in Q4_K as one part, v in Q6_K
    assert layer1.self_attn.qkv_proj.kinds == (104,)
    assert layer0.mlp.down_proj.kinds == (106,) and layer1.mlp.down_proj.kinds == (104,)
    assert model.quantized_lm_head.kinds == (106,)


def test_q3_k_and_iq4_tensors_run_packed_in_the_kinds_that_hold_them(gguf_dir: Path) -> None:
    """Not de-quantised to float32 (7-9x the file): Q3_K runs in Q6_K's kind, IQ4_NL and IQ4_XS in kinds
    of their own, beside the file's other types in theirs, and the memory estimate counts them so."""
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_weights import native_weight_bytes

    path = write_llama_gguf(gguf_dir / "tiny-q3.gguf", mix="Q3_K_M", seed=19)
    runner = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch").core.runner
    layer0, layer1 = runner.model.layers[0], runner.model.layers[1]
    assert layer0.self_attn.qkv_proj.kinds == (106, 105)  # q and k (Q3_K) in Q6_K's kind, v (Q5_K) in its own
    assert layer1.self_attn.qkv_proj.kinds == (106,) and layer1.mlp.down_proj.kinds == (106,)
    assert layer0.mlp.down_proj.kinds == (104,)
    gguf = GGUFModelFile(path)
    assert native_weight_bytes(gguf, gguf.model_config()) < 2.2 * path.stat().st_size
    iq4 = write_llama_gguf(gguf_dir / "tiny-iq4.gguf", mix="IQ4_NL", seed=19)
    model = LLM(str(iq4), kv_cache_memory_gib=0.02, runner="torch").core.runner.model
    assert model.layers[0].self_attn.qkv_proj.kinds == (9,) and model.quantized_lm_head.kinds == (9,)
    gguf = GGUFModelFile(iq4)
    assert native_weight_bytes(gguf, gguf.model_config()) < path.stat().st_size  # the file's own bytes
    xs = write_llama_gguf(gguf_dir / "tiny-iq4xs.gguf", mix="IQ4_XS", seed=19)
    model = LLM(str(xs), kv_cache_memory_gib=0.02, runner="torch").core.runner.model
    assert model.layers[0].self_attn.qkv_proj.kinds == (108,) and model.quantized_lm_head.kinds == (108,)


def test_native_answers_do_not_depend_on_batch_or_chunking(gguf_dir: Path) -> None:
    path = write_llama_gguf(gguf_dir / "tiny-batch.gguf", mix="Q4_K_M", seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [*PROMPTS, "Once upon a time, in a land far away", "1 2 3"]
    llm = LLM(str(path), kv_cache_memory_gib=0.02)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone
    chunked = LLM(str(path), kv_cache_memory_gib=0.02, max_num_batched_tokens=3)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == alone


def test_llama_q_and_k_rows_are_put_back_in_rotate_half_order(gguf_dir: Path) -> None:
    """llama.cpp stores q/k rows interleaved for its RoPE; ours (Hugging Face's) pairs halves."""
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_loader import dequantize_rows

    path = write_llama_gguf(gguf_dir / "tiny-perm.gguf", mix="Q8_0", seed=9)
    llm = LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    q_file = dequantize_rows(GGUFModelFile(path).tensor("blk.0.attn_q.weight"))
    q_ours = llm.core.runner.model.layers[0].self_attn.qkv_proj.weight[: q_file.shape[0]].detach().numpy()
    head_dim = 64
    # our row h*64 + j (j < 32) is the file's row h*64 + 2j; our row h*64 + 32 + j is the file's h*64 + 2j + 1
    assert np.array_equal(q_ours[:32], q_file[0:64:2]) and np.array_equal(q_ours[32:64], q_file[1:64:2])
    assert np.array_equal(q_ours[head_dim + 5], q_file[head_dim + 10])


def test_a_split_model_runs_as_its_whole_file_from_any_part(gguf_dir: Path, tmp_path: Path) -> None:
    """A model split by llama.cpp's gguf-split naming (many Hub repos publish larger files so) loads from any of
    its parts, as the one file of the same weights does: the same tokens, weights counted from every part."""
    from chatapp.engine.model_pool import estimate_weight_bytes

    whole = write_llama_gguf(gguf_dir / "tiny-unsplit.gguf", mix="Q4_K_M", seed=13)
    first = write_llama_gguf(tmp_path / "tiny-split.gguf", mix="Q4_K_M", seed=13, split_max_tensors=8)
    parts = sorted(tmp_path.glob("tiny-split-*-of-*.gguf"))
    assert len(parts) == 3 and parts[0] == first
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(whole), kv_cache_memory_gib=0.02).generate(PROMPTS, params)]
    for named in (first, parts[2]):
        llm = LLM(str(named), kv_cache_memory_gib=0.02)
        assert llm.config.quantization == "gguf"
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected, named.name
    assert estimate_weight_bytes(first) == sum(p.stat().st_size for p in parts)


def test_a_split_model_with_a_part_missing_renamed_or_foreign_is_named(tmp_path: Path) -> None:
    from chatapp.engine.models.gguf_file import GGUFModelFile

    first = write_llama_gguf(tmp_path / "m.gguf", mix="Q8_0", seed=14, split_max_tensors=8)
    second, third = tmp_path / "m-00002-of-00003.gguf", tmp_path / "m-00003-of-00003.gguf"
    for named in (first, third):
        GGUFModelFile(named)  # whole: both find every part
    kept = third.read_bytes()
    third.unlink()
    with pytest.raises(GGUFError, match=r"part 3 \(m-00003-of-00003\.gguf\) is not beside it; download every part"):
        GGUFModelFile(first)
    renamed = tmp_path / "renamed.gguf"
    second.rename(renamed)
    with pytest.raises(GGUFError, match=r"renamed\.gguf is part 2 of a model split in 3 files, but its name"):
        GGUFModelFile(renamed)
    renamed.rename(second)
    other = write_llama_gguf(tmp_path / "o.gguf", mix="Q8_0", seed=15, split_max_tensors=16)  # 2 parts
    third.write_bytes((tmp_path / "o-00002-of-00002.gguf").read_bytes())
    with pytest.raises(GGUFError, match=r"m-00003-of-00003\.gguf is not part 3 of 3 .* says part 2 of 2"):
        GGUFModelFile(first)
    third.write_bytes(kept)
    assert len(GGUFModelFile(first).tensors) == len(GGUFModelFile(other).tensors)
    # a part number past the count (a corrupt header) is named, not an IndexError
    header = bytearray(kept)
    at = header.index(b"split.no") + len(b"split.no") + 4  # past the key and its value type (uint16)
    header[at : at + 2] = (7).to_bytes(2, "little")
    third.write_bytes(bytes(header))
    with pytest.raises(GGUFError, match=r"is part 8 of a model split in 3 files, but its name is not"):
        GGUFModelFile(third)


# --- bad files ----------------------------------------------------------------------------------


def test_truncated_file_gets_a_clear_error_naming_a_tensor(gguf_dir: Path, tmp_path: Path) -> None:
    whole = write_llama_gguf(gguf_dir / "tiny-whole.gguf", mix="Q4_0", seed=11)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size - 5000])
    with pytest.raises(GGUFError, match=r"truncated: tensor blk\.1\.\w+\.weight"):
        LLM(str(cut), kv_cache_memory_gib=0.02)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(whole.read_bytes()[:3000])
    with pytest.raises(GGUFError, match="header.gguf"):
        LLM(str(header_only), kv_cache_memory_gib=0.02)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello, I am not a model")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        LLM(str(not_gguf), kv_cache_memory_gib=0.02)


def _corrupt_header_cases(tmp_path: Path) -> dict[str, Path]:
    """The bundled model's header with (1) its first vocabulary string claiming 2^64 - 1 bytes, (2) the
    file cut inside the token-type array (numbers the tokenizer build reads in full)."""
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.store import bundled_gguf_path

    source = bundled_gguf_path()
    header = source.read_bytes()[: min(t.offset for t in GGUFModelFile(source).tensors.values())]
    tokens = header.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens")
    first_length = tokens + 4 + 4 + 8  # value type (array), item type (string), count
    huge = tmp_path / "huge-length.gguf"
    huge.write_bytes(header[:first_length] + b"\xff" * 8 + header[first_length + 8 :])
    types = header.index(b"tokenizer.ggml.token_type") + len("tokenizer.ggml.token_type")
    cut = tmp_path / "cut-in-an-array.gguf"
    cut.write_bytes(header[: types + 4 + 4 + 8 + 100])
    return {"huge": huge, "cut": cut}


def test_corrupt_header_lengths_get_the_truncated_file_error(tmp_path: Path) -> None:
    """A length field far past the end of the file (a corrupt download) is the same clear error as a
    truncated file, from the engine's reader and the tokenizer build's alike; it was an OverflowError."""
    from chatapp.engine.models.gguf_file import GGUFModelFile, read_tokenizer_metadata

    cases = _corrupt_header_cases(tmp_path)
    with pytest.raises(GGUFError, match=r"huge-length\.gguf is not a readable GGUF file .*truncated"):
        GGUFModelFile(cases["huge"])
    for path in cases.values():
        with pytest.raises(GGUFError, match="truncated"):
            read_tokenizer_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))


@pytest.mark.parametrize(
    ("key", "raw", "message"),
    [
        ("llama.block_count", (0).to_bytes(4, "little"), r"llama\.block_count is 0"),
        ("llama.block_count", (2**31).to_bytes(4, "little"), r"block count is 2147483648 but the file holds no"),
        ("llama.attention.head_count", (0).to_bytes(4, "little"), r"llama\.attention\.head_count is 0"),
        ("llama.attention.head_count_kv", (0).to_bytes(4, "little"), r"num_kv_heads is 0"),
        ("llama.attention.head_count_kv", (3).to_bytes(4, "little"), r"4 attention heads do not share 3 KV heads"),
        ("llama.embedding_length", (0).to_bytes(4, "little"), r"llama\.embedding_length is 0"),
        ("llama.embedding_length", (512).to_bytes(4, "little"), r"embedding length is 512 but token_embd"),
        ("llama.rope.freq_base", np.float32(0).tobytes(), r"RoPE base frequency is 0"),
        ("llama.rope.dimension_count", (2**30).to_bytes(4, "little"), r"rotary dimension is [\d.e+]+ x the head size"),
    ],
)
def test_impossible_metadata_sizes_are_refused_by_name(tmp_path: Path, key: str, raw: bytes, message: str) -> None:
    """Found by fuzzing GGUF metadata: zero counts divided by zero deep in the engine, a huge rotary
    dimension asked numpy for terabytes, a huge block count was refused as a model of 8 million GiB."""
    data = bytearray(write_llama_gguf(tmp_path / "good.gguf", LlamaShape(), mix="Q8_0", seed=1).read_bytes())
    at = data.find(key.encode()) + len(key) + 4  # after the key: a value type (uint32 / float32 here), the value
    data[at : at + len(raw)] = raw
    bad = tmp_path / "edited.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"edited\.gguf has incomplete or wrong model metadata \(.*({message})"):
        LLM(str(bad), kv_cache_memory_gib=0.02)


def test_wrong_shapes_and_architectures_are_named(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    from tests.gguf_models import bundled_tokenizer_fields

    # A file whose metadata says 8 heads (of 32 dimensions) where its tensors have 4 of 64.
    shape = LlamaShape()
    path = write_llama_gguf(tmp_path / "bad-shape.gguf", shape, mix="Q8_0", seed=1)
    data = bytearray(path.read_bytes())
    # rewrite the head count field: the engine must then find q's rows wrong, not crash
    key = b"llama.attention.head_count"
    at = data.find(key) + len(key) + 4  # after the key: a uint32 value type, then the value
    data[at : at + 4] = (8).to_bytes(4, "little")
    bad = tmp_path / "bad-heads.gguf"
    bad.write_bytes(bytes(data))
    # The rotary dimension (64) is now twice the head size: the metadata alone is refused, naming why.
    with pytest.raises(GGUFError, match=r"bad-heads\.gguf has .*wrong model metadata \(the rotary dimension is 2 x"):
        LLM(str(bad), kv_cache_memory_gib=0.02)
    # With the rotary dimension made to agree, the metadata is consistent and the tensors are not.
    key = b"llama.rope.dimension_count"
    at = data.find(key) + len(key) + 4
    data[at : at + 4] = (32).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.attn_k\.weight has shape \(128, 256\), expected \(64, 256\)"):
        LLM(str(bad), kv_cache_memory_gib=0.02)

    other = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(other), "mamba")
    for key_name, (value, main, sub) in bundled_tokenizer_fields().items():
        writer.add_key_value(key_name, value, main, sub_type=sub)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
        LLM(str(other), kv_cache_memory_gib=0.02)


# --- memory ---------------------------------------------------------------------------------------

_RSS_PROBE = """
import json, sys
import psutil
from chatapp.engine import cpu_kernels
from chatapp.engine.models.gguf_file import GGUFModelFile
from chatapp.engine.models.gguf_loader import load_gguf_native
ext = cpu_kernels.load()
gguf = GGUFModelFile(sys.argv[1])
mc = gguf.model_config()
# Warm the runtime up first (a repack starts the thread pool): a fixed cost, not this file's.
import torch
ext.repack_gguf(torch.zeros(16, 18, dtype=torch.uint8), 2, 32)
def high_water() -> int:  # VmHWM: this process's own peak (ru_maxrss would carry the parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = psutil.Process().memory_info().rss
assert high_water() < before + 64 * 2**20, "the warm-up must not leave a peak above the start"
if sys.argv[2] == "torch":
    model = load_gguf_native(gguf, mc, 2048, ext)
else:  # the torch-free runner's way: tiles packed after the load, on the packer's thread
    from chatapp.engine.models.array_model import load_array_model
    model = load_array_model(gguf, mc, 2048, ext, defer_packing=True)
    assert model.packer is not None
    model.wait_for_weights()
print(json.dumps({"before": before, "peak": high_water(), "after": psutil.Process().memory_info().rss}))
"""


def test_loading_a_300_mb_file_adds_at_most_1_3x_its_size_to_peak_rss(tmp_path: Path) -> None:
    """Measured in a fresh process: peak RSS during the load over RSS just before it (Python, torch
    and our kernels already imported), so only what loading holds counts. Both CPU runners' loads: the
    torch model's, and the torch-free runner's with its tiles packed after it (until they are all packed)."""
    shape = LlamaShape(hidden=2048, layers=8, heads=16, kv_heads=4, intermediate=5632)
    path = write_llama_gguf(tmp_path / "300mb-Q4_K_M.gguf", shape, mix="Q4_K_M", seed=2)
    size = path.stat().st_size
    assert 250e6 < size < 400e6
    for loader in ("torch", "array"):
        probe = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, str(path), loader], capture_output=True, text=True, timeout=600
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        rss = json.loads(probe.stdout.strip().splitlines()[-1])
        assert rss["peak"] - rss["before"] <= 1.3 * size, (loader, rss, size)


@pytest.mark.parametrize("mix", ["F16", "BF16"])
def test_float_rows_files_run_in_their_own_bytes_and_match_the_float_model(gguf_dir: Path, mix: str) -> None:
    """F16 and BF16 projections run in the float rows kernel, on the file's own rows (mapped, not copied;
    llama.cpp's permuted q/k rows copied back in order), and answer exactly as the float model does."""
    from chatapp.engine.block_kinds import KIND_FOR_GGUF_TYPE
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_weights import GGUFWeights, unpermute_rows

    path = write_llama_gguf(gguf_dir / f"tiny-rows-{mix}.gguf", mix=mix, embed_type="Q8_0", seed=4)
    kind = KIND_FOR_GGUF_TYPE[mix]
    native = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch")
    exact = LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    assert native.config.quantization == "gguf"
    layer = native.core.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, BlockQuantLinear) and layer.self_attn.qkv_proj.kinds == (kind,) * 3
    assert isinstance(layer.mlp.down_proj, BlockQuantLinear) and layer.mlp.down_proj.kinds == (kind,)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in native.generate(PROMPTS, params)] == expected
    torch_free = LLM(str(path), kv_cache_memory_gib=0.02)  # the array runner
    assert [o.outputs[0].token_ids for o in torch_free.generate(PROMPTS, params)] == expected

    gguf = GGUFModelFile(path)
    mc = gguf.model_config()
    q, k, v = GGUFWeights(gguf, mc).layer(cpu_kernels.load(), 1).qkv.packed or []
    v_file = gguf.tensor("blk.1.attn_v.weight").data
    assert np.shares_memory(v[0], v_file) and v[0].shape == v_file.shape  # read in place
    q_file = gguf.tensor("blk.1.attn_q.weight").data
    assert not np.shares_memory(q[0], q_file)
    assert np.array_equal(q[0], q_file[unpermute_rows(q_file.shape[0], mc.num_heads)])


def test_float32_tensors_run_as_float32_layers_and_match_the_float_model(gguf_dir: Path) -> None:
    """F32 projections (no kernel of ours takes them) become float32 layers of the same values: the file
    still loads in its own types ("gguf"), and answers exactly as the float model does."""
    path = write_llama_gguf(gguf_dir / "tiny-F32.gguf", mix="F32", embed_type="Q8_0", seed=4)
    native = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch")
    exact = LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    assert native.config.quantization == "gguf"
    qkv = native.core.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, torch.nn.Linear) and qkv.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in native.generate(PROMPTS, params)] == expected
    torch_free = LLM(str(path), kv_cache_memory_gib=0.02)  # the array runner's float32 layers
    assert [o.outputs[0].token_ids for o in torch_free.generate(PROMPTS, params)] == expected


def test_float_rows_of_a_length_the_kernel_cannot_sum_run_as_float32(gguf_dir: Path) -> None:
    """The float rows kernel sums 16 inputs at a time: F16 rows of 264 and 520 inputs run as float32 layers."""
    shape = LlamaShape(hidden=264, heads=3, kv_heads=1, intermediate=520)
    path = write_llama_gguf(gguf_dir / "tiny-F16-264.gguf", shape, mix="F16", seed=2)
    native = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch")
    assert isinstance(native.core.runner.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    exact = LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    torch_free = LLM(str(path), kv_cache_memory_gib=0.02)
    assert [o.outputs[0].token_ids for o in torch_free.generate(PROMPTS, params)] == expected


def test_a_model_that_cannot_fit_is_refused_before_loading(gguf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from chatapp.engine import array_runner
    from chatapp.engine.model_runner import ModelTooLargeError
    from chatapp.engine.models import gguf_loader

    path = write_llama_gguf(gguf_dir / "tiny-fit.gguf", mix="Q4_K_M", seed=6)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=100 * 2**20))
    loads: list[str] = []
    monkeypatch.setattr(gguf_loader, "load_gguf_native", lambda *a, **k: loads.append("loaded"))
    monkeypatch.setattr(array_runner, "load_array_model", lambda *a, **k: loads.append("loaded"))
    with pytest.raises(
        ModelTooLargeError,
        match=r"needs about 0\.5\d GiB of memory \(weights 0\.0\d GiB \+ KV cache "
        r"0\.02 GiB \+ 0\.50 GiB working memory\) but only 0\.10 GiB is available",
    ):
        LLM(str(path), kv_cache_memory_gib=0.02)
    assert loads == []  # refused before a byte of weights was read


def test_native_weight_estimate_is_what_loading_holds(gguf_dir: Path) -> None:
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_loader import native_weight_bytes

    path = write_llama_gguf(gguf_dir / "tiny-estimate.gguf", mix="Q4_K_M", seed=8)
    model = LLM(str(path), kv_cache_memory_gib=0.02, runner="torch").core.runner.model
    held = sum(p.packed.numel() for m in model.modules() if isinstance(m, BlockQuantLinear) for p in m.parts)
    held += sum(p.numel() * 4 for p in model.parameters())
    gguf = GGUFModelFile(path)
    assert native_weight_bytes(gguf, gguf.model_config()) == held


def test_the_float_path_loads_a_gguf_file_into_bfloat16_tensor_by_tensor(gguf_dir: Path) -> None:
    """The GPU's way (here on the CPU's Python model): each tensor de-quantised straight into the
    model's dtype as it is read, equal to gguf's de-quantisation rounded to bfloat16."""
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_loader import dequantize_rows

    path = write_llama_gguf(gguf_dir / "tiny-bf16.gguf", mix="Q4_K_M", seed=12)
    llm = LLM(str(path), kv_cache_memory_gib=0.02, dtype="bfloat16", quantization=None, cpu_kernels=False)
    model = llm.core.runner.model
    gguf = GGUFModelFile(path)
    up = torch.from_numpy(dequantize_rows(gguf.tensor("blk.1.ffn_up.weight")))
    assert model.layers[1].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight[512:], up.bfloat16())
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_our_ggml_type_table_matches_the_gguf_packages() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    from chatapp.engine.models.ggml_types import GGML_TYPES

    theirs = {int(q.value): (q.name, *GGML_QUANT_SIZES[q]) for q in GGMLQuantizationType if q in GGML_QUANT_SIZES}
    ours = {type_id: tuple(t) for type_id, t in GGML_TYPES.items()}
    assert ours == theirs


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_tensors_are_converted_as_the_gguf_package_does(type_name: str) -> None:
    from chatapp.engine.models.gguf_file import GGUFTensor
    from chatapp.engine.models.gguf_weights import dequantize_rows

    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**8, size=(5, 64 * (4 if type_name == "F32" else 2)), dtype=np.uint8)
    if type_name != "F32":  # no NaN patterns: NaN != NaN would hide a real difference
        halves = bits.view(np.uint16)
        halves &= np.uint16(0xBFFF)
    else:
        bits.view(np.uint32)[...] &= np.uint32(0xBFFFFFFF)
    tensor = GGUFTensor("t", type_name, int(qtype.value), (5, 64), bits, 0)
    ours = dequantize_rows(tensor, np.array([3, 0, 3]))
    theirs = np.asarray(quants.dequantize(bits[[3, 0, 3]], qtype), dtype=np.float32)
    assert ours.dtype == np.float32 and ours.shape == (3, 64)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
