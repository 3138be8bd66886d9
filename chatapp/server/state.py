"""What the routes share: the engine client (if any yet), its health, and model naming.

The server may start before its engine is ready (``chatapp serve`` listens
while the model loads) and outlive an engine that died (the client restarts
it), so every route asks this object for the client instead of holding one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fastapi import Request

from chatapp.engine.api import EngineClient, EngineDeadError, EngineState, ModelInfo, loaded_model_info
from chatapp.server.errors import APIError, from_engine_error, unavailable

log = logging.getLogger(__name__)


class ServerState:
    def __init__(self, client: EngineClient | None = None) -> None:
        self.client = client
        self.started = int(time.time())
        self._restart: asyncio.Task[None] | None = None

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

    def served_model(self, requested: str | None) -> str:
        """The id to answer with, or 404 for a model other than the loaded one.

        Accepted: no model at all, the loaded model's id (any case), its
        directory path or the directory's name. Another model is never loaded
        behind the user's back: switching would end everyone else's requests.
        """
        info = self.model_info
        if info is None:
            raise unavailable("the engine is loading; retry shortly")
        if not requested:
            return info.name
        aliases = {info.name.lower(), info.path, Path(info.path).name.lower()}
        if requested in aliases or requested.lower() in aliases:
            return info.name
        raise APIError(
            404,
            f"The model `{requested}` is not loaded here; this server serves `{info.name}`. "
            f"Switch models in chatapp, or restart `chatapp serve --model {requested}`.",
            param="model",
            code="model_not_found",
        )


def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's ServerState."""
    return request.app.state.server
