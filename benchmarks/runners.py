"""The torch-free CPU runner against the torch runner, same GGUF file, one process, alternated.

Decode tok/s (prompt of 64 tokens, then new tokens only) at 1 and 8 streams greedy, and at 8
and 16 streams sampled (temperature, top-k, top-p: the sampler's cost shows there), each case
run on both runners in turn for ``--rounds`` rounds; the best of each is printed with the ratio
array / torch. The two give the same greedy tokens (tests/test_array_runner.py); this says
whether the array runner's numpy embedding, LM head and sampler cost anything.

    python benchmarks/runners.py [FILE.gguf] [--rounds 2]

Without a file: the bundled model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatapp.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="a GGUF file (default: the bundled model)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    engines = {r: LLM(args.file, max_num_seqs=16, kv_cache_memory_gib=0.5, runner=r) for r in ("array", "torch")}
    prompts = [[100 + i + 7 * j for j in range(64)] for i in range(16)]
    sampled = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}
    cases = {
        "greedy, 1 stream": (prompts[:1], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)),
        "greedy, 8 streams": (prompts[:8], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)),
        "sampled, 8 streams": (prompts[:8], SamplingParams(max_tokens=96, ignore_eos=True, **sampled)),
        "sampled, 16 streams": (prompts, SamplingParams(max_tokens=64, ignore_eos=True, **sampled)),
    }
    for llm in engines.values():  # warm-up: first-use costs out of the figures
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, (batch, params) in cases.items():
            for runner, llm in engines.items():
                start = time.perf_counter()
                outs = llm.generate(batch, params)
                rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                best[name, runner] = max(best.get((name, runner), 0.0), rate)
    for name in cases:
        array, torch = best[name, "array"], best[name, "torch"]
        print(f"{name:20s} array {array:7.1f} tok/s   torch {torch:7.1f} tok/s   array / torch {array / torch:.2f}")


if __name__ == "__main__":
    main()
