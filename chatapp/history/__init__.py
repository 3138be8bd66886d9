"""Chat history: sessions and their message trees, kept in one SQLite file.

Why it is built this way:

* Every public method is one short transaction, committed before it returns,
  so a crash loses at most the call in flight, and two chatapp processes can
  share the file (WAL mode lets readers and one writer work side by side).
* Messages form a tree through ``parent_id``. Regenerating an answer or
  editing a user message adds a *sibling*; what a pane shows is the path from
  a root to the session's selected leaf.
* An answer is stored the moment it starts (status ``streaming``) and its text
  is rewritten while it grows (:meth:`HistoryStore.update_partial`), so a
  crash keeps it as far as it got. Whoever opens the file next marks such
  answers ``incomplete`` -- but only those whose writer is really gone: each
  store holds an advisory lock file, so a second live process is left alone.
* Any failed write raises :class:`HistoryWriteError` after rolling back, so
  what was saved before stays intact and the UI can keep the chat in memory.
* The schema is versioned with ``PRAGMA user_version`` and upgraded by the
  ordered :data:`MIGRATIONS`; a file from a newer chatapp is refused unchanged.

Times are Unix seconds (float, UTC). The module uses only the standard library.
"""

from __future__ import annotations

from chatapp.history.errors import (
    HistoryError,
    HistoryFormatError,
    HistoryNotFoundError,
    HistoryOpenError,
    HistoryVersionError,
    HistoryWriteError,
)
from chatapp.history.migrations import MIGRATIONS, schema_version
from chatapp.history.records import (
    DB_FILENAME,
    EXPORT_FORMAT,
    EXPORT_VERSION,
    FINAL_STATUSES,
    ROLES,
    STATUSES,
    Backend,
    Message,
    Metrics,
    Role,
    SearchHit,
    Session,
    Siblings,
    Status,
)
from chatapp.history.store import HistoryStore, default_path, fts_query

__all__ = [
    "DB_FILENAME",
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "FINAL_STATUSES",
    "ROLES",
    "STATUSES",
    "Role",
    "Status",
    "fts_query",
    "MIGRATIONS",
    "Backend",
    "HistoryError",
    "HistoryFormatError",
    "HistoryNotFoundError",
    "HistoryOpenError",
    "HistoryStore",
    "HistoryVersionError",
    "HistoryWriteError",
    "Message",
    "Metrics",
    "SearchHit",
    "Session",
    "Siblings",
    "default_path",
    "schema_version",
]
