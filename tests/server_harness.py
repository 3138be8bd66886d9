"""A real engine and the real HTTP server, running in a background thread's event loop.

Tests then talk to the server over TCP from the main thread with real clients
(the openai SDK, httpx), exactly as an editor would from another process.
Each module makes one ``ServedEngine`` (one engine process, in a private
runtime dir so modules with different models never share an engine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from chatapp.engine.api import EngineStats
from chatapp.engine.client import AsyncEngineClient
from chatapp.engine.config import EngineConfig
from chatapp.server import ServerHandle, start_server

T = TypeVar("T")


class ServedEngine:
    def __init__(self, runtime_dir: Path, engine: dict[str, Any], **server_kwargs: Any) -> None:
        self.runtime_dir = runtime_dir
        self.engine = engine
        self.server_kwargs = server_kwargs
        self.loop = asyncio.new_event_loop()
        self.client: AsyncEngineClient
        self.handle: ServerHandle
        self._thread = threading.Thread(target=self.loop.run_forever, name="served-engine", daemon=True)

    def __enter__(self) -> ServedEngine:
        self._thread.start()
        self.run(self._start, timeout=300)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._stop, timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    async def _start(self) -> None:
        self.client = AsyncEngineClient(EngineConfig(**self.engine), runtime_dir=self.runtime_dir)
        await self.client.start()
        self.handle = await start_server(self.client, "127.0.0.1", 0, **self.server_kwargs)

    async def _stop(self) -> None:
        await self.handle.stop()
        await self.client.close()

    @property
    def url(self) -> str:
        return self.handle.url

    def submit(self, make: Callable[[], Awaitable[T]]) -> Future[T]:
        """Run a coroutine in the server's loop (the client may only be used there)."""

        async def call() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.loop)

    def run(self, make: Callable[[], Awaitable[T]], timeout: float = 60) -> T:
        return self.submit(make).result(timeout)

    def stats(self) -> EngineStats:
        return self.run(self.client.stats)

    def wait_until(self, check: Callable[[EngineStats], bool], timeout: float = 10) -> EngineStats:
        """Poll the engine's stats until ``check`` holds; returns the last stats (the caller asserts)."""
        deadline = time.monotonic() + timeout
        stats = self.stats()
        while not check(stats) and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = self.stats()
        return stats


def idle(stats: EngineStats) -> bool:
    """Nothing running or queued, and every KV block free (cached prefixes count as free)."""
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
