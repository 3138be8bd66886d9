"""What a projection call costs beyond streaming its weights: one row against a file's Q4_K (or another kind's)
projections over the hidden size (q, k, v, o, gate and up) joined into one packed linear, run as one call and in
calls of a few MB, alternated.

Why: a one-row decode step of a 1B model makes ~89 projection calls of 2-13 MB. Inside one long call the
one-row loops stream about as fast as a plain read (the forty-third session: Q4_K 31.6 GB/s against 32.8 for a
bare loop over the same bytes); each call adds the activations' quantization, the pool's start and the threads'
uneven finish. This prints, per call size, the rate and the time each call adds to one long call's, so a change to
that fixed cost (worker_pool.h, tile_walk.h's for_tiles_balanced) can be measured apart from the streaming.

    python benchmarks/call_size.py FILE.gguf [--rounds 8] [--kind 104]

The kinds are the extension's (block_quant.h: 104 Q4_K, 106 Q6_K, ...); the default is the file's commonest
kind among those projections. Each call here also pays Python's call into the extension (~1-2 us), which
the engine's C++ layer loop does not.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# isort: off
import chatapp  # noqa: E402,F401  (first: the engine's OpenMP wait policy, as step_breakdown.py says)

# isort: on
import step_breakdown  # noqa: E402
import torch  # noqa: E402

SIZES_MB = (16.0, 4.0, 2.0, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kind", type=int, default=None)
    args = parser.parse_args()
    from chatapp.engine import cpu_kernels

    ext = cpu_kernels.load()
    if ext is None:
        raise SystemExit("chatapp's C++ kernels did not build: nothing to measure")
    torch.set_num_threads(2)
    layers, _ = step_breakdown.packed_projections(args.file, ext)
    hidden = layers[0][0][3]  # attn_q's inputs
    wide = [(w, kind) for layer in layers for w, kind, _, k in layer if k == hidden]
    kind = args.kind if args.kind is not None else collections.Counter(k for _, k in wide).most_common(1)[0][0]
    joined = [w for w, k in wide if k == kind]
    if not joined:
        raise SystemExit(f"no {hidden}-input projection of kind {kind} in {args.file.name}")
    packed = step_breakdown.in_huge_pages(torch.cat(joined, 0).contiguous())
    tiles, tile_bytes = packed.shape[0], packed.shape[1] * packed.shape[2]
    x = torch.randn(1, hidden)

    def calls_of(mb: float | None) -> list[torch.Tensor]:
        per = tiles if mb is None else max(1, int(mb * 1e6 / tile_bytes))
        return [packed[i : i + per] for i in range(0, tiles, per)]

    runs = {"one call": calls_of(None), **{f"{mb:g} MB calls": calls_of(mb) for mb in SIZES_MB}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
            start = time.perf_counter()
            for part in runs[name]:
                ext.block_linear(x, part, kind, part.shape[0] * 16, None)
            times[name].append(time.perf_counter() - start)
    whole = statistics.median(times["one call"])
    print(f"{args.file.name}: kind {kind}, {packed.numel() / 1e6:.1f} MB of {hidden}-input projections, one row")
    for name, values in times.items():
        median, count = statistics.median(values), len(runs[name])
        ratios = statistics.median(v / w for v, w in zip(values, times["one call"]))
        added = (median - whole) / count * 1e6 if count > 1 else 0.0
        print(
            f"  {name}: {count} calls, {packed.numel() / median / 1e9:.1f} GB/s, time / one call {ratios:.3f}, "
            f"{added:.1f} us added a call"
        )


if __name__ == "__main__":
    main()
