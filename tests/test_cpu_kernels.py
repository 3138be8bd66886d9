"""Our C++ paged-attention kernel against the torch (SDPA) backend, and its batch invariance."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from chatapp.engine import cpu_kernels
from chatapp.engine.attention import AttentionMetadata, TorchAttentionBackend


@pytest.fixture(scope="module")
def ext():
    module = cpu_kernels.load()
    assert module is not None  # CI has a compiler: a failed build must not go unnoticed
    return module


def make_step(
    block_size: int, seq_lens: list[int], q_lens: list[int], num_blocks: int = 64, seed: int = 0
) -> AttentionMetadata:
    """A batch with decodes first, then prefill chunks, on scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(perm[used : used + need])
        used += need
    table = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, n, q in zip(tables, seq_lens, q_lens)
        for p in range(n - q, n)
    ]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        num_decodes=sum(1 for q in q_lens if q == 1),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def kernel(ext, q, k_cache, v_cache, meta, scale):
    """The kernel on standard-layout caches (keys transposed within blocks, as the engine stores them)."""
    return ext.paged_attention(
        q,
        k_cache.permute(0, 2, 3, 1).contiguous(),
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, block_size", [((9, 3, 64), 16), ((4, 4, 32), 8), ((8, 2, 128), 32)])
def test_kernel_matches_sdpa_for_decodes_and_prefill_chunks(
    ext, heads: tuple[int, int, int], block_size: int, cache_dtype: torch.dtype
) -> None:
    """Float32 or float16 caches (the CPU default): the kernel widens halves exactly, so against SDPA
    on the same (widened) cache it is as close as in float32."""
    num_heads, num_kv_heads, head_dim = heads
    # Decodes (one partial block, one exact multiple), a fresh prompt, and chunks with cached context.
    seq_lens = [1, 17, block_size * 3, 23, 70, 2 * block_size + 5]
    q_lens = [1, 1, 1, 23, 9, block_size]
    meta = make_step(block_size, seq_lens, q_lens)
    torch.manual_seed(1)
    caches = [
        (
            torch.randn(64, block_size, num_kv_heads, head_dim).to(cache_dtype),
            torch.randn(64, block_size, num_kv_heads, head_dim).to(cache_dtype),
        )
    ]
    tokens = sum(q_lens)
    q = torch.randn(tokens, num_heads, head_dim)
    k, v = torch.randn(tokens, num_kv_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
    reference_backend = TorchAttentionBackend(caches, num_heads, head_dim)
    reference_backend.begin_step(meta)
    reference = reference_backend.forward(0, q, k, v)  # also stores k, v into the caches
    fast = kernel(ext, q, caches[0][0], caches[0][1], meta, head_dim**-0.5)
    assert caches[0][0].dtype == cache_dtype and reference.abs().mean() > 0.05
    torch.testing.assert_close(fast, reference, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 256])  # 256: Gemma's heads, as two halves of 128
@pytest.mark.parametrize("window, softcap", [(None, None), (8, None), (5, 2.0)])
def test_windows_and_softcaps_match_the_torch_backend(ext, head_dim: int, window, softcap) -> None:
    """Gemma's local layers (a query sees its own key and the window - 1 before it) and Gemma 2's
    soft-capped scores, in decodes and prefill chunks with cached context, as the torch backend has them."""
    from chatapp.engine.attention import LayerAttention

    block_size = 16
    seq_lens = [1, 17, 40, 23, 70, 37]
    q_lens = [1, 1, 1, 23, 9, 16]
    meta = make_step(block_size, seq_lens, q_lens)
    torch.manual_seed(2)
    caches = [(torch.randn(64, block_size, 2, head_dim), torch.randn(64, block_size, 2, head_dim))]
    tokens = sum(q_lens)
    q = torch.randn(tokens, 4, head_dim)
    k, v = torch.randn(tokens, 2, head_dim), torch.randn(tokens, 2, head_dim)
    spec = LayerAttention(0.2, window, softcap)
    reference_backend = TorchAttentionBackend(caches, 4, head_dim, [spec])
    reference_backend.begin_step(meta)
    reference = reference_backend.forward(0, q, k, v)
    fast = ext.paged_attention(
        q,
        caches[0][0].permute(0, 2, 3, 1).contiguous(),
        caches[0][1],
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        spec.scale,
        window=window or 0,
        softcap=softcap or 0.0,
    )
    torch.testing.assert_close(fast, reference, atol=3e-5, rtol=1e-4)
    if window is not None:  # and the window is what made them agree
        unwindowed = TorchAttentionBackend(caches, 4, head_dim, [LayerAttention(0.2, None, softcap)])
        unwindowed.begin_step(meta)
        assert not torch.allclose(unwindowed.forward(0, q, k, v), reference, atol=1e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_rows_result_does_not_depend_on_its_chunk_batch_or_layout(ext, cache_dtype: torch.dtype) -> None:
    """Bitwise: the same query over the same keys gives the same bits however it is batched.

    A 40-token prompt in one chunk (tiles of 16 rows: query rows in vector lanes) against its
    last token alone (3 rows: keys in lanes) and beside another request's prefill.
    """
    bs = 16  # 9 query heads over 3 KV heads of 64
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(64, bs, 3, 64).to(cache_dtype), torch.randn(64, bs, 3, 64).to(cache_dtype)
    q = torch.randn(40, 9, 64)
    whole = make_step(bs, [40], [40])
    out_whole = kernel(ext, q, k_cache, v_cache, whole, 0.125)
    alone = make_step(bs, [40], [1])
    out_alone = kernel(ext, q[-1:], k_cache, v_cache, alone, 0.125)
    assert torch.equal(out_alone[0], out_whole[-1])
    batch = make_step(bs, [40, 12], [1, 12])
    mixed = kernel(ext, torch.cat([q[-1:], torch.randn(12, 9, 64)]), k_cache, v_cache, batch, 0.125)
    assert torch.equal(mixed[0], out_whole[-1])
    # And a middle token of the prompt as the last token of a shorter chunk.
    chunk = make_step(bs, [25], [6])
    out_chunk = kernel(ext, q[19:25], k_cache, v_cache, chunk, 0.125)
    assert torch.equal(out_chunk, out_whole[19:25])


@pytest.mark.parametrize("variant", ["bundled", "qwen3", "qwen2"])
def test_cpp_layer_loop_and_python_model_generate_the_same_tokens(variant: str, tmp_path) -> None:
    from chatapp.engine import LLM, SamplingParams
    from tests.tiny_model import make_tiny_model

    model = {
        "bundled": None,
        "qwen3": lambda: str(
            make_tiny_model(tmp_path / "q3", "Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_dim=32)
        ),
        "qwen2": lambda: str(make_tiny_model(tmp_path / "q2", "Qwen2ForCausalLM", num_heads=4, num_kv_heads=1)),
    }[variant]
    path = model() if model else None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello there, how are", "def f(x):", "The quick brown fox jumps over the lazy dog again and again"]
    # Float32: the same tokens. (The two paths differ in the last bits -- fused multiply-adds,
    # summation order -- which int8's per-token rounding can amplify into a different token.)
    fast = LLM(path, kv_cache_memory_gib=0.02, quantization=None)
    slow = LLM(path, kv_cache_memory_gib=0.02, quantization=None, cpu_kernels=False)
    assert fast.core.runner.cpu_forward is not None and slow.core.runner.cpu_forward is None
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in slow.generate(prompts, params)
    ]
    # int8: each path as close to float32 as the other (they differ from each other only on
    # near-ties; a broken int8 path falls far below: per-tensor activations reached 0.60).
    ids = fast.tokenizer.encode(
        " ".join(prompts) + " The fox, tired at last, lay down under the old oak tree "
        "and watched the dog chase its own tail until the sun went down."
    )
    reference = fast.prompt_logits(ids)
    for with_kernels in (True, False):
        int8 = LLM(path, kv_cache_memory_gib=0.02, quantization="int8", cpu_kernels=with_kernels)
        logits = int8.prompt_logits(ids)
        assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) > 0.8
        assert float((logits - reference).abs().max()) < 0.3 * float(reference.abs().max())


def test_kernels_built_at_install_are_used_when_they_fit(ext, tmp_path, monkeypatch) -> None:
    """CI installs the wheel in a fresh venv and sets CHATAPP_EXPECT_PREBUILT_KERNELS=1: there the
    kernels must come from the install, not from a compile on first use."""
    import json
    import os

    import chatapp

    if os.environ.get("CHATAPP_EXPECT_PREBUILT_KERNELS") == "1":
        assert cpu_kernels.source() == "install"
        assert "site-packages" in chatapp.__file__  # the installed wheel, not the checkout
    else:
        assert cpu_kernels.source() in ("install", "cache")
    # A build made for another CPU, source or torch is never imported.
    from chatapp.engine import kernel_build

    (tmp_path / f"{kernel_build.PREBUILT_NAME}.json").write_text(json.dumps({"key": "another-machine"}))
    (tmp_path / f"{kernel_build.PREBUILT_NAME}.so").write_bytes(b"not a library")
    monkeypatch.setattr(cpu_kernels, "PREBUILT_DIR", tmp_path)
    assert cpu_kernels._prebuilt(kernel_build.build_key(torch.__version__)) is None


def test_without_a_compiler_it_says_so_in_one_line_and_the_torch_path_runs(monkeypatch, caplog, tmp_path) -> None:
    import logging

    from chatapp.engine import kernel_build

    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path))  # nothing compiled on first use there
    monkeypatch.setattr(cpu_kernels, "_prebuilt", lambda key: None)  # nor at install

    def no_compiler(name, build_dir):
        raise RuntimeError("Error checking compiler version for c++: [Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(kernel_build, "compile_extension", no_compiler)
    with caplog.at_level(logging.INFO, logger="chatapp.engine.cpu_kernels"):
        assert cpu_kernels.load.__wrapped__() is None  # the uncached load: the real one stays as it was
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "running on the slower torch path" in warnings[0] and "'c++'" in warnings[0]
    assert any("compiling chatapp's C++ CPU kernels" in r.getMessage() for r in caplog.records)  # said while trying


def test_weights_below_two_to_the_minus_64_are_exactly_zero(ext) -> None:
    """A key whose softmax weight is below 2^-64 adds nothing (subnormal weights and products would cost a
    microcode assist per multiply-add); one above it still adds its share. A huge value at that key shows it."""
    head_dim, block_size = 64, 16
    meta = make_step(block_size, [3], [1], num_blocks=4)
    caches = torch.zeros(4, block_size, 1, head_dim), torch.zeros(4, block_size, 1, head_dim)
    block = int(meta.block_tables[0, 0])
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 0] = 1.0
    for gap, dropped in ((57.5, True), (23.0, False)):  # weights e^-57.5 / 2 ~ 5e-26 and e^-23 / 2 ~ 5e-11
        caches[0][block, :3, 0, 0] = torch.tensor([10.0, 10.0, 10.0 - gap])  # scores with scale 1
        caches[1][block, :2, 0, 0] = 1.0
        caches[1][block, 2, 0, 1] = 1e30
        out = kernel(ext, q, caches[0], caches[1], meta, 1.0)[0, 0]
        expected = 1e30 * torch.softmax(torch.tensor([0.0, 0.0, -gap], dtype=torch.float64), 0)[2]
        assert out[0] == pytest.approx(1.0, rel=1e-6)
        assert out[1] == (0.0 if dropped else pytest.approx(float(expected), rel=1e-5)), (gap, out[1])


