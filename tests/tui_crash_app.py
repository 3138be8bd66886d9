"""Run by test_tui_crash.py in a subprocess: the TUI (headless) streaming an answer when it gets SIGKILL.

Prints STREAMING once the partial answer is in the history file, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.tui_fakes import FakeClient
from tests.tui_helpers import make_app, panes, send, wait_for

PARTIAL = "The answer so far, "


async def main(data_dir: Path) -> None:
    hold = asyncio.Event()  # never set: the stream stays open until the kill
    client = FakeClient(reply=PARTIAL + "and the rest that never comes.", chunk=len(PARTIAL), hold=hold, hold_after=1)
    app = make_app(data_dir, client)
    async with app.run_test(size=(100, 30)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "Tell me something long")
        answer = lambda: pane.conversation.leaf  # noqa: E731

        def saved() -> bool:
            node = answer()
            return (
                node is not None
                and node.db_id is not None
                and app.store is not None
                and app.store.get_message(node.db_id).content == PARTIAL
            )

        await wait_for(pilot, saved, "partial answer saved")
        print("STREAMING", flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
