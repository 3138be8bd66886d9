"""Where a decode step's time goes, on the torch-free CPU runner: the engine's step split into the layer loop,
the LM head, sampling and the engine around them, the layer loop further by op (the extension times each of its
ops when asked: csrc/op_profile.h); and beside it, the same file's projections run alone,
back to back, on the same number of rows.

Why: a batch of decodes (8-way in decode_alternated.py) reads every weight once a step, so its speed is the
projections' streaming rate plus everything else the step does. The difference between the layer loop and
the projections alone is what attention, the norms, RoPE and the KV writes cost together; the ops' own times
say which (each op timed where it runs, so a projection's line is its streaming inside the loop). "between
them" is the rest of the loop's call: the embedding lookup, the RoPE tables and the arrays handed to C++.

    python benchmarks/step_breakdown.py FILE.gguf [--batch 8] [--tokens 128]

The projections alone: each layer's weight tensors as the file stores them, packed by the extension's own
repack, each into a mapping of its own in 2 MB pages (as a running engine holds them), each run on random rows in the
file's layer order, the best of five passes. Their streaming rate (packed bytes / time) is printed too, and beside
it a plain read of as many bytes made after each pass (best of five) and the share of it the projections reach.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# isort: off
# First: chatapp sets the engine's OpenMP wait policy before torch loads OpenMP. With OpenMP's default, the threads
# of the plain read below went on spinning into the next projections pass (which then ran ~30% slower).
import chatapp  # noqa: E402,F401

# isort: on
import numpy as np  # noqa: E402
import torch  # noqa: E402

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def engine_step(path: Path, batch: int, tokens: int) -> dict[str, float]:
    """ms per decode step, whole and by part, over `batch` greedy requests of 64 prompt tokens (their one
    prefill step left out: each part's first call is the prefill's)."""
    from chatapp.engine import LLM, SamplingParams
    from chatapp.engine.huge_pages import wait_for_collapses

    llm = LLM(str(path), kv_cache_memory_gib=0.5, huge_pages=True)
    wait_for_collapses(120)
    runner, model = llm.core.runner, llm.core.runner.model
    calls: dict[str, list[float]] = {}

    def timed(owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                calls.setdefault(part, []).append(time.perf_counter() - start)

        setattr(owner, name, wrapper)

    timed(llm.core, "step", "step")
    timed(model, "forward", "layer loop")
    model.cpu.set_profiling(True)  # the layer loop's ops too, one forward at a time (op_profile.h)
    forward = model.forward

    def profiled(*args: object, **kwargs: object) -> object:
        try:
            return forward(*args, **kwargs)
        finally:
            for op, seconds, _ in model.cpu.take_profile():
                calls.setdefault(f"op {op}", []).append(seconds)

    model.forward = profiled
    timed(model, "compute_logits", "LM head")
    timed(runner, "sampler", "sampling")
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for run in range(2):  # the first warms the KV pool's pages and the activation buffers
        calls.clear()
        llm.generate([[2000 + run * 700 + i * 50 + j for j in range(64)] for i in range(batch)], greedy)
    ms = {part: float(np.mean(times[1:])) * 1e3 for part, times in calls.items()}
    ms["engine around them"] = ms["step"] - ms["layer loop"] - ms["LM head"] - ms["sampling"]
    return ms


def print_ops(ms: dict[str, float]) -> None:
    """The layer loop's ops (all layers' calls summed), heaviest first, as ms a step and % of the loop."""
    ops = sorted(((part[3:], t) for part, t in ms.items() if part.startswith("op ")), key=lambda p: -p[1])
    print("  inside the layer loop, by op:")
    for op, t in ops:
        print(f"    {op}: {t:.2f} ms ({100 * t / ms['layer loop']:.1f}%)")
    print(f"    between them: {ms['layer loop'] - sum(t for _, t in ops):.2f} ms")


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a uint8 tensor in a mapping of its own, 2 MB aligned and asking for 2 MB pages."""
    nbytes = tensor.numel()
    mapping = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    flat = np.frombuffer(mapping, dtype=np.uint8)
    start = (-flat.ctypes.data) % (2 << 20)
    view = flat[start : start + nbytes]
    view[:] = tensor.numpy().reshape(-1)
    return torch.from_numpy(view).view(tensor.shape)  # the array keeps the mapping alive


def packed_projections(path: Path, ext: Any) -> tuple[list[list[tuple[torch.Tensor, int, int, int]]], int]:
    """Each layer's projections packed from the file's own blocks, each moved into 2 MB pages as it is packed:
    per layer [(packed, kind, out_features, in_features)], and the packed bytes in all."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("blk.")})
    packed = []
    for i in layers:
        parts = []
        for role in PROJECTIONS:
            t = tensors[f"blk.{i}.{role}.weight"]
            k, n = (int(v) for v in t.shape[:2])
            raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(n, -1))  # a writable copy
            w, kind = ext.repack_gguf(raw, int(t.tensor_type), k)
            parts.append((in_huge_pages(w), kind, n, k))
        packed.append(parts)
    return packed, sum(w.numel() for layer in packed for w, *_ in layer)


def projections_alone(path: Path, batch: int) -> tuple[float, float, float]:
    """ms for one pass over every layer's projections on `batch` random rows (best of five), its GB/s, and the GB/s
    of a plain read of as many bytes (a float32 sum, same threads, best of five) run after each pass.

    Why the read beside them: this host's memory gives one process 26 GB/s one minute and 50 the next, so a rate
    alone says little; read in turn with the passes, the plain read says what the memory gave then, and the
    ratio how much of it the kernels' streaming takes."""
    from chatapp.engine import cpu_kernels

    ext = cpu_kernels.load()
    if ext is None:
        raise SystemExit("chatapp's C++ kernels did not build: there is no torch-free runner to break down")
    torch.set_num_threads(2)
    layers, total = packed_projections(path, ext)
    rows = {k: torch.randn(batch, k) for layer in layers for *_, k in layer}
    plain = in_huge_pages(torch.ones(total // 4 * 4, dtype=torch.uint8)).view(torch.float32)
    best = best_read = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for layer in layers:
            for w, kind, n, k in layer:
                ext.block_linear(rows[k], w, kind, n, None)
        best = min(best, time.perf_counter() - start)
        start = time.perf_counter()
        plain.sum()
        best_read = min(best_read, time.perf_counter() - start)
    return best * 1e3, total / best / 1e9, total / best_read / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    ms = engine_step(args.file, args.batch, args.tokens)
    alone, rate, read = projections_alone(args.file, args.batch)
    print(
        f"{args.file.name}, {args.batch} requests: {ms['step']:.2f} ms a decode step "
        f"({args.batch * 1e3 / ms['step']:.0f} tok/s)"
    )
    for part in ("layer loop", "LM head", "sampling", "engine around them"):
        print(f"  {part}: {ms[part]:.2f} ms")
    print_ops(ms)
    print(
        f"the projections alone, {args.batch} rows: {alone:.2f} ms ({rate:.1f} GB/s of packed weights); the layer "
        f"loop's rest (attention, norms, RoPE, KV writes, the projections' slower streaming inside the loop): "
        f"{ms['layer loop'] - alone:.2f} ms"
    )
    print(
        f"a plain read of as many bytes (a float32 sum, 2 threads) after each pass: {read:.1f} GB/s; the projections "
        f"stream at {100 * rate / read:.0f}% of it"
    )


if __name__ == "__main__":
    main()
