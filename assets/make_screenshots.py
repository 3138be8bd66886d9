"""Make README's pictures from pilot runs of the real app (a fake engine, fixed history), so they
show the TUI as it is: run `python assets/make_screenshots.py` after changing the UI.

Writes assets/main.svg (three sessions answering at once), assets/models.svg (the models screen
with Hub results) and assets/sessions.svg (the sessions list, searched).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the fakes and the fixed history of tests/

from chatapp.tui.app import ChatApp  # noqa: E402
from chatapp.tui.screens.models import ModelScreen  # noqa: E402
from chatapp.tui.screens.sessions import SessionsScreen  # noqa: E402
from tests.tui_fakes import FakeCatalog, FakeClient, factory  # noqa: E402
from tests.tui_helpers import fixed_history, panes, wait_for  # noqa: E402

SIZE = (150, 40)
FOLLOW_UPS = [
    "And for a tuple?",
    "Which one is closest by train?",
    "And 13 × 13?",
]
REPLY = (
    "Good question. Here is the short answer:\n\n"
    "1. **First**, look at what you have.\n2. **Then** pick the simplest tool that fits.\n"
    "3. Check the result before moving on, and keep going with the rest of the plan so that"
)


def app_in(tmp: Path, client: FakeClient) -> ChatApp:
    fixed_history(tmp)
    app = ChatApp(
        settings_path=tmp / "settings.toml",
        history_path=tmp / "history.sqlite3",
        engine_factory=factory(client),
        catalog=FakeCatalog(),
        session_sampling={"temperature": 0.7, "max_tokens": 512},
    )
    app.animation_level = "none"
    return app


async def main_screen(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hold = asyncio.Event()  # every stream stops part way: three answers being written at once
        app = app_in(Path(tmp), FakeClient(reply=REPLY, chunk=6, hold=hold, hold_after=18))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: len(panes(app)) == 3 and app.engine.state == "ready", "app ready")
            for pane, text in zip(panes(app), FOLLOW_UPS):
                await pane.send(text)
            await wait_for(pilot, lambda: all(p.busy for p in panes(app)), "three streams")
            await pilot.pause(1.0)
            app.save_screenshot(filename=out.name, path=str(out.parent))
            hold.set()
            await app.action_quit()


async def screen_on(key: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        app = app_in(Path(tmp), FakeClient())
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: len(panes(app)) == 3 and app.engine.state == "ready", "app ready")
            await pilot.press(key)
            if key == "f4":
                await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), "models")
                app.screen.query_one("#hub-search").focus()
                await pilot.press("enter")
                await wait_for(pilot, lambda: app.screen.query_one("#hub").row_count > 0, "hub results")
            else:
                await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "sessions")
                await pilot.press(*"list")
            await pilot.pause(0.5)
            app.save_screenshot(filename=out.name, path=str(out.parent))
            await app.action_quit()


def main() -> None:
    here = Path(__file__).resolve().parent
    asyncio.run(main_screen(here / "main.svg"))
    asyncio.run(screen_on("f4", here / "models.svg"))
    asyncio.run(screen_on("f7", here / "sessions.svg"))
    for name in ("main.svg", "models.svg", "sessions.svg"):
        print(here / name)


if __name__ == "__main__":
    main()
