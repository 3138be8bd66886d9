"""The store: one short transaction per public method (see the package's docstring)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Final, cast

from chatapp.history import migrations
from chatapp.history.errors import (
    HistoryError,
    HistoryFormatError,
    HistoryNotFoundError,
    HistoryOpenError,
    HistoryVersionError,
    HistoryWriteError,
)
from chatapp.history.export import _markdown, _message_dict, _parse_export
from chatapp.history.locks import _WriterLock
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
    _iso,
    _sampling_json,
)


def default_path() -> Path:
    """The history file under the user's data directory."""
    from chatapp import paths

    return paths.data_dir() / DB_FILENAME


# -- live-writer locks ----------------------------------------------------------


# -- helpers --------------------------------------------------------------------


class _Unset:
    """Marks an update_session argument that was not given (None is a real value there)."""

    def __repr__(self) -> str:
        return "UNSET"


_UNSET: Any = _Unset()

_REASONS: Final = {
    sqlite3.SQLITE_FULL: "the disk is full (or the history file reached its size limit)",
    sqlite3.SQLITE_READONLY: "the history file or its folder is read-only",
    sqlite3.SQLITE_PERM: "permission denied",
    sqlite3.SQLITE_BUSY: "another chatapp process kept the history locked for too long",
    sqlite3.SQLITE_LOCKED: "another chatapp process kept the history locked for too long",
    sqlite3.SQLITE_IOERR: "a disk input/output error",
    sqlite3.SQLITE_CANTOPEN: "the file cannot be opened",
    sqlite3.SQLITE_CORRUPT: "the history file is damaged",
    sqlite3.SQLITE_NOTADB: "the file is not a chatapp history database",
}


def _reason(exc: sqlite3.Error) -> str:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and (code & 0xFF) in _REASONS:
        return f"{_REASONS[code & 0xFF]} ({exc})"
    return str(exc)


def _inserted_id(cursor: sqlite3.Cursor) -> int:
    """The row id an INSERT just made (sqlite3 types it Optional for statements that insert nothing)."""
    row_id = cursor.lastrowid
    if row_id is None:
        raise HistoryError("the database did not report the new row's id")
    return row_id


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def fts_query(text: str) -> str | None:
    """Turn what the user typed into a safe FTS5 query (None: nothing to search).

    Every word becomes a quoted phrase, so FTS syntax characters (quotes, *,
    -, :, parentheses, AND/OR/NOT) are searched for literally instead of
    raising; the last word matches as a prefix, for search-as-you-type.
    """
    words = text.replace("\x00", " ").split()
    if not words:
        return None
    phrases = ['"' + word.replace('"', '""') + '"' for word in words]
    phrases[-1] += "*"
    return " ".join(phrases)


# -- the store ---------------------------------------------------------------------------


