"""Triton kernels against plain torch references: compiled on a GPU, else in Triton's interpreter.

Importing ``chatapp.kernels`` without a GPU turns on ``TRITON_INTERPRET``, so
these tests need no GPU (CI runs them so); on a machine with one, the same tests
run the compiled kernels on it. Shapes are small because the interpreter is slow;
they still cover mixed decode/prefill batches, cached prefixes, partly filled
last blocks, shuffled block tables, GQA and every supported dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from chatapp.engine.attention import AttentionMetadata, TorchAttentionBackend
from chatapp.engine.attention_triton import TritonAttentionBackend
from chatapp.kernels import paged_attention, plan_tiles, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need GPU tensors

# (query_len, seq_len) per request, decodes first as the model runner orders them:
# four decodes (one ending exactly on a block boundary for block sizes <= 64, one
# long enough to span several key tiles), a prefill with no cached context, and
# two chunks whose earlier tokens are cached (one with an unaligned, one with a
# block-aligned cached prefix).
MIXED = [(1, 37), (1, 5), (1, 64), (1, 150), (20, 20), (13, 50), (24, 56)]

TOLERANCE = {  # (atol, rtol): fp32 is exact up to summation order; half types round p and the output
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class Batch:
    """One step's worth of attention inputs over a randomly filled, shuffled paged cache."""

    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]: the step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]: random everywhere, as a used pool is
    v_cache: torch.Tensor
    meta: AttentionMetadata
    group: int

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]


def make_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    """``seed`` picks the values; the block layout depends only on the requests and block size."""
    layout = torch.Generator().manual_seed(0)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in requests]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks full of junk that must never be read
    free = torch.randperm(num_blocks, generator=layout).tolist()
    block_tables = torch.zeros(len(requests), max(blocks_per_req) + 1, dtype=torch.int32)  # padded with 0
    slots: list[int] = []
    for b, ((q_len, seq_len), n) in enumerate(zip(requests, blocks_per_req)):
        ids = [free.pop() for _ in range(n)]
        block_tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    query_lens = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    num_tokens = sum(query_lens)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv = randn(num_tokens, 2, num_kv_heads, head_dim)  # k and v as strided views, as a fused projection gives
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    # Scaled queries make the softmax peaked, so a wrong mask or position shows.
    q = 2 * randn(num_tokens, num_kv_heads * group, head_dim)
    if DEVICE != "cpu":
        kv, q = kv.to(DEVICE), q.to(DEVICE)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(DEVICE))
    return Batch(q, kv[:, 0], kv[:, 1], randn(*cache_shape).to(DEVICE), randn(*cache_shape).to(DEVICE), meta, group)


