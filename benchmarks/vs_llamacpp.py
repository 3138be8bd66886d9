"""Our engine against llama.cpp on the same GGUF, same prompts, one machine, one run.

Both are driven through their OpenAI-compatible HTTP servers by the same client
code, one server at a time (so they never compete for the cores):

- single-stream decode tokens/s (128 tokens after a short prompt);
- prompt processing tokens/s (a ~512-token prompt, one new token);
- 16 concurrent chats (~200-token prompts, 128 new tokens each): total tokens/s and mean TTFT;
- a follow-up turn on a ~2,000-token conversation: its TTFT, with each side's prompt cache;
- our engine's overhead at 16-way decode: busy-loop time outside the model forward.

Each figure is printed with the ratio ours / llama.cpp (TTFT: llama.cpp / ours).
llama.cpp runs only when LLAMA_SERVER points to a llama-server binary (see
benchmarks/README.md for how to build one); without it only our figures print.

    LLAMA_SERVER=/path/to/llama-server python benchmarks/vs_llamacpp.py [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

# llama.cpp must run with its own defaults: importing chatapp sets OMP_WAIT_POLICY=PASSIVE in this
# process's environment, and llama-server (built with OpenMP) inherited it and decoded 3x slower.
LLAMA_ENV = dict(os.environ)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import make_text  # noqa: E402

NEW_TOKENS = 128
CONCURRENT = 16
# A fresh connection per request: reusing a pooled keep-alive connection raced with llama-server
# closing it ("Server disconnected without sending a response"). It costs both sides the same.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


@dataclass
class Server:
    name: str
    url: str
    model: str
    stats_fn: object = None  # our engine's stats over HTTP (None for llama.cpp)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def warm_up(url: str, attempts: int = 5) -> None:
    """One small completion, retried: a server can report healthy a moment before it serves."""
    for attempt in range(attempts):
        try:
            httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).raise_for_status()
            return
        except httpx.HTTPError:
            if attempt == attempts - 1:
                raise
            time.sleep(1)


@contextmanager
def run_server(cmd: list[str], url: str, env: dict[str, str] | None = None):
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, proc)
        warm_up(url)
        yield
    except Exception:
        log.seek(0)
        print(log.read()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def sse_chunks(resp: httpx.Response):
    """The JSON chunks of a server-sent-events response, up to [DONE]."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def stream_completion(
    client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int, ignore_eos: bool = True
) -> tuple[float, list[float], int]:
    """(start, arrival time of each streamed token chunk, completion tokens) of one streamed completion."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    completion_tokens = 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return start, arrivals, completion_tokens or len(arrivals)


async def chat_ttft(
    client: httpx.AsyncClient, server: Server, messages: list[dict], max_tokens: int
) -> tuple[float, str]:
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    text = ""
    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            if chunk.get("choices"):
                piece = chunk["choices"][0].get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
    return (first or time.perf_counter()) - start, text


async def measure_decode(server: Server, runs: int = 3) -> float:
    rates = []
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        for i in range(runs):
            _, arrivals, n = await stream_completion(client, server, f"Story number {i}: Once upon a time", NEW_TOKENS)
            rates.append((n - 1) / (arrivals[-1] - arrivals[0]))
    return statistics.median(rates)


async def measure_prompt(server: Server, tokens: int = 512, runs: int = 3) -> float:
    rates = []
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        for i in range(runs):
            prompt = make_text(int(tokens * 0.75), seed=9000 + i)  # ~0.75 words a token; distinct: no cache
            body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            resp = await client.post(f"{server.url}/v1/completions", json=body, timeout=600)
            seconds = time.perf_counter() - start
            resp.raise_for_status()
            rates.append(resp.json()["usage"]["prompt_tokens"] / seconds)
    return statistics.median(rates)


async def measure_concurrent(server: Server) -> tuple[float, float, dict | None]:
    prompts = [make_text(150, seed=500 + i) for i in range(CONCURRENT)]  # ~200 tokens each
    before = await server.stats_fn() if server.stats_fn else None
    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=CONCURRENT * 2, max_keepalive_connections=0)
    ) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, server, p, NEW_TOKENS) for p in prompts))
        wall = time.perf_counter() - start
    after = await server.stats_fn() if server.stats_fn else None
    total = sum(n for _, _, n in results) / wall
    ttft = statistics.mean(arrivals[0] - s for s, arrivals, _ in results)
    overhead = None
    if before and after:
        loop = after["busy_loop_seconds_total"] - before["busy_loop_seconds_total"]
        forward = after["forward_seconds_total"] - before["forward_seconds_total"]
        step = after["step_seconds_total"] - before["step_seconds_total"]
        overhead = {"outside_forward": 1 - forward / loop, "outside_step": 1 - step / loop}
    return total, ttft, overhead


async def measure_follow_up(server: Server) -> float:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(11):  # ~2,000 tokens of history
        messages.append({"role": "user", "content": f"Question {turn}: " + make_text(60, seed=300 + turn)})
        messages.append({"role": "assistant", "content": make_text(90, seed=700 + turn)})
    messages.append({"role": "user", "content": "Please summarise what we discussed."})
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        _, answer = await chat_ttft(client, server, messages, 32)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks. One line?"}]
        ttft, _ = await chat_ttft(client, server, messages, 8)
    return ttft


def measure(server: Server, with_concurrency: bool) -> dict:
    out = {
        "decode": asyncio.run(measure_decode(server)),
        "prompt": asyncio.run(measure_prompt(server)),
        "follow_up_ttft": asyncio.run(measure_follow_up(server)),
    }
    if with_concurrency:
        out["concurrent"], out["concurrent_ttft"], out["overhead"] = asyncio.run(measure_concurrent(server))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8790)
    args = parser.parse_args()

    from chatapp.store import BUNDLED_NAME, bundled_gguf_path

    gguf = bundled_gguf_path()
    results: dict[str, dict] = {}

    ours_url = f"http://127.0.0.1:{args.port}"
    env = dict(os.environ, CHATAPP_RUNTIME_DIR=tempfile.mkdtemp(prefix="chatapp-bench-"))
    with run_server([sys.executable, "-m", "chatapp", "serve", "--port", str(args.port)], ours_url, env):

        async def our_stats() -> dict:
            async with httpx.AsyncClient() as c:
                text = (await c.get(f"{ours_url}/metrics")).text
            values = {}
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    values[name.split("{")[0]] = float(value)
            return {
                "busy_loop_seconds_total": values["chatapp_busy_loop_seconds_total"],
                "forward_seconds_total": values["chatapp_forward_seconds_total"],
                "step_seconds_total": values["chatapp_step_seconds_total"],
            }

        results["ours"] = measure(Server("ours", ours_url, BUNDLED_NAME, our_stats), True)

    llama = os.environ.get("LLAMA_SERVER")
    if llama:
        url = f"http://127.0.0.1:{args.port + 1}"
        base = [llama, "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads), "--port", str(args.port + 1)]
        with run_server(base + ["-c", "4096", "-np", "1"], url, LLAMA_ENV):  # one slot keeps the conversation cached
            results["llama.cpp"] = measure(Server("llama.cpp", url, BUNDLED_NAME), False)
        with run_server(base + ["-c", str(CONCURRENT * 512), "-np", str(CONCURRENT)], url, LLAMA_ENV):
            total, ttft, _ = asyncio.run(measure_concurrent(Server("llama.cpp", url, BUNDLED_NAME)))
            results["llama.cpp"].update(concurrent=total, concurrent_ttft=ttft)

    ours = results["ours"]
    theirs = results.get("llama.cpp")

    def row(label: str, key: str, unit: str, higher_is_better: bool = True, goal: str = "") -> None:
        line = f"{label:44s} ours {ours[key]:8.1f} {unit}"
        if theirs:
            ratio = ours[key] / theirs[key] if higher_is_better else theirs[key] / ours[key]
            line += f" | llama.cpp {theirs[key]:8.1f} {unit} | ratio {ratio:5.2f}x {goal}"
        print(line)

    print(f"model {BUNDLED_NAME} ({gguf.name}), {args.threads} threads for llama.cpp")
    row("single-stream decode", "decode", "tok/s", goal="(goal >= 1.2x)")
    row("prompt processing (~512 tokens)", "prompt", "tok/s", goal="(goal >= 3x)")
    row(f"{CONCURRENT} concurrent chats, total", "concurrent", "tok/s", goal="(goal >= 2x)")
    for key in ("concurrent_ttft", "follow_up_ttft"):
        ours[key] *= 1000
        if theirs:
            theirs[key] *= 1000
    row(f"{CONCURRENT} concurrent chats, mean TTFT", "concurrent_ttft", "ms", False, "(goal: ours <= 0.5x theirs)")
    row("follow-up TTFT, ~2,000-token conversation", "follow_up_ttft", "ms", False, "(goal: ours <= 0.5x theirs)")
    if ours.get("overhead"):
        print(
            f"engine overhead at {CONCURRENT}-way decode: {ours['overhead']['outside_forward']:.1%} of busy time "
            f"outside the model forward ({ours['overhead']['outside_step']:.1%} outside core.step: IPC and "
            f"housekeeping) (goal < 10%)"
        )


if __name__ == "__main__":
    main()
