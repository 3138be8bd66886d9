"""What panes and screens need from the app, as Protocols: widgets and screens do not import the App
class, and the app hands each screen its services when it builds it (tests may hand fakes)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from chatapp.engine.api import EngineClient
from chatapp.tui.recorder import Recorder
from chatapp.tui.session_config import SessionConfig

if TYPE_CHECKING:
    from textual.worker import Worker

    from chatapp.history import HistoryStore
    from chatapp.settings import Settings
    from chatapp.tui.downloads import PullJob
    from chatapp.tui.engine_link import LocalEngine
    from chatapp.tui.model_catalog import ModelCatalog


class ChatServices(Protocol):
    recorder: Recorder

    async def client_for(self, config: SessionConfig) -> EngineClient:
        """The client a session's answers come from (waits for the local engine to be ready)."""

    def engine_died(self, reason: str) -> None:
        """A stream saw the local engine die."""

    def local_model_name(self) -> str | None:
        """The model the local engine runs (None until known)."""

    def local_context_length(self, model: str | None = None) -> int | None:
        """The context in tokens of the local engine's default model, or of ``model`` once it is loaded
        (None until known)."""


class MainScreenServices(ChatServices, Protocol):
    """The session panes' screen: new sessions, export, settings, and what the panes need."""

    settings: Settings

    def create_session_config(self) -> SessionConfig:
        """A new session's settings (numbered title, default model and sampling)."""

    def export_session(self, config: SessionConfig) -> list[Path]:
        """Write a session to Markdown and JSON files; the paths written."""

    def file_api_key(self, config: SessionConfig) -> SessionConfig:
        """The session with its remote API key moved into the settings file (out of the history)."""

    async def local_model_names(self) -> list[str]:
        """The runnable models on this machine, by the names panes use them by."""


class SessionsScreenServices(Protocol):
    """The saved-sessions list."""

    store: HistoryStore | None

    def export_by_id(self, session_id: int) -> list[Path]:
        """Export a saved session by its id; the paths written."""


class ModelScreenServices(Protocol):
    """The models screen: the catalog, downloads and the local engine's model."""

    catalog: ModelCatalog
    engine: LocalEngine

    def local_model_name(self) -> str | None:
        """The model the local engine runs (None until known)."""

    def switch_model(self, name: str) -> Worker[None]:
        """Make another model the local engine's default (a worker: returns at once)."""

    def use_model(self, name: str, new_pane: bool) -> Worker[None]:
        """Have the focused pane (or a new one) answer with ``name``, loaded beside the others."""

    @property
    def latest_pull(self) -> PullJob | None:
        """The most recent download, running or ended."""

    def start_pull(self, spec: str) -> PullJob | None:
        """Start downloading ``spec`` (None when one already runs)."""
