"""A second client PROCESS for tests/test_engine_process.py (run as a script, reads a JSON job on argv).

Modes:
  generate: attach, wait for "go" on stdin, run the prompts concurrently, print one JSON line of results.
  stream:   attach, start long requests, print "streaming" once tokens flow, then keep reading forever
            (the test kills or stops this process).
  exit:     attach (spawning the engine if there is none), wait for a line on stdin, then return
            without closing the client: the interpreter exits normally, exit handlers and all.
"""

from __future__ import annotations

import asyncio
import json
import sys

from chatapp.engine.client import AsyncEngineClient
from chatapp.engine.config import EngineConfig
from chatapp.engine.sampling_params import SamplingParams


async def _collect(client: AsyncEngineClient, prompt: str, max_tokens: int) -> dict:
    text, ids, reason = "", [], None
    async for delta in client.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        text += delta.text
        ids += delta.token_ids
        reason = delta.finish_reason
    return {"text": text, "token_ids": ids, "finish_reason": reason}


async def _stream_forever(client: AsyncEngineClient, started: asyncio.Event) -> None:
    async for _ in client.generate(
        "Tell me everything", SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    ):
        started.set()


async def main(job: dict) -> None:
    client = await AsyncEngineClient.connect(EngineConfig(**job["config"]))
    print(json.dumps({"attached": client.engine_pid, "spawned": client.spawned_engine}), flush=True)
    if job["mode"] == "exit":
        await asyncio.to_thread(sys.stdin.readline)
        return
    if job["mode"] == "generate":
        await asyncio.to_thread(sys.stdin.readline)
        results = await asyncio.gather(*(_collect(client, p, job["max_tokens"]) for p in job["prompts"]))
        print(json.dumps({"results": results}), flush=True)
        await client.close()
    else:
        events = [asyncio.Event() for _ in range(job["num_requests"])]
        tasks = [asyncio.create_task(_stream_forever(client, e)) for e in events]
        for event in events:
            await event.wait()
        print(json.dumps({"streaming": len(tasks)}), flush=True)
        await asyncio.gather(*tasks)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
