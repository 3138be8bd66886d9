"""Shared bits of the TUI tests: building an app on a temp dir, and waiting without timing assertions."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.pilot import Pilot
from textual.widget import Widget

from chatapp.history import HistoryStore, Metrics
from chatapp.tui.app import ChatApp
from chatapp.tui.conversation import Node
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


def drawn_text(widget: Widget) -> str:
    """The characters the screen shows in ``widget``'s region, line by line (what a user reads)."""
    region = widget.region
    strips = widget.app.screen._compositor.render_strips()
    return "\n".join(strip.crop(region.x, region.right).text.rstrip() for strip in strips[region.y : region.bottom])


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


async def ask(pilot: Pilot, pane: ChatPane, text: str) -> Node:
    """Send ``text`` and wait for its answer to end; returns the answer."""
    await send(pilot, pane, text)
    await wait_for(pilot, lambda: answered(pane), f"the answer to {text!r}")
    return pane.conversation.path()[-1]


def answered(pane: ChatPane, n: int = 1) -> bool:
    """The pane has at least ``n`` answers on its path and none is still streaming."""
    path = pane.conversation.path()
    answers = [m for m in path if m.role == "assistant"]
    return len(answers) >= n and all(m.status != "streaming" for m in answers) and not pane.busy


CONVERSATIONS = [
    (
        "Python help",
        "How do I reverse a list in Python?",
        "Use slicing or `reversed()`:\n\n```python\nitems = [1, 2, 3]\nprint(items[::-1])\n```\n\n"
        "Slicing makes a copy; `items.reverse()` works in place.",
        Metrics(31, 42, 87.5, 120.0),
    ),
    (
        "Trip ideas",
        "Suggest a weekend trip from Paris.",
        "**Normandy** is two hours away:\n\n- Mont-Saint-Michel\n- Étretat cliffs\n- Honfleur harbour",
        Metrics(28, 30, 91.2, 95.0),
    ),
    ("Math", "What is 12 × 12?", "12 × 12 = **144**.", Metrics(25, 9, 78.0, 110.0)),
]


def fixed_history(tmp_path: Path) -> None:
    """Three sessions with fixed answers, metrics and dates (snapshots and README's pictures)."""
    with HistoryStore(tmp_path / "history.sqlite3") as store:
        for title, question, answer, metrics in CONVERSATIONS:
            session = store.create_session(title, sampling={"temperature": 0.7})
            q = store.add_message(session.id, None, "user", question)
            a = store.start_answer(session.id, q.id, model="FakeLM-1M")
            store.finish_message(a.id, answer, metrics=metrics)
        first = store.list_sessions()[0]
        q = store.path(first.id)[0]
        again = store.start_answer(first.id, q.id, model="FakeLM-1M")  # a second branch: "‹ 2/2 ›"
        store.finish_message(
            again.id, "Call `list(reversed(items))` for a new list.", metrics=Metrics(31, 12, 85.0, 100.0)
        )
        store.update_session(store.list_sessions()[2].id, archived=False)
    # Fixed dates (the sessions list shows when each was last used): an hour apart, "Math" the newest.
    with sqlite3.connect(tmp_path / "history.sqlite3") as conn:
        conn.execute("UPDATE sessions SET created_at = 1790000000 + 3600 * id, updated_at = 1790000000 + 3600 * id")
