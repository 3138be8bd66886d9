"""SIGKILL the TUI mid-stream: the restarted app shows the partial answer, marked incomplete."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tui_crash_app import PARTIAL
from tests.tui_helpers import make_app, panes, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


async def test_sigkill_mid_stream_keeps_the_partial_answer_marked_incomplete(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tui_crash_app", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the child says so (or exits)
        assert line.strip() == "STREAMING", proc.stderr.read() if proc.poll() is not None else line
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    conn = sqlite3.connect(tmp_path / "history.sqlite3")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("SELECT content, status FROM messages WHERE role = 'assistant'").fetchall() == [
        (PARTIAL, "streaming")
    ]  # as the killed process left it
    conn.close()

    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        pane = panes(app)[0]
        await wait_for(pilot, lambda: pane.view_for(pane.conversation.leaf) is not None, "answer shown")
        user, answer = pane.conversation.path()
        assert user.content == "Tell me something long"
        assert (answer.content, answer.status) == (PARTIAL, "incomplete")
        view = pane.view_for(answer)
        assert "incomplete" in str(view.query_one(".message-header").render())
        assert view.body.source == PARTIAL
        await app.action_quit()
    conn = sqlite3.connect(tmp_path / "history.sqlite3")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("SELECT status FROM messages WHERE role = 'assistant'").fetchall() == [("incomplete",)]