def test_threads_sharing_attention_compute_every_task_once(ext) -> None:
    """Two threads claim attention's tasks (a request's KV head and up to 16 query rows) as they go: over
    many calls every output equals the one-thread result bit for bit. The queries alternate, so a task
    left undone (its output memory reused from the call before) would show the other query's values."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    q_lens = [1] * 12 + [20, 7]  # 12 decodes and two prefill chunks: 2 x (12 + 10 + 4) = 52 tasks
    seq_lens = [5 + 9 * i for i in range(12)] + [20, 40]
    meta = make_step(block_size, seq_lens, q_lens, num_blocks=128, seed=3)
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(128, block_size, num_kv_heads, head_dim, generator=gen).half()
    v_cache = torch.randn(128, block_size, num_kv_heads, head_dim, generator=gen).half()
    queries = [torch.randn(sum(q_lens), num_heads, head_dim, generator=gen) for _ in range(2)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel(ext, q, k_cache, v_cache, meta, head_dim**-0.5) for q in queries]
        torch.set_num_threads(2)
        for call in range(200):
            i = call % 2
            assert torch.equal(kernel(ext, queries[i], k_cache, v_cache, meta, head_dim**-0.5), alone[i]), call
    finally:
        torch.set_num_threads(threads)


def test_a_forked_child_computes_without_its_parents_workers(ext) -> None:
    """fork() copies the calling thread only: the child's kernels must not wait for workers that exist in
    the parent alone (it gets a pool of its own), and give the parent's bits. The child calls our kernel
    and nothing of torch's that could run OpenMP (which does not survive a fork once its threads exist)."""
    meta = make_step(16, [37, 5, 80], [1, 1, 16], seed=5)
    gen = torch.Generator().manual_seed(6)
    k_cache_t = torch.randn(64, 2, 64, 16, generator=gen).half()  # the kernel's own layout, ready
    v_cache = torch.randn(64, 16, 2, 64, generator=gen).half()
    q = torch.randn(18, 8, 64, generator=gen)
    args = (q, k_cache_t, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = ext.paged_attention(*args)  # the parent's workers now exist
        pid = os.fork()
        if pid == 0:  # the child: only the check, then _exit; a hang is ended by the alarm's default action
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(60)
                results = [ext.paged_attention(*args) for _ in range(20)]
                code = 0 if all(torch.equal(r, expected) for r in results) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


def test_torch_version_read_without_importing_torch_is_its_installed_version() -> None:
    import importlib.metadata

    from chatapp.engine import kernel_build

    assert kernel_build.torch_version() == importlib.metadata.version("torch") == torch.__version__
