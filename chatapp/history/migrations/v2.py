"""Schema version 2: an answer cut at the token limit says so, and each session keeps its unsent draft."""

from __future__ import annotations

import sqlite3
from typing import Final

_V2: Final = (
    # 1: the answer ended at max_tokens or the context's end (it can be continued); 0 otherwise.
    "ALTER TABLE messages ADD COLUMN truncated INTEGER NOT NULL DEFAULT 0 CHECK (truncated IN (0, 1))",
    # What the user had typed in the pane's prompt and not sent, kept across restarts.
    "ALTER TABLE sessions ADD COLUMN draft TEXT NOT NULL DEFAULT ''",
)


def migrate(conn: sqlite3.Connection) -> None:
    for statement in _V2:
        conn.execute(statement)
