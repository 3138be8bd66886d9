"""Float16 against float32 KV cache: decode speed at long contexts, and bytes per token.

Decode reads the whole context's keys and values every step, so at long contexts the cache's
type is part of the bytes per token. For each context, the prompt is prefilled once (a prefix-cache
entry), then a request with the same prompt decodes ``--tokens`` tokens after a full cache hit:
its time is decode at that context. The two types alternate, best of ``--repeat``.

    python benchmarks/kv_cache.py [--model M] [--contexts 2048 6144]

Quality: `python benchmarks/quality.py --kv-cache --quantization none auto`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import prompt_of_tokens  # noqa: E402
from chatapp.engine import LLM, SamplingParams  # noqa: E402


def decode_tps(llm: LLM, prompt: list[int], tokens: int) -> float:
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # prefill, cached
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    seconds = time.perf_counter() - start
    assert out.num_cached_tokens >= len(prompt) - llm.config.block_size
    return len(out.outputs[0].token_ids) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 6144])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engines = {
        kv: LLM(
            args.model, kv_cache_dtype=kv, max_model_len=max(args.contexts) + args.tokens + 16, kv_cache_memory_gib=1.0
        )
        for kv in ("float32", "float16")
    }
    for kv, llm in engines.items():
        per_token = llm.core.runner.bytes_per_block() / llm.config.block_size
        print(f"{kv}: {per_token / 1024:.1f} KiB of KV cache per token ({llm.config.quantization} weights)")
    for ctx in args.contexts:
        prompt = prompt_of_tokens(engines["float16"].tokenizer, ctx, seed=ctx)
        best = {kv: 0.0 for kv in engines}
        for _ in range(args.repeat):
            for kv, llm in engines.items():
                best[kv] = max(best[kv], decode_tps(llm, prompt, args.tokens))
        print(
            f"context {ctx}: decode float32 KV {best['float32']:.1f} tok/s, float16 KV {best['float16']:.1f} tok/s "
            f"({best['float16'] / best['float32']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
