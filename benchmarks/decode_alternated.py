"""Single-stream decode (or prompt processing), ours against llama.cpp and ik_llama.cpp, alternated
over rounds: medians.

Why: on these machines one process can read memory much faster or slower than the next (the same
`llama-bench` run gave 28 and 42 tok/s minutes apart; our engine 22 and 33), so a figure from
one run each, as `gguf_files.py` takes, can put any of the three ahead. Here every round runs
each engine once, in a fresh process, in turn (the order reversed every other round), and the
medians are compared.

    LLAMA_BENCH=/path/llama-bench IK_LLAMA_BENCH=/path/ik/llama-bench \
        python benchmarks/decode_alternated.py FILE.gguf [--rounds 4] [--test tg128|pp512]

tg128 (decode). Ours: the 128 tokens after the first of a greedy answer (`ignore_eos`), through
`LLM`. Theirs: `llama-bench -p 0 -n 128 -r 1` (llama.cpp with `-fa 1`, ik_llama.cpp with
`-fa 0 -rtr 1`).
pp512 (prompt processing). Ours: a 512-token prompt (random token ids, none cached) to its first
token, the better of two. Theirs: `llama-bench -p 512 -n 0 -r 2` (llama.cpp `-fa 1`, ik_llama.cpp
`-fa 1 -rtr 1`, their best flags for prompts here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = dict(os.environ)  # the baselines run with their own OpenMP defaults

_OURS = r"""
import json, sys, time
from chatapp.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.5)
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
llm.generate(["warm up"], greedy(8))
start = time.perf_counter()
out = llm.generate(["Tell me a story about"], greedy(129))[0]
print(json.dumps({"tps": 128 / (time.perf_counter() - start - out.metrics["ttft_s"])}))
"""


_OURS_PROMPT = r"""
import json, random, sys, time
from chatapp.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.5)
first = SamplingParams(temperature=0, max_tokens=1)
rng = random.Random(0)
prompt = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # ordinary tokens, a new prompt each time
llm.generate([prompt(64)], first)
best = 0.0
for _ in range(2):
    start = time.perf_counter()
    llm.generate([prompt(512)], first)
    best = max(best, 512 / (time.perf_counter() - start))
print(json.dumps({"tps": best}))
"""

# Per test: our script, llama-bench's -p/-n/-r, and each baseline's flags.
TESTS = {
    "tg128": (_OURS, ["-p", "0", "-n", "128", "-r", "1"], ["-fa", "1"], ["-fa", "0", "-rtr", "1"]),
    "pp512": (_OURS_PROMPT, ["-p", "512", "-n", "0", "-r", "2"], ["-fa", "1"], ["-fa", "1", "-rtr", "1"]),
}


def ours(path: Path, script: str) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT, check=True, timeout=1800
    )
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["tps"])


def llama_bench(binary: str, path: Path, test: list[str], flags: list[str]) -> float:
    proc = subprocess.run(
        [binary, "-m", str(path), "-t", "2", *test, "-o", "json", *flags],
        capture_output=True,
        text=True,
        env=BASE_ENV,
        check=True,
        timeout=1800,
    )
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--test", choices=sorted(TESTS), default="tg128")
    args = parser.parse_args()
    script, test, mainline_flags, ik_flags = TESTS[args.test]
    engines: list[tuple[str, Callable[[], float]]] = [("ours", lambda: ours(args.file, script))]
    if os.environ.get("LLAMA_BENCH"):
        engines.append(("llama.cpp", lambda: llama_bench(os.environ["LLAMA_BENCH"], args.file, test, mainline_flags)))
    if os.environ.get("IK_LLAMA_BENCH"):
        engines.append(("ik_llama.cpp", lambda: llama_bench(os.environ["IK_LLAMA_BENCH"], args.file, test, ik_flags)))
    results: dict[str, list[float]] = {name: [] for name, _ in engines}
    for round_ in range(args.rounds):
        for name, run in engines if round_ % 2 == 0 else engines[::-1]:
            results[name].append(run())
            print(f"round {round_ + 1}: {name} {results[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"{name}: median {medians[name]:.1f} tok/s ({', '.join(f'{v:.1f}' for v in values)})")
    best = max((m for name, m in medians.items() if name != "ours"), default=0.0)
    if best:
        print(f"ours / the faster baseline: {medians['ours'] / best:.2f}x")


if __name__ == "__main__":
    main()
