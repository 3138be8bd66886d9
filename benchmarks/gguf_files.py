"""Our engine against llama.cpp (and ik_llama.cpp) on synthetic Llama-shaped GGUF files, one run.

Why synthetic: the Hub is out of reach here, and the figures that matter (bytes read per token,
blocks decoded per second, memory, start-up) depend on the file's shape and tensor types, not on
what the weights say. The files are written with random but valid blocks of each type
(tests/gguf_models.py, the bundled tokenizer); with LLAMA_QUANTIZE set, an F16 file is instead
quantised by llama.cpp's own `llama-quantize` into the same type (its real type mix).

Per file, one engine at a time (never two competing for the cores):
- single-stream decode tok/s (128 tokens), also as % of the roofline: file bytes x tok/s / measured
  read bandwidth (a 2-thread sum over 2 GiB, best of 5, taken in the same run);
- prompt processing tok/s (512 tokens) and 8-way decode tok/s (8 prompts of 64 tokens, 128 new tokens
  each; the generation phase only, after the last first token, as llama-batched-bench's S_TG);
- ours: load time and peak RSS of loading (in a fresh process), and start to /health of
  `chatapp serve` against llama-server's.
Ratios are ours / the faster baseline on each figure.

    LLAMA_BENCH=.../llama-bench LLAMA_BATCHED_BENCH=.../llama-batched-bench LLAMA_SERVER=.../llama-server \\
    IK_LLAMA_BENCH=.../ik/llama-bench python benchmarks/gguf_files.py --shape 1b --mix Q4_0 Q4_K_M Q6_K Q8_0

benchmarks/README.md says how to build the baselines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BASE_ENV = dict(os.environ)  # llama.cpp runs with its own OpenMP defaults (chatapp sets OMP_WAIT_POLICY)

_OURS = r"""
import json, sys, time
import psutil
t0 = time.perf_counter()
from chatapp.engine import LLM, SamplingParams
rss0 = psutil.Process().memory_info().rss
t1 = time.perf_counter()
llm = LLM(sys.argv[1], kv_cache_memory_gib=float(sys.argv[2]))
load = time.perf_counter() - t1
# VmHWM, not ru_maxrss: that keeps the parent's peak across exec
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
llm.generate(["warm up"], greedy(8))
def best(fn, runs=2):
    return min(fn() for _ in range(runs))
def decode():
    t = time.perf_counter(); llm.generate(["Tell me a story about"], greedy(128)); return time.perf_counter() - t
runs = iter(range(100))
def prefill():  # a new prompt each run: a repeated one would be a prefix-cache hit
    first = next(runs)
    ids = [1000 + (i * 7 + first * 13) % 40000 for i in range(512)]
    t = time.perf_counter(); llm.generate([ids], greedy(1)); return time.perf_counter() - t
def eight():  # generation only, as llama-batched-bench's S_TG: from the last first token to the end
    prompts = [[2000 + i * 50 + j for j in range(64)] for i in range(8)]
    t = time.perf_counter(); outs = llm.generate(prompts, greedy(128)); total = time.perf_counter() - t
    return total - max(o.metrics["ttft_s"] for o in outs)
out = {"load_s": load, "load_rss_bytes": peak - rss0, "decode_tps": 128 / best(decode),
       "pp_tps": 512 / best(prefill), "eight_tps": 8 * 127 / best(eight, 2)}
