"""Run by test_reliability_faults.py in a subprocess: the TUI (headless) when its history's disk fills up.

A real failure from the operating system, not SQLite's page limit: after one exchange is saved, the
process's file-size limit (RLIMIT_FSIZE) is set to the size of the largest history file, so writing
past it fails with EFBIG, as on a full disk. The app then gets a long message and answers it, and
quits with the disk still "full". Prints one JSON line of what it saw, for the test to check.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path

from tests.tui_fakes import FakeClient
from tests.tui_helpers import answered, main_screen, make_app, panes, send, wait_for

REPLY = "An answer saved before the disk filled up."
LONG = ("A long message that no longer fits. " * 6000).strip()  # about 200 KB


async def main(data_dir: Path) -> None:
    seen: dict[str, object] = {}
    app = make_app(data_dir, FakeClient(reply=REPLY))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "Saved first")
        await wait_for(pilot, lambda: answered(pane) and pane.conversation.leaf.db_id is not None, "saved")
        await pilot.pause(0.5)  # let the last writes land before the limit goes on

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG) instead of killing us
        limit = max(f.stat().st_size for f in data_dir.iterdir() if f.name.startswith("history"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

        await send(pilot, pane, LONG)
        await wait_for(pilot, lambda: answered(pane, 2), "the second answer, in memory")
        await wait_for(pilot, lambda: main_screen(app).query_one("StatusBar").history_failing, "status warning")
        seen["in_memory"] = [m.content for m in pane.conversation.path()]
        seen["failing"] = app.recorder.failing
        seen["notices"] = [f"{n.title}: {n.message}" for n in app._notifications]
        seen["status_bar"] = str(main_screen(app).query_one("StatusBar").render())
        await app.action_quit()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    import asyncio

    asyncio.run(main(Path(sys.argv[1])))
