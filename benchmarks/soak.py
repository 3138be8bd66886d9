"""Soak test (issue 9): minutes of mixed load on `chatapp serve` with the bundled model.

Starts `chatapp serve` in its own process (with a private runtime dir, so it never attaches to
another engine), then runs virtual users until the time is up. Each user loops over random
requests: chat or text completion, a short question or a long document (1-3k tokens), streamed or
not, greedy or sampled, and some of them hang up mid-stream or give up before the answer.

Reported at the end:
- the engine process's memory (RSS, found by the engine pid from the engine's stats) after a
  warm-up and at the end, and the server process's, with the bound checked: the engine may grow by
  at most --max-growth (default 10%) from the post-warm-up sample to the end;
- p50/p99 time to first token of streamed answers, and p50/p99 of the gap between consecutive
  content chunks of a stream (a chunk carries what a stream generated in up to ~25 ms: the
  engine's stream buffer, chatapp/engine/stream_buffer.py; the first token always comes alone);
- counts of requests, hang-ups and errors. Any 5xx, error event or broken stream is a failure, as
  is an engine that is not idle (nothing running or queued, every KV block free) once the load stops.

Exit status 0 only if every check held.

    python benchmarks/soak.py                  # 10 minutes, 8 users
    python benchmarks/soak.py --minutes 3 --users 6 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import make_text  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Explain what a KV cache is.",
    "Write a haiku about rivers.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for bread.",
    "What does HTTP 503 mean?",
    "Summarise the plot of Hamlet.",
]


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    hang_ups: int = 0
    gave_up: int = 0
    completion_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def count(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1


def _request(rng: random.Random, n: int) -> tuple[str, dict[str, Any], str]:
    """(route, body, description) of one random request; ``n`` makes long prompts unique."""
    long = rng.random() < 0.25
    question = rng.choice(QUESTIONS)
    content = (
        (
            f"Read this document and answer the question after it.\n\n{make_text(rng.randint(700, 2200), n)}"
            f"\n\nQuestion: {question}"
        )
        if long
        else question
    )
    body: dict[str, Any] = {"max_tokens": rng.randint(16, 200)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=n)
    if rng.random() < 0.7:
        route, kind = "/v1/chat/completions", "chat"
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    else:
        route, kind = "/v1/completions", "completion"
        body["prompt"] = f"{content}\nAnswer:"
    return route, body, f"{kind}/{'long' if long else 'short'}"


def _content_of(event: dict[str, Any]) -> str:
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _streamed(
    http: httpx.AsyncClient, route: str, body: dict[str, Any], hang_up_after: int | None, tally: Tally
) -> None:
    sent = time.perf_counter()
    last = None
    chunks = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            tally.errors.append(f"{route} stream: HTTP {response.status_code}: {response.text[:200]}")
            return
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                tally.errors.append(f"{route} stream: error event: {event['error']}")
                return
            if event.get("usage"):
                tally.completion_tokens += event["usage"]["completion_tokens"]
            if _content_of(event):
                now = time.perf_counter()
                if last is None:
                    tally.ttft.append(now - sent)
                else:
                    tally.itl.append(now - last)
                last = now
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    tally.hang_ups += 1
                    return  # closes the connection mid-stream
        if not done:
            tally.errors.append(f"{route} stream: ended without [DONE]")


async def _whole(
    http: httpx.AsyncClient, route: str, body: dict[str, Any], patience: float | None, tally: Tally
) -> None:
    try:
        async with asyncio.timeout(patience):
            response = await http.post(route, json=body)
    except TimeoutError:
        tally.gave_up += 1  # the client gave up and closed the connection before the answer
        return
    if response.status_code != 200:
        tally.errors.append(f"{route}: HTTP {response.status_code}: {response.text[:200]}")
        return
    tally.completion_tokens += response.json()["usage"]["completion_tokens"]


async def _user(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    n = seed * 1_000_000
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while time.monotonic() < deadline:
            n += 1
            route, body, kind = _request(rng, n)
            stream = rng.random() < 0.75
            tally.count(f"{kind}/{'stream' if stream else 'whole'}")
            try:
                if stream:
                    hang_up = rng.randint(1, 20) if rng.random() < 0.15 else None
                    await _streamed(http, route, body, hang_up, tally)
                else:
                    patience = rng.uniform(0.2, 3.0) if rng.random() < 0.1 else None
                    await _whole(http, route, body, patience, tally)
            except httpx.HTTPError as exc:
                tally.errors.append(f"{route}: {type(exc).__name__}: {exc}")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


class Serve:
    """`chatapp serve --port 0` in its own process, with its own runtime dir."""

    def __init__(self, runtime: Path, model: str | None) -> None:
        env = {**os.environ, "CHATAPP_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}
        command = (
            [sys.executable, "-m", "chatapp.cli"] + (["--model", model] if model else []) + ["serve", "--port", "0"]
        )
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.runtime = runtime
        self.url = ""

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"chatapp serve exited: {self.proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            if match := re.search(r"at (http://\S+)/v1", line):
                self.url = match.group(1)
            if line.startswith("Ready:"):
                return
        raise RuntimeError("chatapp serve did not get ready in time")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _engine_stats(runtime: Path) -> dict[str, Any]:
    """The engine's own counters, from a client attached to it for a moment (not spawning one)."""
    from chatapp.engine import ipc
    from chatapp.engine.client import AsyncEngineClient

    if ipc.read_record(runtime) is None:
        raise RuntimeError("no engine is running in the soak's runtime dir")
    client = await AsyncEngineClient.connect(runtime_dir=runtime)
    try:
        return await client.stats()
    finally:
        await client.close()


