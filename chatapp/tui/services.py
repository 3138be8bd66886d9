"""What panes and screens need from the app, as a Protocol (so widgets do not import the App class)."""

from __future__ import annotations

from typing import Protocol

from chatapp.engine.api import EngineClient
from chatapp.tui.recorder import Recorder
from chatapp.tui.session_config import SessionConfig


class ChatServices(Protocol):
    recorder: Recorder

    async def client_for(self, config: SessionConfig) -> EngineClient:
        """The client a session's answers come from (waits for the local engine to be ready)."""

    def engine_died(self, reason: str) -> None:
        """A stream saw the local engine die."""

    def local_model_name(self) -> str | None:
        """The model the local engine runs (None until known)."""
