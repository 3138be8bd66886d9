"""What the routes share: the engine client (if any yet), its health, and model naming.

The server may start before its engine is ready (``chatapp serve`` listens
while the model loads) and outlive an engine that died (the client restarts
it), so every route asks this object for the client instead of holding one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from chatapp.engine.api import (
    EngineClient,
    EngineDeadError,
    EngineState,
    ModelInfo,
    ModelStatus,
    loaded_model_info,
)
from chatapp.server.errors import APIError, from_engine_error, unavailable
from chatapp.server.middleware import RequestCounts

log = logging.getLogger(__name__)

CATALOG_TTL_S = 5.0
"""The local model store is listed at most this often (listing scans the Hugging Face cache)."""


@dataclass(frozen=True)
class LocalModelId:
    """A model this port can serve: the readable id clients name it by, and the spec the engine loads."""

    id: str
    spec: str
    created: int | None = None


Catalog = Callable[[], list[LocalModelId]]


def local_catalog() -> list[LocalModelId]:
    """Every runnable model in the local store, by a readable id (never a file path)."""
    from chatapp import store

    entries: list[LocalModelId] = []
    taken: set[str] = set()
    for model in store.list_models():
        if model.size_bytes is None or not model.facts.supported:
            continue
        name = model.name
        if model.source in ("gguf", "directory"):  # registered paths: named by the file or folder
            name = model.path.stem if model.path.is_file() else model.path.name
        unique, n = name, 2
        while unique.lower() in taken:
            unique, n = f"{name}-{n}", n + 1
        taken.add(unique.lower())
        try:
            created = int(model.path.stat().st_mtime)
        except OSError:
            created = None
        entries.append(LocalModelId(unique, str(model.path), created))
    return entries


class ServerState:
    def __init__(self, client: EngineClient | None = None, catalog: Catalog | None = local_catalog) -> None:
        self.client = client
        self.started = int(time.time())
        self._restart: asyncio.Task[None] | None = None
        self._catalog = catalog
        self._catalog_cache: tuple[float, list[LocalModelId]] | None = None
        self.requests = RequestCounts()  # the API's requests, running and in all (middleware.py counts)

    # -- engine status ------------------------------------------------------

    def attach(self, client: EngineClient) -> None:
        """Serve from ``client`` from now on (the CLI attaches it once the model has loaded)."""
        self.client = client

    @property
    def phase(self) -> str:
        """ "ready", "loading", "restarting", "dead" or "closed".

        A client may report its own ``state`` (AsyncEngineClient does:
        starting, loading, ready, dead, closed); the protocol does not require one.
        """
        if self.client is None:
            return "loading"
        if self._restart is not None and not self._restart.done():
            return "restarting"
        client_state = getattr(self.client, "state", EngineState.READY)
        if not isinstance(client_state, str) or client_state == EngineState.READY:
            return "ready" if loaded_model_info(self.client) is not None else "loading"
        return "loading" if client_state == EngineState.STARTING else str(client_state)

    def engine(self) -> EngineClient:
        """The client to use now, or a 503 with Retry-After while there is none ready."""
        phase = self.phase
        if phase == "dead":
            self.engine_died()
            phase = self.phase
        if phase != "ready" or self.client is None:
            raise unavailable(f"the engine is {phase}; retry shortly")
        return self.client

    def error(self, exc: BaseException, prompt_param: str) -> APIError:
        """Map an engine exception to its answer; a dead engine also gets restarted."""
        if isinstance(exc, EngineDeadError):
            self.engine_died()
        return from_engine_error(exc, prompt_param)

    def engine_died(self) -> None:
        """Start the client's restart (once) if it offers one, so the server recovers by itself."""
        restart = getattr(self.client, "restart", None)
        if restart is None or (self._restart is not None and not self._restart.done()):
            return
        log.warning("the engine died; restarting it")
        self._restart = asyncio.get_running_loop().create_task(self._run_restart(restart))

    async def _run_restart(self, restart) -> None:  # noqa: ANN001  (the client's own coroutine function)
        try:
            await restart()
            log.warning("the engine is back")
        except Exception:
            log.exception("restarting the engine failed; requests get 503 until it is back")

    # -- model naming -------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        return loaded_model_info(self.client)

    def model_id(self) -> str:
        info = self.model_info
        return info.name if info is not None else "loading"

    def catalog(self) -> list[LocalModelId]:
        """The local models this port can load by name (cached for a few seconds)."""
        if self._catalog is None:
            return []
        now = time.monotonic()
        if self._catalog_cache is None or now - self._catalog_cache[0] > CATALOG_TTL_S:
            try:
                entries = self._catalog()
            except Exception:  # noqa: BLE001  a broken store must not break the loaded models' answers
                log.exception("listing the local models failed")
                entries = []
            self._catalog_cache = (now, entries)
        return self._catalog_cache[1]

    async def engine_models(self) -> list[ModelStatus]:
        """What the engine holds (an engine client without several models: nothing beside the default)."""
        models = getattr(self.client, "models", None)
        if models is None or self.phase != "ready":
            return []
        try:
            statuses: list[ModelStatus] = await models()
        except Exception:  # noqa: BLE001  /v1/models still lists the default model
            log.exception("asking the engine for its models failed")
            return []
        return statuses

    async def engine_for(self, requested: str | None) -> tuple[EngineClient, str]:
        """The client to run a request naming ``requested`` on, and the model id to answer with.

        The default model answers requests that name none (or name it); any other local model is
        loaded on demand (the request waits for it) beside the default one. 404 for an unknown id.
        """
        client = self.engine()
        info = self.model_info
        assert info is not None  # engine() returned: the client is ready
        if not requested or self._is_default(requested, info):
            return client, info.name
        bind = getattr(client, "bind", None)
        spec, model_id = await self._find(requested)
        if bind is None:
            raise self._not_found(requested, info)
        view = bind(spec)
        try:
            await view.ready()
        except Exception as exc:  # noqa: BLE001  could not load: the model's own error, for this request only
            raise self.error(exc, "model") from None
        return view, model_id

    async def _find(self, requested: str) -> tuple[str, str]:
        """(engine spec, id) of a requested model: one the engine holds, or one in the local store."""
        wanted = requested.lower()
        for status in await self.engine_models():
            if status.info is not None and status.info.name.lower() == wanted:
                return status.spec, self.id_for(status.info)
        for entry in self.catalog():
            if entry.id.lower() == wanted:
                return entry.spec, entry.id
        info = self.model_info
        assert info is not None
        raise self._not_found(requested, info)

    def id_for(self, info: ModelInfo) -> str:
        """The id a loaded model answers as: its store id where the store lists its path, else its name."""
        for entry in self.catalog():
            if entry.spec == info.path:
                return entry.id
        return info.name

    @staticmethod
    def _is_default(requested: str, info: ModelInfo) -> bool:
        aliases = {info.name.lower(), info.path, Path(info.path).name.lower()}
        return requested in aliases or requested.lower() in aliases

    def _not_found(self, requested: str, info: ModelInfo) -> APIError:
        known = [e.id for e in self.catalog()][:8] or [info.name]
        return APIError(
            404,
            f"The model `{requested}` is not a local model here; GET /v1/models lists those that answer "
            f"({', '.join(known)}). Pull it first with `chatapp models pull {requested}`.",
            param="model",
            code="model_not_found",
        )


def get_state(request: Request) -> ServerState:
    """The app's ServerState (routing.py hands it to the routes that name ``state``)."""
    return request.app.state.server
