"""The app's handle on the shared local engine: starting it, watching it, restarting it.

Panes never start the engine themselves; they ask :meth:`LocalEngine.client`,
which waits until it is ready. The status bar reads :meth:`LocalEngine.snapshot`
once a second. The engine client may expose a ``state`` (starting, loading,
ready, dead, closed) with a ``state_detail`` line (the loading progress), a
``load_progress`` (0..1) and ``start()``/``restart()``, as AsyncEngineClient
does; all are read if present, so any
:class:`~chatapp.engine.api.EngineClient` works here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from chatapp.engine.api import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineState,
    EngineStats,
    loaded_model_info,
)

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[EngineClient]]

STATS_TIMEOUT_S = 5.0
"""How long a status poll waits for the engine's counters; past it the bar shows none this time (an
engine in a long step answers late, and a poll must never hang whoever awaits it)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the status bar shows about the engine; None: not known (yet)."""

    state: str
    """"starting", "loading", "ready", "busy", "dead" or "off"."""
    model: str | None = None
    device: str | None = None
    progress: float | None = None
    kv_used: float | None = None
    """Share of the KV cache blocks in use, 0..1."""
    prefix_hit_rate: float | None = None
    running: int = 0
    detail: str | None = None
    """Why it is dead, or what it is doing while starting or loading."""


def _state_name(value: Any) -> str | None:
    if value is None:
        return None
    value = getattr(value, "value", value)
    return str(value).lower()


class LocalEngine:
    """Owns the one local engine client of the app (created by ``factory``)."""

    def __init__(self, factory: EngineFactory | None) -> None:
        self._factory = factory
        self._client: EngineClient | None = None
        self._ready = asyncio.Event()
        self._state = "off" if factory is None else "starting"
        self._error: str | None = None
        self._last = EngineSnapshot(self._state)

    @property
    def state(self) -> str:
        return self._state

    @property
    def raw_client(self) -> EngineClient | None:
        """The client, ready or not (the API server shares it)."""
        return self._client

    async def start(self) -> None:
        """Create the client; failures leave the engine "dead" with the reason."""
        if self._factory is None:
            return
        self._state = "starting"
        try:
            self._client = await self._factory()
            ready = _state_name(getattr(self._client, "state", EngineState.READY)) == EngineState.READY
            if not ready and hasattr(self._client, "start"):
                # Kept before starting, so the status bar can show "loading" and its progress line.
                await self._client.start()
        except (EngineError, OSError, ValueError, RuntimeError) as exc:
            log.exception("engine start failed")
            self._fail(str(exc) or type(exc).__name__)
            return
        self._state = "ready"
        self._error = None
        self._ready.set()

    def _fail(self, reason: str) -> None:
        self._state = "dead"
        self._error = reason
        self._ready.set()  # wake waiters: they see "dead" and give up

    async def client(self) -> EngineClient:
        """The client once ready; EngineDeadError if the engine is dead or not available."""
        if self._factory is None:
            raise EngineDeadError("there is no local engine in this app")
        await self._ready.wait()
        if self._state == "dead" or self._client is None:
            raise EngineDeadError(
                f"the engine is not running ({self._error or 'dead'}); restart it (see the status bar)"
            )
        return self._client

    def mark_dead(self, reason: str) -> None:
        """A pane's stream saw the engine die (EngineDeadError)."""
        self._fail(reason)

    async def restart(self) -> None:
        """Restart with the client's own ``restart()``, or by creating a new client."""
        client = self._client
        self._ready.clear()
        self._state = "starting"
        if client is not None and hasattr(client, "restart"):
            try:
                await client.restart()
            except (EngineError, OSError, RuntimeError) as exc:
                self._fail(f"restart failed: {exc}")
                return
            self._state, self._error = "ready", None
            self._ready.set()
            return
        await self.start()

    async def switch_model(self, model: str | None) -> str:
        """Load another model in the shared engine; returns its name."""
        client = await self.client()
        self._state = "loading"
        try:
            info = await client.switch_model(model)
        except EngineDeadError as exc:
            self._fail(str(exc))
            raise
        finally:
            if self._state == "loading":
                self._state = "ready"
        return info.name

    async def snapshot(self) -> EngineSnapshot:
        """Poll the client's state and counters (cheap; called once a second)."""
        client = self._client
        if client is None:
            self._last = EngineSnapshot(self._state, detail=self._error)
            return self._last
        reported = _state_name(getattr(client, "state", None))
        if reported == "dead" and self._state != "dead":
            self._fail("the engine process died")
        elif reported in ("starting", "loading") and self._state not in ("dead",):
            self._state = reported
        elif reported == "ready" and self._state in ("starting", "loading", "dead"):
            # From "dead" too: another user of this client (the API port's server) restarted it.
            self._state, self._error = "ready", None
            self._ready.set()
        info = loaded_model_info(client)
        model = info.name if info is not None else None
        device = info.device if info is not None else None
        progress = getattr(client, "load_progress", None)
        detail = getattr(client, "state_detail", None) or None
        if self._state == "dead":
            self._last = EngineSnapshot("dead", model, device, detail=self._error)
            return self._last
        stats: EngineStats | None = None
        try:
            if self._state == "ready":
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that arrives as the
                # call ends, and the app's status timer, stopped at quit, then ran on and the app never exited.
                async with asyncio.timeout(STATS_TIMEOUT_S):
                    stats = await client.stats()
        except TimeoutError:
            stats = None
        except EngineDeadError as exc:
            self._fail(str(exc) or "the engine process died")
            self._last = EngineSnapshot("dead", model, device, detail=self._error)
            return self._last
        except EngineError:
            pass
        total = stats.kv_blocks_total if stats else 0
        used = stats.kv_blocks_used if stats else None
        running = stats.num_running if stats else 0
        state = "busy" if self._state == "ready" and running else self._state
        loading = state in ("starting", "loading")
        self._last = EngineSnapshot(
            state,
            model,
            device,
            progress if loading else None,
            (used / total) if total and used is not None else None,
            stats.prefix_cache_hit_rate if stats else None,
            running,
            detail if loading else None,
        )
        return self._last

    @property
    def last(self) -> EngineSnapshot:
        return self._last

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.close()
            except (EngineError, OSError, RuntimeError):
                log.exception("closing the engine client")
