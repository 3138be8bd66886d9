"""Running the app under uvicorn inside an existing asyncio loop (the TUI's, or `chatapp serve`'s).

``start_server`` binds the socket itself, so a busy port raises OSError at
once (uvicorn would log and call sys.exit), and port 0 picks a free port.
The embedded uvicorn server leaves signal handling to its host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette

from chatapp.engine.api import EngineClient
from chatapp.server.app import create_app
from chatapp.server.exposure import exposure_warning, is_loopback  # noqa: F401  (re-exported)
from chatapp.server.middleware import DEFAULT_MAX_BODY_BYTES
from chatapp.server.state import ServerState

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that does not take over SIGINT/SIGTERM: its host decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass
class ServerHandle:
    """A running server: its URL, its state (to attach a client later), and stop()."""

    url: str
    host: str
    port: int
    app: Starlette
    _server: _EmbeddedServer = field(repr=False)
    _task: asyncio.Task[None] = field(repr=False)

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def attach(self, client: EngineClient) -> None:
        """Start serving ``client`` (for a server started with client=None while the model loads)."""
        self.state.attach(client)

    async def stop(self) -> None:
        """Stop listening, let answers in flight finish for a moment, then end them. Leaves the client open."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    @property
    def running(self) -> bool:
        return not self._task.done()


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> tuple[str, int, str]:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return host, port, f"http://{shown}:{port}"


async def start_server(
    client: EngineClient | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: bool = False,
    log_exposure: bool = True,
) -> ServerHandle:
    """Serve the OpenAI-compatible API on ``client`` from this event loop; returns once it listens.

    Raises OSError if the address cannot be bound. ``client`` may be None
    (requests get 503 until ``handle.attach(client)``). A non-loopback host
    without a key is logged as a warning unless the caller shows
    :func:`exposure_warning` itself (``log_exposure=False``).
    """
    warning = exposure_warning(host, api_key)
    if warning and log_exposure:
        log.warning(warning)
    app = create_app(client, api_key=api_key, cors_origins=cors_origins, max_body_bytes=max_body_bytes)
    sock = _bind(host, port)
    config = uvicorn.Config(
        app, log_config=None, access_log=access_log, lifespan="off", timeout_graceful_shutdown=3, server_header=False
    )
    server = _EmbeddedServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="chatapp-http-server")
    while not server.started:
        if task.done():
            sock.close()
            exc = task.exception() if not task.cancelled() else None
            raise OSError(f"the HTTP server on {host}:{port} failed to start: {exc!r}")
        await asyncio.sleep(0.01)
    bound_host, bound_port, url = _url(sock)
    return ServerHandle(url=url, host=bound_host, port=bound_port, app=app, _server=server, _task=task)
