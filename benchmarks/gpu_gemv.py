"""One-row projections on a GPU: our GEMV kernel (chatapp/kernels/gemv.py) against cuBLAS.

For each weight shape of a ~1B and an 8B Llama (and their LM heads), a CUDA graph runs the product
over enough copies of the weight that none stays in L2 (a decode step never reads a weight twice),
and the bytes read per second are reported for cuBLAS (F.linear) and for each GEMV block shape. The
best block shape per weight shape is printed as a TUNED table.

With ``--tokenizer DIR`` (the bundled model's tokenizer files), the random ~1B Llama of
benchmarks/gpu.py then decodes with the measured table and without the kernel, for the end-to-end
difference.

    python benchmarks/gpu_gemv.py [--models 1b,8b] [--json out.json] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (N, K) of qkv, o, gate_up, down and the LM head
SHAPES = {
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
}
CONFIGS = [
    (bn, bk, w)
    for bn, bk, w in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024), (4, 8))
    if 1024 <= bn * bk <= 8192
]
BYTES_IN_FLIGHT = 512 * 2**20  # weights cycled through per graph replay: several times any L2


def graph_seconds(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Seconds per replay of a graph that makes ``calls`` in turn."""
    for call in calls:  # compile and warm outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def decode_rate(path: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Median single-stream decode tokens/s over five runs, and the greedy tokens."""
    from benchmarks import gpu
    from chatapp.engine import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gib=4, max_num_seqs=16)
    greedy = SamplingParams(temperature=0, max_tokens=gpu.NEW_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    rates = []
    for _ in range(5):
        total = gpu.seconds(lambda: llm.generate([prompt], greedy))
        rates.append((gpu.NEW_TOKENS - 1) / (total - gpu.seconds(lambda: llm.generate([prompt], first))))
    return statistics.median(rates), llm.generate([prompt], greedy)[0].outputs[0].token_ids


def end_to_end(tokenizer_dir: Path, tuned: dict[tuple[int, int], tuple[int, int, int]]) -> dict[str, float]:
    """Single-stream decode of the random ~1B Llama with cuBLAS, then with the GEMV kernel."""
    import tempfile

    from benchmarks import gpu
    from benchmarks.common import prompt_of_tokens
    from chatapp.engine.models import llama
    from chatapp.engine.tokenizer import Tokenizer
    from chatapp.kernels import gemv

    gemv.TUNED.update(tuned)
    out: dict[str, float] = {}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(gpu.make_1b_model(Path(tmp) / "llama-1b", tokenizer_dir))
        tokenizer = Tokenizer(path)
        prompt = prompt_of_tokens(tokenizer, 32, 0)
        for name, on in (("cublas", False), ("gemv", True), ("cublas_again", False)):
            llama.GEMV_KERNEL = on
            out[f"{name}_decode_tok_s"], tokens[name] = decode_rate(path, prompt)
            print(f"[1b] {name}: decode {out[f'{name}_decode_tok_s']:.0f} tok/s", flush=True)
            gpu.release()
    same = sum(a == b for a, b in zip(tokens["cublas"], tokens["gemv"]))
    print(f"[1b] greedy tokens equal to cuBLAS's: {same} of {len(tokens['cublas'])}", flush=True)
    out["tokens_same"] = same
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--models", default="1b,8b")
    parser.add_argument("--tokenizer", type=Path)
    args = parser.parse_args()
    from chatapp.kernels.gemv import gemv

    results: dict[str, object] = {"device": torch.cuda.get_device_name()}
    tuned = {}
    for model in args.models.split(","):
        for n, k in SHAPES[model]:
            nbytes = n * k * 2
            copies = max(2, math.ceil(BYTES_IN_FLIGHT / nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            cublas = copies * nbytes / graph_seconds([lambda w=w, x=x: F.linear(x, w) for w in weights]) / 1e9
            best = (0.0, CONFIGS[0])
            rows = {}
            for bn, bk, warps in CONFIGS:
                if bk > 2 * k:
                    continue
                err = (gemv(x, weights[0], bn, bk, warps).float() - ref).abs().max().item()
                assert err <= 0.02 * ref.abs().max().item() + 1e-2, (n, k, bn, bk, warps, err)
                seconds = graph_seconds([lambda w=w, x=x, c=(bn, bk, warps): gemv(x, w, *c) for w in weights])
                rate = copies * nbytes / seconds / 1e9
                rows[f"{bn}x{bk}/{warps}"] = rate
                best = max(best, (rate, (bn, bk, warps)))
            tuned[(n, k)] = best[1]
            line = f"[{model}] {n}x{k} ({nbytes / 1e6:.0f} MB): cuBLAS {cublas:.0f} GB/s, gemv best {best[0]:.0f} GB/s"
            print(f"{line} at {best[1]}", flush=True)
            results[f"{model} {n}x{k}"] = {"cublas_gb_s": cublas, "gemv_gb_s": rows, "best": best[1]}
            del weights
            torch.cuda.empty_cache()
    print("TUNED = {" + ", ".join(f"{key}: {value}" for key, value in tuned.items()) + "}")
    if args.tokenizer:
        results["end_to_end"] = end_to_end(args.tokenizer, tuned)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
