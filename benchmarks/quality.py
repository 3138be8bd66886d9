"""How closely the int8 and int4 engines follow float32: greedy agreement on the bundled model.

With --kv-cache: how closely a float16 KV cache (the CPU default) follows a float32 one, the
weights the same (each --quantization given, "none" for float32 weights).

For each chat prompt, float32 answers greedily; the quantized engine then reads
float32's answer token by token (teacher forcing) and we count how often its
own top choice is float32's next token. Also reported: how many whole answers
come out identical, and the largest logit difference.

    python benchmarks/quality.py [--model M] [--tokens 32]
    python benchmarks/quality.py --kv-cache --quantization none auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import chatapp  # noqa: E402,F401  first: it sets OpenMP's wait policy before torch loads
from chatapp.engine import LLM  # noqa: E402
from tests.quality_checks import QUESTIONS, agreement  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"])
    parser.add_argument("--kv-cache", action="store_true", help="float16 against float32 KV cache instead")
    args = parser.parse_args()
    if args.kv_cache:
        # Against float32 weights and cache: the quantized weights' own noise (int8 activations round
        # differently after any change) is the scale a half cache's effect must be judged on.
        fp32 = LLM(args.model, quantization=None, kv_cache_memory_gib=0.25, kv_cache_dtype="float32")
        for quantization in args.quantization:
            q = None if quantization == "none" else quantization
            for kv in ("float32", "float16"):
                candidate = LLM(args.model, quantization=q, kv_cache_memory_gib=0.25, kv_cache_dtype=kv)
                r = agreement(fp32, candidate, args.tokens)
                print(
                    f"weights {candidate.config.quantization or 'float32'}, {kv} KV cache vs float32 weights and "
                    f"cache on {len(QUESTIONS)} chat prompts x {args.tokens} tokens: greedy agreement "
                    f"{r['greedy_agreement']:.3f}, identical answers {r['identical_answers']:.2f}, "
                    f"max |logit diff| {r['max_logit_diff']:.2f}",
                    flush=True,
                )
                del candidate
        return
    fp32 = LLM(args.model, quantization=None, kv_cache_memory_gib=0.25)
    for quantization in args.quantization:
        candidate = LLM(args.model, quantization=quantization, kv_cache_memory_gib=0.25)
        r = agreement(fp32, candidate, args.tokens)
        print(
            f"{quantization} vs float32 on {len(QUESTIONS)} chat prompts x {args.tokens} tokens: greedy agreement "
            f"{r['greedy_agreement']:.3f}, identical answers {r['identical_answers']:.2f}, "
            f"max |logit diff| {r['max_logit_diff']:.2f}"
        )
        del candidate


if __name__ == "__main__":
    main()
