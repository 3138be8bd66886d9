"""Single-stream decode (or prompt processing), ours against llama.cpp and ik_llama.cpp, alternated
over rounds: medians.

Why: on these machines one process can read memory much faster or slower than the next (the same
`llama-bench` run gave 28 and 42 tok/s minutes apart; our engine 22 and 33), so a figure from
one run each, as `gguf_files.py` takes, can put any of the three ahead. Here every round runs
each engine once, in a fresh process, in turn (the order reversed every other round), and the
medians are compared.

    LLAMA_BENCH=/path/llama-bench IK_LLAMA_BENCH=/path/ik/llama-bench \
        python benchmarks/decode_alternated.py FILE.gguf [--rounds 4] [--test tg128|tg128-d1024|pp512|batched8]

Ours runs as an engine does once it has loaded: its packed weights moved into 2 MB pages, which it does
in the background ~1 s after loading (huge_pages.py); the script waits for that before its warm-up.
`--small-pages` adds ours with them left in 4 KB pages (`huge_pages=False`) to the rounds.

tg128 (decode). Ours: the 128 tokens after the first of a greedy answer (`ignore_eos`), through
`LLM`. Theirs: `llama-bench -p 0 -n 128 -r 1` (llama.cpp with `-fa 1`, ik_llama.cpp with
`-fa 0 -rtr 1`).
tg128-d1024 (decode at depth). The same 128 tokens after a 1,024-token context (random token ids, none
cached): a chat's later turns decode there, and attention, which tg128's short context hardly asks for,
reads every earlier token's keys and values in every layer. Theirs: llama.cpp `llama-bench -p 0 -n 128 -d 1024`,
ik_llama.cpp `llama-bench -gp 1024,128` (its name for the same test); each reports the 128 tokens' rate.
pp512 (prompt processing). Ours: a 512-token prompt (random token ids, none cached) to its first
token, the mean of two after a warm-up prompt of 512. Theirs: `llama-bench -p 512 -n 0 -r 2`, which
likewise warms up with one 512-token run and reports the mean of two (llama.cpp `-fa 1`, ik_llama.cpp
`-fa 1 -rtr 1`, their best flags for prompts here). Why the same warm-up: a process's first long prompt
also maps in the memory its activations take (a page fault costs ~1.5 us on this VM): a 1B Q8_0 model's
first 512-token prompt took ~18 thousand page faults, the next ones ~3 thousand (csrc/activation_pool.h).
llama-bench's warm-up run does the same for it.
batched8 (8-way decode). Ours: 8 requests of 64 new prompt tokens and 128 new tokens each, at once,
tok/s generated after the last first token, the better of two. Theirs: `llama-batched-bench -npp 64
-ntg 128 -npl 8`'s S_TG (llama.cpp `-fa on`, ik_llama.cpp `-fa on -rtr`), from `LLAMA_BATCHED_BENCH` and
`IK_LLAMA_BATCHED_BENCH`.

`--all-flags` runs each baseline at every flag set TESTS lists for the test (one engine per set, alternated with
the rest), and the ratio is taken against the fastest of them: the flags above were the best on the machines
measured first, and on another CPU another set can win (ik_llama.cpp's Q8_0 decode on a Zen 4 without `-rtr`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = dict(os.environ)  # the baselines run with their own OpenMP defaults

# 128 greedy tokens after the first, timed without it; __PROMPT__ is the answer's prompt (tg128's a short text,
# tg128-d1024's 1,024 ordinary token ids, none cached).
_OURS_DECODE = r"""
import json, random, sys, time
from chatapp.engine import LLM, SamplingParams
from chatapp.engine.huge_pages import wait_for_collapses
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.5, huge_pages=sys.argv[2] == "huge")
wait_for_collapses(120)  # the weights as a running engine holds them, ~1 s after loading
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
llm.generate(["warm up"], greedy(8))
rng = random.Random(0)
prompt = __PROMPT__
start = time.perf_counter()
out = llm.generate([prompt], greedy(129))[0]
print(json.dumps({"tps": 128 / (time.perf_counter() - start - out.metrics["ttft_s"])}))
"""
_OURS = _OURS_DECODE.replace("__PROMPT__", '"Tell me a story about"')
_OURS_DEPTH = _OURS_DECODE.replace("__PROMPT__", "[rng.randrange(1000, 20000) for _ in range(1024)]")

_OURS_PROMPT = r"""
import json, random, sys, time
from chatapp.engine import LLM, SamplingParams
from chatapp.engine.huge_pages import wait_for_collapses
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.5, huge_pages=sys.argv[2] == "huge")
wait_for_collapses(120)  # the weights as a running engine holds them, ~1 s after loading
first = SamplingParams(temperature=0, max_tokens=1)
rng = random.Random(0)
prompt = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # ordinary tokens, a new prompt each time
llm.generate([prompt(512)], first)  # a warm-up of the measured size, as llama-bench's own warm-up run
rates = []
for _ in range(2):
    start = time.perf_counter()
    llm.generate([prompt(512)], first)
    rates.append(512 / (time.perf_counter() - start))
