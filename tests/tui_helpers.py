"""Shared bits of the TUI tests: building an app on a temp dir, and waiting without timing assertions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from chatapp.tui.app import ChatApp
from chatapp.tui.screens.main import MainScreen
from chatapp.tui.widgets.chat_pane import ChatPane
from tests.tui_fakes import FakeCatalog, FakeClient, factory


def make_app(tmp_path: Path, client: FakeClient | None = None, **kwargs: Any) -> ChatApp:
    kwargs.setdefault("catalog", FakeCatalog())
    kwargs.setdefault("session_sampling", {"temperature": 0, "max_tokens": 32})
    return ChatApp(
        settings_path=tmp_path / "settings.toml",
        history_path=tmp_path / "history.sqlite3",
        engine_factory=factory(client or FakeClient()),
        **kwargs,
    )


async def wait_for(pilot: Pilot, condition: Callable[[], bool], what: str, steps: int = 600) -> None:
    """Let the app run until ``condition()`` holds; fail (saying what) if it never does."""
    for _ in range(steps):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"never happened: {what}")


def main_screen(app: ChatApp) -> MainScreen:
    screen = app.screen
    assert isinstance(screen, MainScreen), f"expected the main screen, got {screen!r}"
    return screen


def panes(app: ChatApp) -> list[ChatPane]:
    return next(s for s in app.screen_stack if isinstance(s, MainScreen)).panes


async def send(pilot: Pilot, pane: ChatPane, text: str) -> None:
    """Type into the pane's prompt box and press Enter."""
    pane.prompt.focus()
    await pilot.pause()
    pane.prompt.text = text
    await pilot.press("enter")


def answered(pane: ChatPane, n: int = 1) -> bool:
    """The pane has at least ``n`` answers on its path and none is still streaming."""
    path = pane.conversation.path()
    answers = [m for m in path if m.role == "assistant"]
    return len(answers) >= n and all(m.status != "streaming" for m in answers) and not pane.busy
