"""Memory and start-up against llama-server, same file and context, one run.

For each server, one at a time (never two competing for the cores):
- warm start: launch to the first 200 from /health, best of ``--repeat`` launches (everything
  already cached: the page cache holds the file, our kernels are built, the tokenizer cached);
- first start (ours only): the same with a fresh, empty cache directory (CHATAPP_CACHE_DIR), as on
  a new machine after `pip install` (the C++ kernels are built at install, not here): best of
  ``--repeat`` launches, each on a cache directory of its own, the statistic the baselines' starts
  get (llama-server keeps no cache, so each of its starts is a first start); medians are printed too;
- the TUI: launch to its first screen, mounted and taking keys (headless, a fresh process; the
  engine loads behind it, so this is what a user waits for before typing);
- first answer: launch to the first streamed token of a chat request sent the moment /health answered, on
  our first starts and the baselines' starts (median): what a client that connects at once waits for. Why
  beside the start: our engine answers /health before its weights' tiles are packed (weight_packer.py), so a
  request that comes at once waits for the rest of the packing;
- memory: after the start and one short chat completion, the RSS of the server's whole process
  tree (ours: `chatapp serve` and the engine process it started; the engine's RSS alone too),
  summed as the kernel reports it per process (shared pages count in each: the figure is not
  flattering to us).

    LLAMA_SERVER=.../llama-server python benchmarks/footprint.py [FILE.gguf] --ctx 8192

Without a file: the bundled model. IK_LLAMA_SERVER adds ik_llama.cpp's server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status


def _chat(port: int) -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def _first_token(port: int) -> None:
    """Return once a streamed chat completion's first content arrives."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0, "stream": True}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                return


def _tree_rss(proc: psutil.Process) -> tuple[int, dict[str, int]]:
    parts = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[1:3]) or p.name()
            parts[f"{p.pid} {name}"] = p.memory_info().rss
        except psutil.Error:
            pass
    return sum(parts.values()), parts


def run_server(
    cmd: list[str], port: int, env: dict[str, str], measure: bool, cwd: str | None = None, first_answer: bool = False
) -> dict:
    """Start, wait for /health, optionally time a first answer (first_answer_s, from launch), chat once and read
    the tree's RSS, then stop."""
    start = time.perf_counter()
    popen = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict = {}
    try:
        while True:
            if time.perf_counter() - start > 600 or popen.poll() is not None:
                return {"start_s": float("nan")}
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.02)
        out["start_s"] = time.perf_counter() - start
        if first_answer:
            try:
                _first_token(port)
                out["first_answer_s"] = time.perf_counter() - start
            except (OSError, ValueError, KeyError) as exc:  # see the chat below
                out["first_answer_s"] = float("nan")
                print(f"  (the first answer failed: {exc})", flush=True)
        if measure:
            loaded = _tree_rss(psutil.Process(popen.pid))  # kept in case the chat ends the server
            try:
                _chat(port)
            except OSError as exc:  # ik_llama.cpp's server aborts on a random-weight model's invalid UTF-8
                out["chat_error"] = str(exc)
                print(f"  (the chat failed: {exc}; RSS is read without it)", flush=True)
            time.sleep(0.5)
            out["rss_bytes"], out["rss_parts"] = _tree_rss(psutil.Process(popen.pid))
            if not out["rss_bytes"]:
                print("  (the server exited after the chat: RSS as it stood once loaded)", flush=True)
                out["rss_bytes"], out["rss_parts"] = loaded
        return out
    finally:
        try:
            children = psutil.Process(popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        popen.terminate()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            popen.kill()
        psutil.wait_procs(children, timeout=30)


_TUI_CHILD = """
import asyncio, os, sys, tempfile, time
from pathlib import Path
from chatapp.tui.app import ChatApp
async def main():
    d = Path(tempfile.mkdtemp())
    app = ChatApp(settings_path=d / "s.toml", history_path=d / "h.db")
    async with app.run_test() as pilot:
        await pilot.press("h", "i")  # typing works
        print("mounted", time.time(), flush=True)
        while app.engine.state != "ready":  # then what the TUI holds once its engine is up
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
        print("rss", rss, flush=True)
        os._exit(0)  # the engine it started is stopped by the caller
asyncio.run(main())
"""


TUI_RSS: list[int] = []  # the TUI process's RSS with its engine ready, per launch


def tui_first_screen(env: dict[str, str]) -> float:
    runtime = tempfile.mkdtemp()  # its own engine, stopped below (never left loading beside a baseline)
    start = time.time()  # wall clock: the child reports when its screen took keys
    out = subprocess.run(
        [sys.executable, "-c", _TUI_CHILD],
        env={**env, "CHATAPP_RUNTIME_DIR": runtime},
        capture_output=True,
        text=True,
        timeout=300,
    )
    mounted = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("mounted ")]
    seconds = mounted[0] - start if mounted else float("nan")
    rss = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("rss ")]
    TUI_RSS.extend(rss)
    engines = [p for p in psutil.process_iter(["cmdline"]) if runtime in " ".join(p.info["cmdline"] or [])]
    for engine in engines:
        engine.terminate()
    psutil.wait_procs(engines, timeout=30)
    return seconds