print(json.dumps(out))
"""


def read_bandwidth(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**29, dtype=torch.float32)  # 2 GiB
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - start))
    return best


def write_file(directory: Path, shape: str, mix: str) -> Path:
    from tests.gguf_models import SHAPES, write_llama_gguf

    path = directory / f"synthetic-{shape}-{mix}.gguf"
    if path.exists():
        return path
    quantize = os.environ.get("LLAMA_QUANTIZE")
    if quantize:
        f16 = write_llama_gguf(directory / f"synthetic-{shape}-F16.gguf", SHAPES[shape], mix="F16")
        subprocess.run([quantize, str(f16), str(path), mix], check=True, env=BASE_ENV, capture_output=True)
    else:
        write_llama_gguf(path, SHAPES[shape], mix=mix)
    return path


def ours(path: Path, kv_gib: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _OURS, str(path), str(kv_gib)], capture_output=True, text=True, cwd=ROOT, timeout=3600
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, path: Path, threads: int, flags: list[list[str]]) -> dict:
    """Best pp512 and tg128 over the flag sets given (each baseline at its best flags)."""
    best = {"pp_tps": 0.0, "decode_tps": 0.0}
    for extra in flags:
        proc = subprocess.run(
            [binary, "-m", str(path), "-t", str(threads), "-p", "512", "-n", "128", "-r", "2", "-o", "json", *extra],
            capture_output=True,
            text=True,
            env=BASE_ENV,
            timeout=3600,
        )
        if proc.returncode != 0:
            continue
        for test in json.loads(proc.stdout):
            key = "pp_tps" if test.get("n_prompt", 0) > 0 else "decode_tps"
            best[key] = max(best[key], float(test["avg_ts"]))
    return best


def batched_bench(binary: str, path: Path, threads: int) -> float:
    """8 sequences of 64 prompt tokens, 128 new each: generation tok/s (llama-batched-bench's S_TG)."""
    proc = subprocess.run(
        [
            binary,
            "-m",
            str(path),
            "-t",
            str(threads),
            "-c",
            str(8 * 256),
            "-b",
            "512",
            "-npp",
            "64",
            "-ntg",
            "128",
            "-npl",
            "8",
            "-fa",
            "on",
        ],
        capture_output=True,
        text=True,
        env=BASE_ENV,
        timeout=3600,
    )
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\|\s+64\s+\|\s+128\s+\|\s+8\s+\|", line)]
    if not rows:
        return 0.0
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    return float(cells[7])  # S_TG t/s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_health(cmd: list[str], port: int, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < 600:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            if proc.poll() is not None:
                return float("nan")
            time.sleep(0.05)
        return float("nan")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # its engine (private runtime dir, no other client) then exits by itself


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", choices=["tiny", "135m", "1b", "7b"])
    parser.add_argument("--mix", nargs="+", default=["Q4_0", "Q4_K_M", "Q6_K", "Q8_0"])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "chatapp-synthetic-gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=0.5)
    parser.add_argument("--no-start", action="store_true", help="skip the start-to-/health figures")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    bench, ik = os.environ.get("LLAMA_BENCH"), os.environ.get("IK_LLAMA_BENCH")
    batched, server = os.environ.get("LLAMA_BATCHED_BENCH"), os.environ.get("LLAMA_SERVER")
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads, best of 5)\n")
    for mix in args.mix:
        path = write_file(args.dir, args.shape, mix)
        size = path.stat().st_size
        rows: dict[str, dict] = {"ours": ours(path, args.kv_gib)}
        if bench:
            rows["llama.cpp"] = llama_bench(bench, path, args.threads, [["-fa", "1"]])
            if batched:
                rows["llama.cpp"]["eight_tps"] = batched_bench(batched, path, args.threads)
        if ik:
            rows["ik_llama.cpp"] = llama_bench(
                ik, path, args.threads, [["-fa", "0", "-rtr", "1"], ["-fa", "1", "-rtr", "1"], ["-fa", "1"]]
            )
        if not args.no_start:
            port = free_port()
            env = {**os.environ, "CHATAPP_RUNTIME_DIR": tempfile.mkdtemp()}
            rows["ours"]["start_s"] = start_to_health(
                [sys.executable, "-m", "chatapp", "serve", "--model", str(path), "--port", str(port)], port, env
            )
            if server:
                port = free_port()
                rows.setdefault("llama.cpp", {})["start_s"] = start_to_health(
                    [server, "-m", str(path), "-t", str(args.threads), "--port", str(port), "-fa", "on"], port, BASE_ENV
                )
        print(f"## {path.name} ({size / 2**20:.0f} MiB)")
        print(json.dumps(rows, indent=1))
        base = {
            k: max(((r.get(k, 0.0) or 0.0) for name, r in rows.items() if name != "ours"), default=0.0)
            for k in ("decode_tps", "pp_tps", "eight_tps")
        }
        mine = rows["ours"]
        for key, label in (("decode_tps", "decode"), ("pp_tps", "prompt 512"), ("eight_tps", "8-way")):
            if mine.get(key) and base.get(key):
                print(f"  {label}: ours {mine[key]:.1f} tok/s vs {base[key]:.1f}: {mine[key] / base[key]:.2f}x")
        for name, r in rows.items():
            if r.get("decode_tps"):
                print(f"  {name} decode at {100 * size * r['decode_tps'] / bandwidth:.0f}% of the roofline")
        if mine.get("load_rss_bytes"):
            kv = args.kv_gib * 2**30
            print(
                f"  ours: load {mine['load_s']:.1f} s, peak RSS of loading {mine['load_rss_bytes'] / 2**20:.0f} MiB = "
                f"{(mine['load_rss_bytes'] - kv) / size:.2f}x the file + the {args.kv_gib} GiB KV cache"
            )
        print()
    shutil.rmtree(args.dir / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