async def _soak(args: argparse.Namespace, serve: Serve) -> dict[str, Any]:
    tally = Tally()
    stats = await _engine_stats(serve.runtime)
    engine_pid = stats.engine_pid
    start = time.monotonic()
    deadline = start + args.minutes * 60
    warm_up = min(args.warm_up, args.minutes * 60 / 3)
    samples: list[tuple[float, float, float]] = []  # (seconds, engine RSS MiB, server RSS MiB)

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - start, _rss_mib(engine_pid), _rss_mib(serve.proc.pid)))
            await asyncio.sleep(args.sample_every)

    sampler = asyncio.create_task(sample_memory())
    await asyncio.gather(*(_user(serve.url, args.seed + i, deadline, tally) for i in range(args.users)))
    sampler.cancel()
    samples.append((time.monotonic() - start, _rss_mib(engine_pid), _rss_mib(serve.proc.pid)))

    # Idle once the load stops (aborts of hung-up requests land within a step or two).
    for _ in range(100):
        stats = await _engine_stats(serve.runtime)
        if stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
            break
        await asyncio.sleep(0.1)
    idle = stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total

    after_warm_up = next(s for s in samples if s[0] >= warm_up) if samples[-1][0] >= warm_up else samples[0]
    growth = samples[-1][1] / after_warm_up[1] - 1
    return {
        "minutes": args.minutes,
        "users": args.users,
        "seed": args.seed,
        "model": stats.model,
        "engine_pid": engine_pid,
        "requests": tally.requests,
        "total_requests": sum(tally.requests.values()),
        "hang_ups": tally.hang_ups,
        "gave_up": tally.gave_up,
        "errors": tally.errors,
        "completion_tokens_received": tally.completion_tokens,
        "generation_tokens_total": stats.generation_tokens_total,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "ttft_s": {"n": len(tally.ttft), "p50": _percentile(tally.ttft, 0.5), "p99": _percentile(tally.ttft, 0.99)},
        "itl_s": {"n": len(tally.itl), "p50": _percentile(tally.itl, 0.5), "p99": _percentile(tally.itl, 0.99)},
        "engine_rss_mib": {
            "first": samples[0][1],
            "after_warm_up": after_warm_up[1],
            "warm_up_s": after_warm_up[0],
            "end": samples[-1][1],
            "max": max(s[1] for s in samples),
            "growth": growth,
            "bound": args.max_growth,
        },
        "server_rss_mib": {"first": samples[0][2], "after_warm_up": after_warm_up[2], "end": samples[-1][2]},
        "rss_samples": [[round(t, 1), round(e, 1), round(s, 1)] for t, e, s in samples],
        "idle_at_end": idle,
        "final_stats": stats,
    }


def _report(r: dict[str, Any]) -> None:
    mem, srv = r["engine_rss_mib"], r["server_rss_mib"]
    print(f"\nsoak: {r['minutes']} min, {r['users']} users, model {r['model']}, seed {r['seed']}")
    print(f"requests: {r['total_requests']} ({', '.join(f'{k} {v}' for k, v in sorted(r['requests'].items()))})")
    print(
        f"hang-ups mid-stream: {r['hang_ups']}, gave up before the answer: {r['gave_up']}, errors: {len(r['errors'])}"
    )
    print(
        f"tokens: {r['generation_tokens_total']} generated, {r['prompt_tokens_total']} prompt tokens computed, "
        f"{r['num_preemptions']} preemptions, prefix-cache hit rate {r['prefix_cache_hit_rate']:.2f}"
    )
    print(
        f"TTFT (streamed, n={r['ttft_s']['n']}): p50 {r['ttft_s']['p50'] * 1000:.0f} ms, "
        f"p99 {r['ttft_s']['p99'] * 1000:.0f} ms"
    )
    print(
        f"gap between streamed chunks (n={r['itl_s']['n']}): p50 {r['itl_s']['p50'] * 1000:.1f} ms, "
        f"p99 {r['itl_s']['p99'] * 1000:.1f} ms"
    )
    print(
        f"engine RSS: {mem['first']:.0f} MiB at start, {mem['after_warm_up']:.0f} MiB after "
        f"{mem['warm_up_s']:.0f} s warm-up, {mem['end']:.0f} MiB at the end (max {mem['max']:.0f}); "
        f"growth after warm-up {mem['growth'] * 100:+.1f}% (bound {mem['bound'] * 100:.0f}%)"
    )
    print(
        f"server RSS: {srv['first']:.0f} MiB at start, {srv['after_warm_up']:.0f} MiB after warm-up, "
        f"{srv['end']:.0f} MiB at the end"
    )
    print(f"engine idle at the end: {r['idle_at_end']}")
    for error in r["errors"][:10]:
        print(f"  error: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=8, help="concurrent virtual users")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument(
        "--warm-up", type=float, default=90.0, help="seconds before the memory baseline (at most a third of the run)"
    )
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed engine RSS growth after warm-up")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="chatapp-soak-") as tmp:
        runtime = Path(tmp) / "runtime"
        serve = Serve(runtime, args.model)
        try:
            serve.wait_ready()
            result = asyncio.run(_soak(args, serve))
        finally:
            code = serve.stop()
    result["serve_exit_code"] = code
    _report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    checks = {
        "no errors": not result["errors"],
        "engine idle at the end": result["idle_at_end"],
        f"engine RSS growth after warm-up < {args.max_growth:.0%}": result["engine_rss_mib"]["growth"]
        < args.max_growth,
        "chatapp serve exited cleanly": code == 0,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
