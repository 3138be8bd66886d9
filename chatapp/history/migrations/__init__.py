"""The schema's versions, one file each, applied in order (PRAGMA user_version says where a file is)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from chatapp.history.migrations.v1 import migrate as _migrate_to_v1
from chatapp.history.migrations.v2 import migrate as _migrate_to_v2
from chatapp.history.migrations.v3 import migrate as _migrate_to_v3

MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_migrate_to_v1, _migrate_to_v2, _migrate_to_v3]
"""Migration i brings a database from version i to i + 1. Only ever append."""


def schema_version() -> int:
    """The schema version this code writes (the number of migrations)."""
    return len(MIGRATIONS)
