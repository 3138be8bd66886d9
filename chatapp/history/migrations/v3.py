"""Schema version 3: a session keeps how its prompts are fitted to the model's context."""

from __future__ import annotations

import sqlite3
from typing import Final

_V3: Final = (
    # JSON {"mode": "drop"|"summarise", "dropped": n, "summary": text} once the chat outgrew the
    # context and the user chose how to fit it (tui/context_fit.py); NULL before that.
    "ALTER TABLE sessions ADD COLUMN context_fit TEXT",
)


def migrate(conn: sqlite3.Connection) -> None:
    for statement in _V3:
        conn.execute(statement)