def measure(
    name: str, make_cmd, env: dict[str, str], repeat: int, cwd: str | None = None, first_answer: bool = False
) -> dict:
    runs = [
        run_server(make_cmd(port := free_port()), port, env, measure=(i == 0), cwd=cwd, first_answer=first_answer)
        for i in range(repeat)
    ]
    starts = [r["start_s"] for r in runs]
    best = min(starts)
    row = {
        "warm_start_s": best,
        "warm_start_median_s": statistics.median(starts),
        "first_answer_median_s": statistics.median(r.get("first_answer_s", float("nan")) for r in runs),
        "rss_bytes": runs[0].get("rss_bytes"),
        "rss_parts": runs[0].get("rss_parts"),
    }
    print(
        f"{name}: warm start {best:.2f} s (best of {repeat}, median {row['warm_start_median_s']:.2f} s), "
        "RSS after one chat "
        f"{(row['rss_bytes'] or 0) / 2**20:.0f} MiB {row['rss_parts']}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="a GGUF file (default: the bundled model)")
    parser.add_argument("--ctx", type=int, default=8192, help="context length given to every server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.file is None:
        from chatapp.store import bundled_gguf_path

        args.file = str(bundled_gguf_path())
    rows: dict[str, dict] = {}
    env = {**os.environ, "CHATAPP_RUNTIME_DIR": tempfile.mkdtemp()}
    # Python writes its bytecode files on a user's machine (pip compiles them at install, or the first
    # run does); a sandbox's PYTHONDONTWRITEBYTECODE would have every start compile our modules again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    def ours(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "chatapp",
            "serve",
            "--model",
            args.file,
            "--port",
            str(port),
            "--max-model-len",
            str(args.ctx),
        ]

    # A first run warms the page cache and our caches; it is not counted.
    run_server(ours(port := free_port()), port, env, measure=False)
    rows["ours"] = measure("ours", ours, env, args.repeat)
    firsts = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            cache_env = {**env, "CHATAPP_CACHE_DIR": cache}
            firsts.append(run_server(ours(port := free_port()), port, cache_env, False, first_answer=True))
    first_starts = [r["start_s"] for r in firsts]
    rows["ours"]["first_start_s"] = min(first_starts)
    rows["ours"]["first_start_median_s"] = statistics.median(first_starts)
    rows["ours"]["first_answer_median_s"] = statistics.median(r["first_answer_s"] for r in firsts)
    rows["ours"]["tui_first_screen_s"] = min(tui_first_screen(env) for _ in range(args.repeat))
    rows["ours"]["tui_rss_bytes"] = min(TUI_RSS) if TUI_RSS else None
    print(
        f"ours: the TUI's first screen, taking keys, {rows['ours']['tui_first_screen_s']:.2f} s after launch "
        f"(best of {args.repeat}); the TUI process holds {(min(TUI_RSS) if TUI_RSS else 0) / 2**20:.0f} MiB "
        "once its engine is ready",
        flush=True,
    )
    print(
        f"ours: first start on an empty cache directory {rows['ours']['first_start_s']:.2f} s (best of "
        f"{args.repeat}, median {rows['ours']['first_start_median_s']:.2f} s: "
        f"{', '.join(f'{t:.2f}' for t in first_starts)})",
        flush=True,
    )
    for name, var in (("llama.cpp", "LLAMA_SERVER"), ("ik_llama.cpp", "IK_LLAMA_SERVER")):
        if binary := os.environ.get(var):
            rows[name] = measure(
                name,
                lambda port, b=binary: [
                    b,
                    "-m",
                    args.file,
                    "-c",
                    str(args.ctx),
                    "-t",
                    str(args.threads),
                    "--port",
                    str(port),
                    "-fa",
                    "on",
                ],
                dict(os.environ),
                args.repeat,
                cwd=tempfile.gettempdir(),  # ik_llama.cpp's server writes llama.log where it runs
                first_answer=True,
            )
    # The fastest start among every baseline that started; the leanest among those whose RSS was read (a
    # server whose chat aborted, as ik_llama.cpp's on random weights, has a start but no RSS).
    started = [r for n, r in rows.items() if n != "ours" and not math.isnan(r["warm_start_s"])]
    base = [r for r in started if r.get("rss_bytes")]
    if base:
        lean = min(base, key=lambda r: r["rss_bytes"])
        fast = min(started, key=lambda r: r["warm_start_s"])
        mine = rows["ours"]
        print(
            f"\nRSS ours / leanest baseline: {mine['rss_bytes'] / lean['rss_bytes']:.2f}x; "
            f"warm start ours / fastest baseline: {mine['warm_start_s'] / fast['warm_start_s']:.1f}x "
            f"({mine['warm_start_s']:.2f} s vs {fast['warm_start_s']:.2f} s); "
            f"first start / warm start: {mine['first_start_s'] / mine['warm_start_s']:.2f}x"
        )
        print(
            f"first start ours / fastest baseline: {mine['first_start_s'] / fast['warm_start_s']:.2f}x best of "
            f"{args.repeat} each ({mine['first_start_s']:.2f} s vs {fast['warm_start_s']:.2f} s), "
            f"{mine['first_start_median_s'] / fast['warm_start_median_s']:.2f}x median "
            f"({mine['first_start_median_s']:.2f} s vs {fast['warm_start_median_s']:.2f} s)"
        )
        answered = [r for r in started if not math.isnan(r["first_answer_median_s"])]
        if answered:
            quick = min(answered, key=lambda r: r["first_answer_median_s"])
            print(
                f"first answer (launch to the first token of a request sent at /health), ours on a first start / "
                f"fastest baseline: {mine['first_answer_median_s'] / quick['first_answer_median_s']:.2f}x median "
                f"({mine['first_answer_median_s']:.2f} s vs {quick['first_answer_median_s']:.2f} s)"
            )


if __name__ == "__main__":
    main()
