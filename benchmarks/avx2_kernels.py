"""What a CPU without AVX-512 gets: the engine on a Haswell (AVX2) build of our kernels against this
machine's native build, same file, same run, alternated.

Run: python benchmarks/avx2_kernels.py [FILE.gguf] [--tokens N] [--prompt N] [--rounds N]
     (default: the bundled model)

The Haswell build is compiled once into the cache directory (a minute or two). It runs the AVX2 loops
(block_quant.cpp, kquant.cpp) and the scalar activation quantizer, as a laptop without AVX-512 does;
on this machine it reads memory at this machine's speed, so single-stream decode (bandwidth-bound)
should match the native build's, and prompt processing (compute-bound) shows the width given up.
"""

from __future__ import annotations

import argparse
import time

import torch


def _haswell_build():
    from chatapp import paths
    from chatapp.engine import kernel_build

    key = kernel_build.build_key(torch.__version__)
    build_dir = paths.cache_dir() / "torch_extensions" / f"cpu_kernels_haswell_{key}"
    return kernel_build.compile_extension(f"chatapp_cpu_kernels_haswell_{key}", build_dir, kernel_build.AVX2_MARCH)


def _measure(llm, prompt_ids: list[int], tokens: int) -> tuple[float, float]:
    """(prompt tok/s, decode tok/s) of one greedy request, with no prefix cache hit."""
    from chatapp.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate([prompt_ids[:8]], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    decode = time.perf_counter() - start
    return len(prompt_ids) / prefill, len(out[0].outputs[0].token_ids) / decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a GGUF file (default: the bundled model)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens to decode per round")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens for the prompt-processing figure")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (the best of each is kept)")
    args = parser.parse_args()
    from benchmarks.common import prompt_of_tokens
    from chatapp.engine import LLM, cpu_kernels

    if args.file is None:
        from chatapp.store import bundled_gguf_path

        args.file = str(bundled_gguf_path())
    native_ext = cpu_kernels.load()
    haswell_ext = _haswell_build()
    print(f"native loops {native_ext.block_quant_paths()}, Haswell build {haswell_ext.block_quant_paths()}")
    engines = {}
    for name, ext in (("native", native_ext), ("avx2", haswell_ext)):
        cpu_kernels.load = lambda ext=ext: ext  # the runner asks this module for the extension
        engines[name] = LLM(args.file, enable_prefix_caching=False)
        assert engines[name].config.quantization == "gguf", "this benchmark is for GGUF files run natively"
    prompt_ids = prompt_of_tokens(engines["native"].tokenizer, args.prompt, seed=1)
    best: dict[str, list[float]] = {name: [0.0, 0.0] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            pp, tg = _measure(llm, prompt_ids, args.tokens)
            best[name] = [max(best[name][0], pp), max(best[name][1], tg)]
    (npp, ntg), (app, atg) = best["native"], best["avx2"]
    print(f"{args.file}")
    print(f"  decode:  native {ntg:.1f} tok/s, AVX2 {atg:.1f} tok/s ({atg / ntg:.2f}x)")
    print(f"  prompt:  native {npp:.0f} tok/s, AVX2 {app:.0f} tok/s ({app / npp:.2f}x) over {args.prompt} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