class HistoryStore:
    """All chat sessions and messages, in one SQLite file.

    Safe to share between threads (calls are serialised by a lock) and
    between processes (SQLite WAL). Use as a context manager or call
    :meth:`close`. All methods raise :class:`HistoryError` subclasses.
    """

    def __init__(self, path: Path | str | None = None, *, busy_timeout_s: float = 5.0) -> None:
        """Open (creating or upgrading) the history file; default: under ``paths.data_dir()``.

        ``busy_timeout_s``: how long a write waits for another process's
        transaction before giving up with :class:`HistoryWriteError`.
        """
        self.db_path = Path(path) if path is not None else default_path()
        self._lock = threading.RLock()
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._writer: _WriterLock | None = None
        try:
            self.db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryOpenError(f"cannot create the folder for the chat history {self.db_path}: {exc}") from None
        try:
            self._conn = self._connect()
            try:
                self._writer = _WriterLock(self._writer_dir)
            except OSError as exc:
                raise HistoryOpenError(
                    f"cannot create a lock file next to the chat history {self.db_path}: {exc}"
                ) from None
            _WriterLock.sweep(self._writer_dir)
            with suppress(HistoryWriteError):  # e.g. disk full: the history can still be read; retried next open
                self._recover_orphans()
        except BaseException:
            self.close()
            raise

    # -- opening --------------------------------------------------------------

    @property
    def _writer_dir(self) -> Path:
        return self.db_path.parent / (self.db_path.name + ".writers")

    def _keep_private(self) -> None:
        """The history is the user's conversations (and remote sessions' settings): readable by its owner
        alone, as the settings file is. A new file is made 0600, so SQLite makes its -wal and -shm files
        so too; an older, wider file is narrowed."""
        try:
            fd = os.open(self.db_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            for suffix in ("", "-wal", "-shm"):
                with suppress(OSError):  # not ours to change (a shared file): leave it as it is
                    path = Path(f"{self.db_path}{suffix}")
                    if path.exists() and path.stat().st_mode & 0o077:
                        os.chmod(path, 0o600)
        except OSError:
            return  # sqlite3.connect reports why the file cannot be made
        else:
            os.close(fd)

    def _connect(self) -> sqlite3.Connection:
        self._keep_private()
        try:
            conn = sqlite3.connect(
                self.db_path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise HistoryOpenError(f"cannot open the chat history {self.db_path}: {_reason(exc)}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA secure_delete = ON")  # deleted chats and cleared keys are overwritten
            # Check the version before anything writes to the file (even
            # switching to WAL does), so a newer file is never modified.
            found = conn.execute("PRAGMA user_version").fetchone()[0]
            self._check_version(found)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")  # a completed message survives power loss too
            self._migrate(conn)
        except HistoryError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise HistoryOpenError(f"cannot open the chat history {self.db_path}: {_reason(exc)}") from None
        return conn

    def _check_version(self, found: int) -> None:
        if found > migrations.schema_version():
            raise HistoryVersionError(
                f"the chat history {self.db_path} was written by a newer chatapp (schema version {found}; "
                f"this one knows up to {migrations.schema_version()}). Upgrade chatapp; the file was not changed."
            )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Bring the file up to :func:`schema_version` in one transaction (all or nothing)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have upgraded it
            self._check_version(found)
            for version in range(found, migrations.schema_version()):
                migrations.MIGRATIONS[version](conn)
            if found != migrations.schema_version():
                conn.execute(f"PRAGMA user_version = {migrations.schema_version()}")
            conn.execute("COMMIT")
        except BaseException as exc:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise HistoryOpenError(
                    f"cannot upgrade the chat history {self.db_path} to schema version {migrations.schema_version()}: "
                    f"{_reason(exc)}; the file was left as it was"
                ) from None
            raise

    def _recover_orphans(self) -> None:
        """Mark answers whose writer died mid-stream ``incomplete``, keeping their text."""
        with self._write() as conn:
            writers = [
                row[0] for row in conn.execute("SELECT DISTINCT writer FROM messages WHERE status = 'streaming'")
            ]
            for writer in writers:
                if not _WriterLock.is_alive(self._writer_dir, writer):
                    conn.execute(
                        "UPDATE messages SET status = 'incomplete', writer = NULL "
                        "WHERE status = 'streaming' AND writer IS ?",
                        (writer,),
                    )

    def close(self) -> None:
        """Close the file. Answers this store was still streaming are kept, marked ``incomplete``."""
        with self._lock:
            if self._conn is not None and self._writer is not None:
                with suppress(HistoryError):
                    with self._write() as conn:
                        conn.execute(
                            "UPDATE messages SET status = 'incomplete', writer = NULL "
                            "WHERE status = 'streaming' AND writer = ?",
                            (self._writer.token,),
                        )
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._writer is not None:
                self._writer.release()
                self._writer = None

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- transactions ------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise HistoryError(f"the chat history {self.db_path} is closed")
        return self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; any database failure becomes HistoryWriteError after a rollback."""
        with self._lock:
            conn = self._connection()
            try:
                # IMMEDIATE takes the write lock up front, so waiting for another
                # process happens here (under the busy timeout), not mid-way.
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.IntegrityError):
                    raise HistoryWriteError(
                        f"could not save to the chat history {self.db_path}: {_reason(exc)}"
                    ) from None
                raise

    @contextmanager
    def _read(self, snapshot: bool = False) -> Iterator[sqlite3.Connection]:
        """Reads; ``snapshot`` wraps several queries in one transaction so they agree."""
        with self._lock:
            conn = self._connection()
            try:
                if snapshot:
                    conn.execute("BEGIN")
                yield conn
                if snapshot:
                    conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.DatabaseError):
                    raise HistoryError(f"could not read the chat history {self.db_path}: {_reason(exc)}") from None
                raise

    # -- row conversion ------------------------------------------------------------------

    _SESSION_COLUMNS: Final = ", ".join(
        (
            "id",
            "title",
            "created_at",
            "updated_at",
            "position",
            "model",
            "system_prompt",
            "sampling",
            "backend_kind",
            "backend_url",
            "backend_endpoint",
            "backend_api_key",
            "selected_leaf_id",
            "archived",
            "draft",
            "context_fit",
        )
    )
    _MESSAGE_FIELDS: Final = (
        "id",
        "session_id",
        "parent_id",
        "role",
        "content",
        "status",
        "created_at",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "tokens_per_second",
        "ttft_ms",
        "error",
        "truncated",
    )
    _MESSAGE_COLUMNS: Final = ", ".join(_MESSAGE_FIELDS)
    _MESSAGE_COLUMNS_M: Final = ", ".join("m." + name for name in _MESSAGE_FIELDS)

    @staticmethod
    def _session(row: tuple[Any, ...]) -> Session:
        # The columns of _SESSION_COLUMNS in order: seven plain ones, then sampling JSON, the backend's
        # four, the shown leaf, the archived flag, the draft and the context fit's JSON.
        plain = cast("tuple[int, str, float, float, int, str | None, str]", row[:7])
        sampling, kind, url, endpoint, api_key, leaf, archived, draft, fit = row[7:]
        backend = Backend(kind, url, endpoint, api_key)
        context_fit = json.loads(fit) if fit else None
        return Session(*plain, json.loads(sampling), backend, leaf, bool(archived), draft, context_fit)

    @staticmethod
    def _message(row: tuple[Any, ...]) -> Message:
        # The columns of _MESSAGE_FIELDS in order: eight plain ones, the four metrics, error, truncated.
        plain = cast("tuple[int, int, int | None, Role, str, Status, float, str | None]", row[:8])
        prompt_tokens, completion_tokens, tps, ttft, error, truncated = row[8:]
        metrics = Metrics(prompt_tokens, completion_tokens, tps, ttft)
        return Message(*plain, None if metrics.is_empty() else metrics, error, bool(truncated))

    def _get_session(self, conn: sqlite3.Connection, session_id: int) -> Session:
        row = conn.execute(f"SELECT {self._SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise HistoryNotFoundError(f"there is no chat session with id {session_id}")
        return self._session(row)

    def _get_message(self, conn: sqlite3.Connection, message_id: int) -> Message:
        row = conn.execute(f"SELECT {self._MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise HistoryNotFoundError(f"there is no message with id {message_id}")
        return self._message(row)

    # -- sessions -------------------------------------------------------------------

    def create_session(
        self,
        title: str = "",
        *,
        model: str | None = None,
        system_prompt: str = "",
        sampling: Mapping[str, Any] | None = None,
        backend: Backend | None = None,
    ) -> Session:
        """A new session, placed after the other panes."""
        backend = backend or Backend.local()
        sampling_json = _sampling_json(sampling)
        now = time.time()
        with self._write() as conn:
            position = conn.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM sessions").fetchone()[0]
            cursor = conn.execute(
                "INSERT INTO sessions (title, created_at, updated_at, position, model, system_prompt, sampling, "
                "backend_kind, backend_url, backend_endpoint, backend_api_key) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    title,
                    now,
                    now,
                    position,
                    model,
                    system_prompt,
                    sampling_json,
                    backend.kind,
                    backend.base_url,
                    backend.endpoint,
                    backend.api_key,
                ),
            )
            return self._get_session(conn, _inserted_id(cursor))

    def get_session(self, session_id: int) -> Session:
        with self._read() as conn:
            return self._get_session(conn, session_id)

    def list_sessions(self, *, include_archived: bool = False) -> list[Session]:
        """Sessions in pane order."""
        where = "" if include_archived else "WHERE archived = 0"
        with self._read() as conn:
            rows = conn.execute(f"SELECT {self._SESSION_COLUMNS} FROM sessions {where} ORDER BY position, id")
            return [self._session(row) for row in rows]

    def rename_session(self, session_id: int, title: str) -> Session:
        return self.update_session(session_id, title=title)

    def update_session(
        self,
        session_id: int,
        *,
        title: str = _UNSET,
        model: str | None = _UNSET,
        system_prompt: str = _UNSET,
        sampling: Mapping[str, Any] | None = _UNSET,
        backend: Backend = _UNSET,
        archived: bool = _UNSET,
        draft: str = _UNSET,
        context_fit: Mapping[str, Any] | None = _UNSET,
    ) -> Session:
        """Change only the fields given. Archiving or restoring moves the session to the end."""
        changes: dict[str, Any] = {}
        if draft is not _UNSET:
            changes["draft"] = draft
        if context_fit is not _UNSET:
            changes["context_fit"] = None if context_fit is None else json.dumps(dict(context_fit))
        if title is not _UNSET:
            changes["title"] = title
        if model is not _UNSET:
            changes["model"] = model
        if system_prompt is not _UNSET:
            changes["system_prompt"] = system_prompt
        if sampling is not _UNSET:
            changes["sampling"] = _sampling_json(sampling)
        if backend is not _UNSET:
            if not isinstance(backend, Backend):
                raise ValueError("backend must be a Backend")
            changes.update(
                backend_kind=backend.kind,
                backend_url=backend.base_url,
                backend_endpoint=backend.endpoint,
                backend_api_key=backend.api_key,
            )
        with self._write() as conn:
            old = self._get_session(conn, session_id)
            if archived is not _UNSET and bool(archived) != old.archived:
                changes["archived"] = int(bool(archived))
                changes["position"] = conn.execute("SELECT MAX(position) + 1 FROM sessions").fetchone()[0]
            changes["updated_at"] = time.time()
            assignments = ", ".join(f"{name} = ?" for name in changes)
            conn.execute(f"UPDATE sessions SET {assignments} WHERE id = ?", (*changes.values(), session_id))
            return self._get_session(conn, session_id)

    def move_session(self, session_id: int, index: int) -> list[Session]:
        """Move a pane to ``index`` among the unarchived sessions; returns them in the new order."""
        with self._write() as conn:
            target = self._get_session(conn, session_id)
            if target.archived:
                raise ValueError("an archived session has no pane to move; restore it first")
            rows = conn.execute("SELECT id, archived FROM sessions ORDER BY position, id").fetchall()
            shown = [sid for sid, archived in rows if not archived and sid != session_id]
            shown.insert(max(0, min(index, len(shown))), session_id)
            hidden = [sid for sid, archived in rows if archived]
            conn.executemany(
                "UPDATE sessions SET position = ? WHERE id = ?", [(pos, sid) for pos, sid in enumerate(shown + hidden)]
            )
        return self.list_sessions()

    def delete_session(self, session_id: int) -> None:
        """Delete a session and all its messages."""
        with self._write() as conn:
            if conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount == 0:
                raise HistoryNotFoundError(f"there is no chat session with id {session_id}")

    # -- messages ---------------------------------------------------------------------

    def add_message(
        self,
        session_id: int,
        parent_id: int | None,
        role: Role,
        content: str,
        *,
        model: str | None = None,
        status: Status = "complete",
        select: bool = True,
    ) -> Message:
        """Add a message under ``parent_id`` (None: a new root) and, by default, show its branch.

        Editing a message or regenerating an answer is simply adding a
        sibling: a message under the same parent.
        """
        _check_choice(role, ROLES, "role")
        _check_choice(status, STATUSES, "status")
        now = time.time()
        with self._write() as conn:
            self._get_session(conn, session_id)
            if parent_id is not None:
                parent = self._get_message(conn, parent_id)
                if parent.session_id != session_id:
                    raise ValueError(f"message {parent_id} belongs to session {parent.session_id}, not {session_id}")
            writer = self._writer.token if status == "streaming" and self._writer else None
            cursor = conn.execute(
                "INSERT INTO messages (session_id, parent_id, role, content, status, created_at, model, writer) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (session_id, parent_id, role, content, status, now, model, writer),
            )
            message_id = _inserted_id(cursor)
            selected = ", selected_leaf_id = ?" if select else ""
            conn.execute(
                f"UPDATE sessions SET updated_at = ?{selected} WHERE id = ?",
                (now, message_id, session_id) if select else (now, session_id),
            )
            return self._get_message(conn, message_id)

    def start_answer(
        self, session_id: int, parent_id: int, *, model: str | None = None, select: bool = True
    ) -> Message:
        """An empty assistant message with status ``streaming``, saved before the first token."""
        return self.add_message(session_id, parent_id, "assistant", "", model=model, status="streaming", select=select)

    def reopen_answer(self, message_id: int) -> Message:
        """Make a finished answer ``streaming`` again, to go on with it (Continue): its partial saves
        land and, should this process die, the next open marks it incomplete with its text kept."""
        with self._write() as conn:
            message = self._get_message(conn, message_id)
            if message.role != "assistant":
                raise ValueError(f"message {message_id} is not an answer")
            writer = self._writer.token if self._writer else None
            conn.execute(
                "UPDATE messages SET status = 'streaming', writer = ?, truncated = 0 WHERE id = ?", (writer, message_id)
            )
            return self._get_message(conn, message_id)

    def update_partial(self, message_id: int, content: str) -> None:
        """Save the text a streaming answer has so far (the whole text, not a delta).

        Meant to be called every half second or so while tokens arrive: it is
        one small UPDATE and leaves the search index alone until the end.
        """
        with self._write() as conn:
            changed = conn.execute(
                "UPDATE messages SET content = ? WHERE id = ? AND status = 'streaming'", (content, message_id)
            ).rowcount
            if not changed:
                message = self._get_message(conn, message_id)
                raise HistoryError(f"message {message_id} is not streaming (it is {message.status})")

    def finish_message(
        self,
        message_id: int,
        content: str,
        *,
        status: Status = "complete",
        metrics: Metrics | None = None,
        error: str | None = None,
        truncated: bool = False,
    ) -> Message:
        """Store an answer's final text, status and metrics (``truncated``: it stopped at the token limit)."""
        _check_choice(status, FINAL_STATUSES, "a finished message's status")
        metrics = metrics or Metrics()
        now = time.time()
        with self._write() as conn:
            message = self._get_message(conn, message_id)
            conn.execute(
                "UPDATE messages SET content = ?, status = ?, writer = NULL, error = ?, truncated = ?, "
                "prompt_tokens = ?, completion_tokens = ?, tokens_per_second = ?, ttft_ms = ? WHERE id = ?",
                (
                    content,
                    status,
                    error,
                    int(truncated),
                    metrics.prompt_tokens,
                    metrics.completion_tokens,
                    metrics.tokens_per_second,
                    metrics.ttft_ms,
                    message_id,
                ),
            )
            conn.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (now, message.session_id))
            return self._get_message(conn, message_id)

    def get_message(self, message_id: int) -> Message:
        with self._read() as conn:
            return self._get_message(conn, message_id)

    def delete_message(self, message_id: int) -> None:
        """Delete a message and every reply under it (a whole branch).

        If the shown branch went with it, the session shows its newest remaining message.
        """
        with self._write() as conn:
            self._get_message(conn, message_id)
            conn.execute(f"DELETE FROM messages WHERE id IN ({self._SUBTREE} SELECT id FROM down)", (message_id,))

    # -- the tree --------------------------------------------------------------------

    _SUBTREE: Final = (
        "WITH RECURSIVE down(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN down ON m.parent_id = down.id)"
    )
    """A CTE naming the ids of a message and everything below it."""

    def _path(self, conn: sqlite3.Connection, leaf_id: int) -> list[Message]:
        rows = conn.execute(
            f"""WITH RECURSIVE up(id, depth) AS (
                    SELECT id, 0 FROM messages WHERE id = ?
                    UNION ALL
                    SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
                    WHERE m.parent_id IS NOT NULL)
                SELECT {self._MESSAGE_COLUMNS_M}
                FROM up JOIN messages m ON m.id = up.id ORDER BY up.depth DESC""",
            (leaf_id,),
        )
        return [self._message(row) for row in rows]

    def _shown_leaf(self, conn: sqlite3.Connection, session: Session) -> int | None:
        if session.selected_leaf_id is not None:
            return session.selected_leaf_id
        row = conn.execute("SELECT MAX(id) FROM messages WHERE session_id = ?", (session.id,)).fetchone()
        return row[0]

    def path(self, session_id: int, leaf_id: int | None = None) -> list[Message]:
        """Root-to-leaf messages: what a pane shows. Default leaf: the session's selected one."""
        with self._read(snapshot=True) as conn:
            session = self._get_session(conn, session_id)
            if leaf_id is None:
                leaf_id = self._shown_leaf(conn, session)
                if leaf_id is None:
                    return []
            elif self._get_message(conn, leaf_id).session_id != session_id:
                raise ValueError(f"message {leaf_id} is not in session {session_id}")
            return self._path(conn, leaf_id)

    def children(self, message_id: int | None, session_id: int | None = None) -> list[Message]:
        """Direct replies to a message, oldest first (``None`` plus ``session_id``: the roots)."""
        with self._read() as conn:
            if message_id is None:
                if session_id is None:
                    raise ValueError("children(None) needs the session_id whose roots to list")
                rows = conn.execute(
                    f"SELECT {self._MESSAGE_COLUMNS} FROM messages "
                    "WHERE session_id = ? AND parent_id IS NULL ORDER BY id",
                    (session_id,),
                )
            else:
                rows = conn.execute(
                    f"SELECT {self._MESSAGE_COLUMNS} FROM messages WHERE parent_id = ? ORDER BY id", (message_id,)
                )
            return [self._message(row) for row in rows]

    def siblings(self, message_id: int) -> Siblings:
        """The branches of this message's turn (same parent), oldest first, and its index among them."""
        with self._read(snapshot=True) as conn:
            message = self._get_message(conn, message_id)
            rows = conn.execute(
                f"SELECT {self._MESSAGE_COLUMNS} FROM messages WHERE session_id = ? AND parent_id IS ? ORDER BY id",
                (message.session_id, message.parent_id),
            )
            messages = [self._message(row) for row in rows]
        return Siblings(messages, [m.id for m in messages].index(message_id))

    def _latest_leaf(self, conn: sqlite3.Connection, message_id: int) -> int:
        # Ids grow with time and a reply is newer than its parent, so the
        # newest message under (or at) message_id has no replies: a leaf.
        return conn.execute(f"{self._SUBTREE} SELECT MAX(id) FROM down", (message_id,)).fetchone()[0]

    def latest_leaf(self, message_id: int) -> Message:
        """The newest message in the branch below ``message_id`` (itself if it has no replies)."""
        with self._read(snapshot=True) as conn:
            self._get_message(conn, message_id)
            return self._get_message(conn, self._latest_leaf(conn, message_id))

    def set_selected_leaf(self, session_id: int, message_id: int | None) -> None:
        """Remember which branch the pane shows (None: follow the newest message)."""
        with self._write() as conn:
            self._get_session(conn, session_id)
            if message_id is not None and self._get_message(conn, message_id).session_id != session_id:
                raise ValueError(f"message {message_id} is not in session {session_id}")
            conn.execute("UPDATE sessions SET selected_leaf_id = ? WHERE id = ?", (message_id, session_id))

    def select_branch(self, message_id: int) -> list[Message]:
        """Show the branch through ``message_id`` (down to its newest leaf); returns the new path.

        This is what the "< 2/3 >" arrows of a turn call with the sibling's id.
        """
        with self._write() as conn:
            message = self._get_message(conn, message_id)
            leaf = self._latest_leaf(conn, message_id)
            conn.execute("UPDATE sessions SET selected_leaf_id = ? WHERE id = ?", (leaf, message.session_id))
            return self._path(conn, leaf)

    # -- search -------------------------------------------------------------------------------

    def search(self, query: str, *, limit: int = 50, mark: tuple[str, str] = ("**", "**")) -> list[SearchHit]:
        """Sessions matching ``query`` (any user text is safe), best first, one hit per session.

        Sessions whose title matches come first, then those whose messages
        match, each group ordered by relevance (bm25). ``mark`` surrounds the
        matched words in the snippet.
        """
        match = fts_query(query)
        if match is None:
            return []
        hits: dict[int, SearchHit] = {}
        with self._read(snapshot=True) as conn:
            for sid, title, snippet in conn.execute(
                "SELECT s.id, s.title, highlight(session_search, 0, ?, ?) "
                "FROM session_search JOIN sessions s ON s.id = session_search.rowid "
                "WHERE session_search MATCH ? ORDER BY bm25(session_search), s.id LIMIT ?",
                (*mark, match, limit),
            ):
                hits.setdefault(sid, SearchHit(sid, title, None, snippet))
            if len(hits) < limit:
                rows = conn.execute(
                    "SELECT m.session_id, s.title, m.id, snippet(message_search, 0, ?, ?, '…', 16) "
                    "FROM message_search JOIN messages m ON m.id = message_search.rowid "
                    "JOIN sessions s ON s.id = m.session_id "
                    "WHERE message_search MATCH ? ORDER BY bm25(message_search), m.id",
                    (*mark, match),
                )
                for sid, title, mid, snippet in rows:
                    hits.setdefault(sid, SearchHit(sid, title, mid, snippet))
                    if len(hits) >= limit:
                        break
        return list(hits.values())[:limit]

    # -- export and import ------------------------------------------------------------------

    def export_markdown(self, session_id: int) -> str:
        """The shown branch as readable Markdown (other branches are left out)."""
        with self._read(snapshot=True) as conn:
            session = self._get_session(conn, session_id)
            leaf = self._shown_leaf(conn, session)
            messages = self._path(conn, leaf) if leaf is not None else []
        return _markdown(session, messages)

    def export_dict(self, session_id: int, *, include_secrets: bool = False) -> dict[str, Any]:
        """The whole session -- every branch, status and metric -- as plain data.

        The backend's API key is left out unless ``include_secrets``: exports get shared.
        """
        with self._read(snapshot=True) as conn:
            session = self._get_session(conn, session_id)
            rows = conn.execute(
                f"SELECT {self._MESSAGE_COLUMNS} FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
            )
            messages = [self._message(row) for row in rows]
        backend = {
            "kind": session.backend.kind,
            "base_url": session.backend.base_url,
            "endpoint": session.backend.endpoint,
        }
        if include_secrets:
            backend["api_key"] = session.backend.api_key
        return {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "session": {
                "id": session.id,
                "title": session.title,
                "created_at": _iso(session.created_at),
                "updated_at": _iso(session.updated_at),
                "model": session.model,
                "system_prompt": session.system_prompt,
                "sampling": session.sampling,
                "backend": backend,
                "selected_leaf_id": session.selected_leaf_id,
                "archived": session.archived,
                "context_fit": session.context_fit,
            },
            "messages": [_message_dict(m) for m in messages],
        }

    def export_json(self, session_id: int, *, include_secrets: bool = False) -> str:
        """:meth:`export_dict` as indented JSON text."""
        return json.dumps(self.export_dict(session_id, include_secrets=include_secrets), indent=2, ensure_ascii=False)

    def import_json(self, text: str | Mapping[str, Any]) -> Session:
        """Add a session from :meth:`export_json` output (new ids; it goes after the other panes).

        Answers that were streaming in the export are imported as ``incomplete``.
        """
        try:
            data = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as exc:
            raise HistoryFormatError(f"not a chatapp session export: invalid JSON ({exc})") from None
        session, messages, selected = _parse_export(data)
        with self._write() as conn:
            position = conn.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM sessions").fetchone()[0]
            cursor = conn.execute(
                "INSERT INTO sessions (title, created_at, updated_at, position, model, system_prompt, sampling, "
                "backend_kind, backend_url, backend_endpoint, backend_api_key, archived, context_fit) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    session["title"],
                    session["created_at"],
                    session["updated_at"],
                    position,
                    session["model"],
                    session["system_prompt"],
                    session["sampling"],
                    *session["backend"],
                    session["archived"],
                    session["context_fit"],
                ),
            )
            new_session = _inserted_id(cursor)
            new_ids: dict[Any, int] = {}
            for old_id, m in messages:  # parents come before their replies (checked by _parse_export)
                cursor = conn.execute(
                    "INSERT INTO messages (session_id, parent_id, role, content, status, created_at, model, "
                    "prompt_tokens, completion_tokens, tokens_per_second, ttft_ms, error, truncated) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        new_session,
                        new_ids.get(m["parent_id"]),
                        m["role"],
                        m["content"],
                        m["status"],
                        m["created_at"],
                        m["model"],
                        m["prompt_tokens"],
                        m["completion_tokens"],
                        m["tokens_per_second"],
                        m["ttft_ms"],
                        m["error"],
                        int(m["truncated"]),
                    ),
                )
                new_ids[old_id] = _inserted_id(cursor)
            conn.execute("UPDATE sessions SET selected_leaf_id = ? WHERE id = ?", (new_ids.get(selected), new_session))
            return self._get_session(conn, new_session)


# -- export helpers -----------------------------------------------------------------------
