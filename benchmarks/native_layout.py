"""Design study: can decode read a GGUF file's blocks in place, as fast as our packed tiles and with their bits?

Why: a first start spends ~0.5 CPU-s of its ~1.4 on the packed copy of the weights (fresh pages and the repack,
README "Twenty-sixth session"). A kernel that read the file's own blocks would skip that copy; it must keep the
tile kernel's bits (answers must not change with the layout) and its decode speed.

`native_layout_kquant.cpp` holds such kernels for one row (decode) of Q4_K and Q6_K, in 16-row strips, two ways
(each row's sums taken out of the vector lanes, or with `--lanes` the codes transposed into them);
`native_layout_blocks32.cpp` holds Q4_0's and Q8_0's, the lanes way only. Not engine code. This script stacks
every projection of FILE in the type asked for that takes the hidden size (a 1B file: 450-1250 MB, past the
caches of the AMD EPYC it was written on), checks that its outputs, the scalar reference's and `block_linear`'s on the
repacked tiles have the same bits, then times both layouts, alternated over rounds (each the fastest of 5 calls),
on the same activations.

    python benchmarks/native_layout.py /tmp/chatapp-synthetic-gguf/synthetic-1b-Q4_K_M.gguf [--rounds 8]
    python benchmarks/native_layout.py /tmp/chatapp-synthetic-gguf/synthetic-1b-Q6_K.gguf --type Q6_K
    python benchmarks/native_layout.py /tmp/chatapp-synthetic-gguf/synthetic-1b-Q4_0.gguf --type Q4_0

Both layouts sit in 4 KB pages here (a running engine moves its tiles into 2 MB pages: +4-15% decode).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np

HERE = Path(__file__).resolve().parent
TYPE_IDS = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # ggml's type ids
BLOCKS32 = ("Q4_0", "Q8_0")  # native_layout_blocks32.cpp's; the rest native_layout_kquant.cpp's


def build(name: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    module: ModuleType = load(
        name=name,
        sources=[str(HERE / f"{name}.cpp")],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=tempfile.mkdtemp(prefix="chatapp-native-layout-"),
        verbose=False,
    )
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="a GGUF file with tensors of --type (Q4_K: a Q4_K_M file)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--type", choices=sorted(TYPE_IDS), default="Q4_K")
    parser.add_argument(
        "--lanes", action="store_true", help="codes transposed into lanes, not sums out of them (Q4_0, Q8_0: always)"
    )
    args = parser.parse_args()

    import torch

    from chatapp.engine import cpu_kernels
    from chatapp.engine.block_kinds import block_inputs
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_weights import KIND_FOR_GGUF_TYPE, TILE_BYTES

    ext = cpu_kernels.load()
    if ext is None:
        raise SystemExit("our C++ kernels are not built here")
    blocks32 = args.type in BLOCKS32
    native = build("native_layout_blocks32" if blocks32 else "native_layout_kquant")

    def file_rows(rows: np.ndarray, reps: int, reference: bool) -> tuple[np.ndarray, float]:
        extra = () if blocks32 else (args.lanes,)
        out: tuple[np.ndarray, float] = native.linear(x, rows, args.threads, reps, reference, type_id, *extra)
        return out

    gguf = GGUFModelFile(Path(args.file))
    type_id = TYPE_IDS[args.type]
    tensors = [t for t in gguf.tensors.values() if t.type_id == type_id]
    if not tensors:
        raise SystemExit(f"{args.file} has no {args.type} tensor")
    k = Counter(t.shape[-1] for t in tensors).most_common(1)[0][0]
    raw = np.concatenate([np.asarray(t.data) for t in tensors if t.shape[-1] == k])
    n = raw.shape[0]
    kind = KIND_FOR_GGUF_TYPE[args.type]
    packed = np.zeros((-(-n // 16), k // block_inputs(kind), TILE_BYTES[kind]), np.uint8)
    ext.set_num_threads(args.threads)
    ext.repack_gguf_array(raw, type_id, k, None, packed)
    print(f"{args.file}: {n} {args.type} rows of K {k}, {raw.nbytes / 1e6:.0f} MB as the file has them", flush=True)

    x = np.random.default_rng(0).standard_normal(k).astype(np.float32)
    xt = torch.from_numpy(x)[None]
    head = min(4096, n)
    tiled = ext.block_linear(xt, torch.from_numpy(packed[: -(-head // 16)]), kind, head).numpy()[0]
    reference, _ = file_rows(raw[:head], 1, True)
    fast, _ = file_rows(raw[:head], 1, False)
    same = [np.array_equal(a.view(np.uint32), tiled.view(np.uint32)) for a in (reference, fast)]
    print(f"bits equal to block_linear on the tiles ({head} rows): reference {same[0]}, in place {same[1]}")

    whole = torch.from_numpy(packed)
    in_place, tiles = [], []
    for _ in range(args.rounds):
        _, seconds = file_rows(raw, 5, False)
        in_place.append(raw.nbytes / seconds / 1e9)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            ext.block_linear(xt, whole, kind, n)
            best = min(best, time.perf_counter() - start)
        tiles.append(raw.nbytes / best / 1e9)
    a, b = statistics.median(in_place), statistics.median(tiles)
    rounds = f"medians of {args.rounds} alternated rounds"
    print(f"GB/s of file bytes, {rounds}: in place {a:.1f}, tiles {b:.1f}: {a / b:.2f}x")
    print(f"  in place: {' '.join(f'{v:.1f}' for v in in_place)}")
    print(f"  tiles:    {' '.join(f'{v:.1f}' for v in tiles)}")


if __name__ == "__main__":
    main()