def naive_store(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches with the step's keys and values written slot by slot."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(batch.meta.slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = batch.k[t]
            v_cache[slot // block_size, slot % block_size] = batch.v[t]
    return k_cache, v_cache


def naive_attention(batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention one request at a time, in fp32, gathering keys block by block (on the CPU)."""
    meta = batch.meta
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    block_size = k_cache.shape[1]
    outs = []
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        blocks = meta.block_tables[b, : -(-seq_len // block_size)].long().cpu()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(batch.group, dim=1)  # [S, H, D]
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(batch.group, dim=1)
        q = batch.q[start : start + q_len].float().cpu()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * batch.head_dim**-0.5
        q_pos = torch.arange(seq_len - q_len, seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [Q, S]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += q_len
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert expected.float().abs().mean() > 0.1, "reference output is near zero: the comparison would prove nothing"
    atol, rtol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# --- store KV -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim"),
    [
        (torch.float32, 16, 2, 64),
        (torch.float16, 8, 3, 128),
        (torch.bfloat16, 128, 1, 64),
    ],
)
def test_store_kv_writes_slots_and_skips_padding(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    batch = make_batch(MIXED, block_size=block_size, num_kv_heads=num_kv_heads, group=1, head_dim=head_dim, dtype=dtype)
    batch.meta.slot_mapping[::4] = -1  # padded tokens: their k/v must land nowhere
    expected_k, expected_v = naive_store(batch)
    assert not torch.equal(expected_k, batch.k_cache), "the step must change the cache"
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()

    store_kv(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)

    # Bitwise equality: written slots hold the new rows, every other entry is untouched.
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# --- paged attention kernel against the naive reference -----------------------------------------


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "dtype", "tiles"),
    [
        (16, 64, 1, torch.float32, "engine"),
        (16, 128, 3, torch.float16, "engine"),
        (32, 64, 3, torch.bfloat16, "engine"),
        (32, 128, 1, torch.float32, "engine"),
        (8, 64, 3, torch.float32, "engine"),
        (128, 64, 1, torch.float16, "engine"),
        # Small tiles: many key-loop steps per program and several query tiles per
        # request, decodes and prefills in one launch.
        (16, 64, 3, torch.float32, "small"),
        (32, 128, 1, torch.bfloat16, "small"),
    ],
)
def test_paged_attention_matches_naive_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype, tiles: str
) -> None:
    batch = make_batch(MIXED, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    k_cache, v_cache = naive_store(batch)
    meta = batch.meta
    lens, nd, nr = meta.query_lens_cpu, meta.num_decodes, meta.num_requests
    if tiles == "engine":
        plans = [
            plan_tiles(lens, range(0, nd), group, DEVICE, block_m=16, tile_n=64),
            plan_tiles(lens, range(nd, nr), group, DEVICE, block_m=64, tile_n=64),
        ]
    else:
        plans = [plan_tiles(lens, range(nr), group, DEVICE, block_m=16, tile_n=16)]
    out = torch.full_like(batch.q, float("nan"))  # every row must be written

    for plan in plans:
        paged_attention(
            batch.q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, plan, head_dim**-0.5
        )

    assert_close(out, naive_attention(batch, k_cache, v_cache))


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.float32),  # a bf16 model asked for a float32 cache
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_queries_and_a_cache_of_different_types_attend_as_the_reference(
    q_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """kv_cache_dtype need not be the model's dtype: the step's keys are stored in the cache's type
    and the dot products are taken in the wider of the two."""
    batch = make_batch(MIXED, block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=cache_dtype)
    batch.q, batch.k, batch.v = batch.q.to(q_dtype), batch.k.to(q_dtype), batch.v.to(q_dtype)
    backend = TritonAttentionBackend([(batch.k_cache.clone(), batch.v_cache.clone())], 6, 64)
    backend.begin_step(batch.meta)
    out = backend.forward(0, batch.q, batch.k, batch.v)
    k_cache, v_cache = backend.kv_caches[0]
    assert out.dtype == q_dtype and k_cache.dtype == cache_dtype
    assert torch.equal(k_cache.cpu(), naive_store(batch)[0].cpu())
    narrower = cache_dtype if q_dtype == torch.float32 else q_dtype  # the half type's rounding bounds the error
    assert_close(out.to(narrower), naive_attention(batch, k_cache, v_cache))


# --- the backend against the torch backend ------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "block_size", "head_dim", "group", "dtype"),
    [
        (MIXED, 16, 64, 3, torch.float32),
        (MIXED, 32, 128, 1, torch.bfloat16),
        (MIXED, 8, 64, 1, torch.float16),
        (MIXED, 128, 128, 3, torch.float32),
        ([(1, 9), (1, 33), (1, 16)], 16, 64, 3, torch.float16),  # decodes only
        ([(7, 7), (30, 45)], 32, 64, 1, torch.float32),  # prefill chunks only
    ],
)
def test_backend_matches_torch_backend(
    requests: list[tuple[int, int]], block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Two layers through begin_step/forward: same outputs and same caches as TorchAttentionBackend."""
    layers = [
        make_batch(
            requests, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=seed
        )
        for seed in (1, 2)
    ]
    meta = layers[0].meta  # the same for both: the seed changes values, not the layout
    num_heads = 2 * group

    def caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(b.k_cache.clone(), b.v_cache.clone()) for b in layers]

    torch_backend = TorchAttentionBackend(caches(), num_heads, head_dim)
    triton_backend = TritonAttentionBackend(caches(), num_heads, head_dim)
    torch_backend.begin_step(meta)
    triton_backend.begin_step(meta)
    for layer, b in enumerate(layers):
        expected = torch_backend.forward(layer, b.q, b.k, b.v)
        actual = triton_backend.forward(layer, b.q, b.k, b.v)
        assert_close(actual, expected)
        assert_close(actual, naive_attention(b, *naive_store(b)))
    for (k_t, v_t), (k_r, v_r) in zip(torch_backend.kv_caches, triton_backend.kv_caches):
        assert torch.equal(k_t, k_r) and torch.equal(v_t, v_r)


# --- host-side planning and interpreter mode -----------------------------------------------------


def test_plan_tiles_cuts_each_request_into_block_q_tokens() -> None:
    # Group 3 pads to 4 rows per token, so 16 rows hold 4 tokens.
    plan = plan_tiles([1, 9, 4], range(1, 3), 3, "cpu", block_m=16, tile_n=32)
    assert plan is not None and plan.block_q == 4
    assert plan.tile_req.tolist() == [1, 1, 1, 2]
    assert plan.tile_q0.tolist() == [0, 4, 8, 0]
    # A group wider than block_m still gets one whole token per tile.
    assert plan_tiles([2], range(1), 32, "cpu", block_m=16, tile_n=16).block_m == 32
    assert plan_tiles([1, 1], range(2, 2), 1, "cpu", block_m=16, tile_n=16) is None
    with pytest.raises(ValueError):
        plan_tiles([1], range(1), 1, "cpu", block_m=24, tile_n=16)


def test_import_without_gpu_turns_on_the_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # hide any GPU so the check holds on every machine
    code = (
        "import os, chatapp.kernels.attention as pa\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "print(os.environ.get('TRITON_INTERPRET'), isinstance(pa._paged_attention_kernel, InterpretedFunction))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True"]


def test_the_cpu_engine_runs_without_triton(tiny_llama) -> None:
    """Triton is a test extra, not a dependency: a CPU install has none, and must still load and answer."""
    code = (
        "import sys; sys.modules['triton'] = None  # any import of it fails\n"
        "from chatapp.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, device='cpu', num_kv_blocks=16)\n"
        "print(len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "3"


# --- end to end: the engine with the Triton backend generates what the torch backend does ---------


@pytest.fixture(scope="module")
def tiny_llama_d64(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama with the head_dim real models use and a GQA group of 3."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"), hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=64
    )


def _generate(model_dir, backend: str) -> tuple[list[list[int]], list[int], int]:
    """Greedy outputs of a mixed batch, then of a prompt that hits the prefix cache."""
    from chatapp.engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (5, 23, 47, 70)]
    again = prompts[3][:48] + torch.randint(3, 40000, (10,), generator=gen).tolist()
    # A 32-token step budget cuts the longer prompts into chunks that run beside other requests' decodes.
    # Float32 linears: int8's per-token rounding would amplify the backends' last-bit differences.
    llm = LLM(
        model=str(model_dir),
        device=DEVICE,
        dtype="float32",
        attention_backend=backend,
        block_size=16,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=32,
        quantization=None,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    [cached] = llm.generate([again], params)
    return batch + [cached.outputs[0].token_ids], [len(ids) for ids in batch], cached.num_cached_tokens


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_d64"])
def test_engine_generates_the_same_tokens_with_both_backends(model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    expected, lengths, cached = _generate(model_dir, "torch")
    actual, _, cached_triton = _generate(model_dir, "triton")
    assert lengths == [12] * 4
    assert len({tuple(ids) for ids in expected}) > 1, "a constant model would agree with any attention"
    assert cached > 0 and cached_triton == cached, "the last prompt must reuse cached prefix blocks"
    assert actual == expected


# --- fused element-wise kernels against the torch formulas they replace ---------------------------

FUSED_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_rms_norm_matches_the_model_norm_on_strided_rows(dtype: torch.dtype) -> None:
    from chatapp.engine.models.llama import RMSNorm
    from chatapp.kernels.fused import rms_norm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    norm = norm.to(DEVICE, dtype)
    wide = (3 * torch.randn(7, 160, generator=gen)).to(DEVICE, dtype)
    x = wide[:, 10:106]  # rows 160 apart, as a slice of a fused projection's output is

    expected = _torch_rms_norm(x, norm.weight, 1e-5)
    actual = rms_norm(x, norm.weight, 1e-5)

    assert actual.dtype == dtype and actual.is_contiguous()
    atol, rtol = FUSED_TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm formula (chatapp/engine/models/llama.py), in torch ops."""
    import torch.nn.functional as F

    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_matches_swiglu(dtype: torch.dtype) -> None:
    import torch.nn.functional as F

    from chatapp.kernels.fused import silu_mul

    gen = torch.Generator().manual_seed(4)
    gate_up = (4 * torch.randn(5, 2 * 1300, generator=gen)).to(DEVICE, dtype)  # n spans two 1024-wide programs
    gate, up = gate_up.split(1300, dim=-1)

    actual = silu_mul(gate_up)

    atol, rtol = FUSED_TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), (F.silu(gate) * up).float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_matches_rotate_in_place_on_a_projection_slice(dtype: torch.dtype) -> None:
    from chatapp.engine.models.rope import RotaryEmbedding
    from chatapp.kernels.fused import rope_

    heads, kv_heads, head_dim, tokens = 6, 2, 64, 9
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 17, 300, 301, 4095, 5, 6], device=DEVICE)
    table = rope.lookup(positions)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected = rope.rotate(qk, table)

    rope_(qk, table[0][:, 0], table[1][:, 0])

    atol, rtol = FUSED_TOLERANCE[dtype]
    torch.testing.assert_close(qk.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before), "the values must be left alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_returns_the_rounded_sum_and_its_norm(dtype: torch.dtype) -> None:
    from chatapp.kernels.fused import add_rms_norm

    gen = torch.Generator().manual_seed(6)
    x, a = (3 * torch.randn(2, 5, 96, generator=gen)).to(DEVICE, dtype)
    weight = (torch.rand(96, generator=gen) + 0.5).to(DEVICE, dtype)

    total, normed = add_rms_norm(x, a, weight, 1e-6)

    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(total, x + a), "the residual stream must be exactly torch's sum"
    else:  # Triton's interpreter narrows to bfloat16 by truncating, a GPU to nearest: within one unit
        torch.testing.assert_close(total.float(), (x + a).float(), atol=0, rtol=2**-7)
    atol, rtol = FUSED_TOLERANCE[dtype]
    expected = _torch_rms_norm(x + a, weight, 1e-6)
    torch.testing.assert_close(normed.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "block"), [(300, 1024, None), (37, 200, (8, 128, 4)), (64, 96, (2, 1024, 4))])
def test_gemv_matches_a_float64_product(dtype: torch.dtype, n: int, k: int, block: tuple[int, int, int] | None) -> None:
    # Rows that end mid-block (300, 37) and a K that ends mid-slice (200 with 128-wide slices, 96).
    from chatapp.kernels.gemv import gemv

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    expected = x.double().cpu() @ weight.double().cpu().T

    actual = gemv(x, weight, *(block or ()))

    assert actual.shape == (1, n) and actual.dtype == dtype
    # float32 sums; the one rounding is the output's: at most an ulp of bfloat16 (2^-7 relative; Triton's
    # interpreter truncates where the GPU rounds to nearest)
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(actual.double().cpu(), expected, atol=1e-4 * k**0.5, rtol=rtol)


def test_gemv_refuses_more_than_one_row() -> None:
    from chatapp.kernels.gemv import gemv

    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))
