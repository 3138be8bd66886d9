"""A local OpenAI-compatible HTTP API on chatapp's shared engine (`chatapp serve`, or the TUI's switch).

Names are imported on first use, so `chatapp --help` (which registers the
`serve` subcommand) does not pay for the HTTP server and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatapp.server.app import create_app
    from chatapp.server.run import ServerHandle, start_server

__all__ = ["create_app", "start_server", "ServerHandle"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from chatapp.server.app import create_app

        return create_app
    if name in ("start_server", "ServerHandle"):
        from chatapp.server import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
