"""A local OpenAI-compatible HTTP API on chatapp's shared engine (`chatapp serve`, or the TUI's switch)."""

from chatapp.server.app import create_app
from chatapp.server.run import ServerHandle, start_server

__all__ = ["create_app", "start_server", "ServerHandle"]
