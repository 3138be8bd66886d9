"""Snapshots of the main screen (three sessions), the sessions list, the model screen and the help screen.

Deterministic: a fixed history (metrics stored, not measured), a fake engine
with fixed counters, a fixed model catalog, fixed terminal sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot

from chatapp.tui.screens.models import ModelScreen
from chatapp.tui.screens.sessions import SessionsScreen
from tests.tui_fakes import FakeClient
from tests.tui_helpers import fixed_history, make_app, panes, wait_for

pytestmark = pytest.mark.timeout(120)

SIZE = (150, 40)


@pytest.fixture(autouse=True)
def _fixed_log_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """F1 names the log file; the test's own temp dir would change every snapshot."""
    monkeypatch.setattr("chatapp.tui.app.tui_log_path", lambda: Path("/home/user/.local/state/chatapp/log/tui.log"))


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
