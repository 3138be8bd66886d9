"""Snapshots of the main screen (three sessions), the sessions list, the model screen and the help screen.

Deterministic: a fixed history (metrics stored, not measured), a fake engine
with fixed counters, a fixed model catalog, fixed terminal sizes.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from textual.pilot import Pilot

from chatapp.history import HistoryStore, Metrics
from chatapp.tui.screens.models import ModelScreen
from chatapp.tui.screens.sessions import SessionsScreen
from tests.tui_fakes import FakeClient
from tests.tui_helpers import make_app, panes, wait_for

pytestmark = pytest.mark.timeout(120)

SIZE = (150, 40)

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


@pytest.fixture(autouse=True)
def _fixed_log_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """F1 names the log file; the test's own temp dir would change every snapshot."""
    monkeypatch.setattr("chatapp.tui.app.tui_log_path", lambda: Path("/home/user/.local/state/chatapp/log/tui.log"))


def fixed_history(tmp_path: Path) -> None:
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


def snapshot_app(tmp_path: Path):
    fixed_history(tmp_path)
    app = make_app(tmp_path, FakeClient())
    app.animation_level = "none"  # e.g. the tab underline would be caught mid-slide
    return app


async def settle(pilot: Pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.engine.state == "ready" and len(panes(app)) == 3, "app ready")
    await pilot.pause()


def test_main_screen_with_three_sessions(snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("f6")  # the second pane has the focus
        await wait_for(pilot, lambda: panes(pilot.app)[1].has_class("active"), "second pane active")
        await pilot.wait_for_animation()
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_sessions_list_with_a_search(snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("f7")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SessionsScreen), "sessions list")
        await pilot.press(*"list")
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_model_screen_with_hub_results(snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelScreen), "model screen")
        screen = pilot.app.screen
        await wait_for(pilot, lambda: screen.query_one("#local").row_count == 2, "local models")
        screen.query_one("#hub-search").focus()
        await pilot.press("enter")  # an empty search lists the catalog's results
        await wait_for(pilot, lambda: screen.query_one("#hub").row_count == 3, "hub results")
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)


SMALL_SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((60, 20), id="60x20")]


async def _open(pilot: Pilot, key: str | None) -> None:
    await settle(pilot)
    if key is None:
        return
    before = pilot.app.screen
    await pilot.press(key)
    await wait_for(pilot, lambda: pilot.app.screen is not before, f"the screen on {key}")
    if isinstance(pilot.app.screen, ModelScreen):
        local = pilot.app.screen.query_one("#local")
        await wait_for(pilot, lambda: local.row_count == 2, "local models")
    await pilot.pause()


@pytest.mark.parametrize("size", SMALL_SIZES)
@pytest.mark.parametrize("key", [None, "f1", "f5", "f4"], ids=["main", "help", "session_settings", "models"])
def test_small_terminals(snap_compare, tmp_path: Path, size: tuple[int, int], key: str | None) -> None:
    """What a laptop's split terminal shows: every screen usable at 80x24 and 60x20 (issue 18)."""

    async def run_before(pilot: Pilot) -> None:
        await _open(pilot, key)

    assert snap_compare(snapshot_app(tmp_path), terminal_size=size, run_before=run_before)