print(json.dumps({"tps": sum(rates) / len(rates)}))  # the mean, as llama-bench -r 2 reports
"""

_OURS_EIGHT = r"""
import json, sys, time
from chatapp.engine import LLM, SamplingParams
from chatapp.engine.huge_pages import wait_for_collapses
llm = LLM(sys.argv[1], kv_cache_memory_gib=0.5, huge_pages=sys.argv[2] == "huge")
wait_for_collapses(120)  # the weights as a running engine holds them, ~1 s after loading
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
llm.generate(["warm up"], greedy(8))
best = 0.0
for run in range(2):  # new prompts each run (no prefix-cache hits)
    prompts = [[2000 + run * 700 + i * 50 + j for j in range(64)] for i in range(8)]
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(128))
    generating = time.perf_counter() - start - max(o.metrics["ttft_s"] for o in outs)
    best = max(best, 8 * 127 / generating)  # after the last first token, as llama-batched-bench's S_TG
print(json.dumps({"tps": best}))
"""

# Per test: our script, the baselines' tool (llama-bench or llama-batched-bench) and its arguments (one list for both,
# or llama.cpp's and ik_llama.cpp's where they differ), and each baseline's flag sets: the first is the one found best
# on the machines measured so far; `--all-flags` runs every one and compares against the fastest (which set wins moves
# with the CPU and the file).
TESTS: dict[str, tuple[str, str, list[str] | tuple[list[str], list[str]], list[list[str]], list[list[str]]]] = {
    "tg128": (
        _OURS,
        "bench",
        ["-p", "0", "-n", "128", "-r", "1"],
        [["-fa", "1"], ["-fa", "0"]],
        [["-fa", "0", "-rtr", "1"], ["-fa", "1", "-rtr", "0"], ["-fa", "0", "-rtr", "0"], ["-fa", "1", "-rtr", "1"]],
    ),
    # decode after a 1,024-token context, as a chat's later turns run: llama.cpp's depth (-d), ik_llama.cpp's
    # "generate after prompt" (-gp), both reporting the 128 generated tokens' rate alone
    "tg128-d1024": (
        _OURS_DEPTH,
        "bench",
        (["-p", "0", "-n", "128", "-d", "1024", "-r", "1"], ["-p", "0", "-n", "0", "-gp", "1024,128", "-r", "1"]),
        [["-fa", "1"], ["-fa", "0"]],
        [["-fa", "0", "-rtr", "1"], ["-fa", "1", "-rtr", "0"], ["-fa", "0", "-rtr", "0"], ["-fa", "1", "-rtr", "1"]],
    ),
    "pp512": (
        _OURS_PROMPT,
        "bench",
        ["-p", "512", "-n", "0", "-r", "2"],
        [["-fa", "1"], ["-fa", "0"]],
        [["-fa", "1", "-rtr", "1"], ["-fa", "1", "-rtr", "0"], ["-fa", "0", "-rtr", "1"]],
    ),
    # 8 sequences of 64 prompt tokens, 128 new tokens each: generation tok/s (S_TG)
    "batched8": (
        _OURS_EIGHT,
        "batched",
        ["-c", "2048", "-b", "512", "-npp", "64", "-ntg", "128", "-npl", "8"],
        [["-fa", "on"], ["-fa", "off"]],
        [["-fa", "on", "-rtr"], ["-fa", "on"], ["-fa", "off", "-rtr"]],
    ),
}


def ours(path: Path, script: str, pages: str = "huge") -> float:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), pages],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=1800,
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


def batched_bench(binary: str, path: Path, test: list[str], flags: list[str]) -> float:
    """llama-batched-bench's S_TG (generation tok/s) for the one row its arguments ask for."""
    proc = subprocess.run(
        [binary, "-m", str(path), "-t", "2", *test, *flags],
        capture_output=True,
        text=True,
        env=BASE_ENV,
        check=True,
        timeout=1800,
    )
    output = proc.stdout + proc.stderr  # ik_llama.cpp prints its table to stderr
    rows = [line for line in output.splitlines() if re.match(r"\|\s+64\s+\|\s+128\s+\|\s+8\s+\|", line)]
    if not rows:
        raise RuntimeError(f"no result row in {binary}'s output:\n{output[-2000:]}")
    return float([c.strip() for c in rows[-1].strip().strip("|").split("|")][7])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--test", choices=sorted(TESTS), default="tg128")
    parser.add_argument(
        "--small-pages", action="store_true", help="also run ours with its weights in 4 KB pages (huge_pages=False)"
    )
    parser.add_argument(
        "--all-flags", action="store_true", help="run each baseline at every flag set the test lists, not the first"
    )
    args = parser.parse_args()
    script, tool, test, mainline_flags, ik_flags = TESTS[args.test]
    mainline_test, ik_test = test if isinstance(test, tuple) else (test, test)
    run_tool, variable = (llama_bench, "LLAMA_BENCH") if tool == "bench" else (batched_bench, "LLAMA_BATCHED_BENCH")
    engines: list[tuple[str, Callable[[], float]]] = [("ours", lambda: ours(args.file, script))]
    if args.small_pages:
        engines.append(("ours, 4 KB pages", lambda: ours(args.file, script, "small")))
    baselines = (("llama.cpp", "", mainline_test, mainline_flags), ("ik_llama.cpp", "IK_", ik_test, ik_flags))
    for name, prefix, what, flag_sets in baselines:
        binary = os.environ.get(prefix + variable)
        if not binary:
            continue
        for flags in flag_sets if args.all_flags else flag_sets[:1]:
            label = f"{name} {' '.join(flags)}" if args.all_flags else name
            engines.append(
                (label, lambda binary=binary, what=what, flags=flags: run_tool(binary, args.file, what, flags))
            )
    results: dict[str, list[float]] = {name: [] for name, _ in engines}
    for round_ in range(args.rounds):
        for name, run in engines if round_ % 2 == 0 else engines[::-1]:
            results[name].append(run())
            print(f"round {round_ + 1}: {name} {results[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"{name}: median {medians[name]:.1f} tok/s ({', '.join(f'{v:.1f}' for v in values)})")
    best = max((m for name, m in medians.items() if not name.startswith("ours")), default=0.0)
    if best:
        print(f"ours / the faster baseline: {medians['ours'] / best:.2f}x")
    if "ours, 4 KB pages" in medians:
        print(f"ours in 2 MB pages / in 4 KB pages: {medians['ours'] / medians['ours, 4 KB pages']:.2f}x")


if __name__ == "__main__":
    main()
