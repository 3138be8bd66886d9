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

import json
import os
import re
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

try:  # advisory locks mark live writers; not available on Windows
    import fcntl
except ImportError:  # pragma: no cover - exercised only on Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DB_FILENAME",
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

DB_FILENAME: Final = "history.sqlite3"
EXPORT_FORMAT: Final = "chatapp-session"
EXPORT_VERSION: Final = 1

Role = Literal["system", "user", "assistant"]
Status = Literal["complete", "streaming", "incomplete", "error"]
ROLES: Final = ("system", "user", "assistant")
STATUSES: Final = ("complete", "streaming", "incomplete", "error")
FINAL_STATUSES: Final = ("complete", "incomplete", "error")


# -- errors ---------------------------------------------------------------


class HistoryError(Exception):
    """Base class: something about the chat history went wrong (message is user-readable)."""


class HistoryWriteError(HistoryError):
    """A change could not be saved (disk full, read-only, locked too long...).

    The change was rolled back; everything saved earlier is intact. The UI
    should tell the user and keep the chat in memory.
    """


class HistoryOpenError(HistoryError):
    """The history file cannot be opened (not a database, unreadable, upgrade failed)."""


class HistoryVersionError(HistoryOpenError):
    """The file was written by a newer chatapp; it is left untouched."""


class HistoryNotFoundError(HistoryError, LookupError):
    """No session or message with that id (it may have been deleted by another window)."""


class HistoryFormatError(HistoryError, ValueError):
    """An imported session file is not in chatapp's export format."""


# -- records returned to callers --------------------------------------------


@dataclass(frozen=True, slots=True)
class Backend:
    """Where a session's answers come from: the local engine or a remote OpenAI-compatible server.

    For a remote server, prefer ``endpoint`` (the name of an endpoint in the
    settings file, which holds the URL and key) over storing ``api_key`` here:
    keys in the history file end up in backups. ``base_url`` overrides the
    endpoint's URL when both are given. The model name is ``Session.model``.
    """

    kind: Literal["local", "remote"] = "local"
    base_url: str | None = None
    endpoint: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "local":
            if self.base_url or self.endpoint or self.api_key:
                raise ValueError("a local backend takes no base_url, endpoint or api_key")
        elif self.kind == "remote":
            if not (self.base_url or self.endpoint):
                raise ValueError("a remote backend needs a base_url or the name of an endpoint from the settings")
            if self.base_url and not re.match(r"https?://", self.base_url):
                raise ValueError(f"a remote base_url must start with http:// or https://, got {self.base_url!r}")
        else:
            raise ValueError(f"backend kind must be 'local' or 'remote', got {self.kind!r}")

    @classmethod
    def local(cls) -> Backend:
        return cls("local")

    @classmethod
    def remote(cls, base_url: str | None = None, *, endpoint: str | None = None, api_key: str | None = None) -> Backend:
        return cls("remote", base_url=base_url, endpoint=endpoint, api_key=api_key)


@dataclass(frozen=True, slots=True)
class Metrics:
    """The numbers shown under an answer; any may be unknown (None)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_per_second: float | None = None
    ttft_ms: float | None = None
    """Time to first token, in milliseconds."""

    def is_empty(self) -> bool:
        return all(
            v is None for v in (self.prompt_tokens, self.completion_tokens, self.tokens_per_second, self.ttft_ms)
        )

    def describe(self, *, with_prompt: bool = False) -> str:
        """'87.3 tok/s · 42 tokens · 0.21 s to first token', as LM Studio shows under an answer; the one
        wording for the TUI and exports (``with_prompt`` adds the prompt's token count)."""
        parts = []
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.completion_tokens is not None:
            parts.append(f"{self.completion_tokens} tokens")
        if with_prompt and self.prompt_tokens is not None:
            parts.append(f"{self.prompt_tokens} prompt tokens")
        if self.ttft_ms is not None:
            parts.append(f"{self.ttft_ms / 1000:.2f} s to first token")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class Session:
    """One chat pane: its settings and which branch of its tree is shown."""

    id: int
    title: str
    created_at: float
    updated_at: float
    position: int
    """Order of the panes (0 first); archived sessions come after the others."""
    model: str | None
    system_prompt: str
    sampling: dict[str, Any]
    backend: Backend
    selected_leaf_id: int | None
    """The message whose root path is shown; None means the newest message."""
    archived: bool


@dataclass(frozen=True, slots=True)
class Message:
    """One node of a session's message tree."""

    id: int
    session_id: int
    parent_id: int | None
    role: Role
    content: str
    status: Status
    created_at: float
    model: str | None = None
    metrics: Metrics | None = None
    error: str | None = None
    """Why the answer failed, when ``status == "error"``."""


@dataclass(frozen=True, slots=True)
class Siblings:
    """The branches of one turn, oldest first, and where a given message is among them."""

    messages: list[Message]
    index: int

    @property
    def count(self) -> int:
        return len(self.messages)


@dataclass(frozen=True, slots=True)
class SearchHit:
    """A session matching a search, with its best matching text.

    ``message_id`` is None when the title matched; otherwise the TUI can show
    that message with :meth:`HistoryStore.select_branch`.
    """

    session_id: int
    title: str
    message_id: int | None
    snippet: str


# -- schema -----------------------------------------------------------------

_TOKENIZER = "tokenize = 'unicode61 remove_diacritics 2'"

_V1: Final = (
    """CREATE TABLE sessions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        position INTEGER NOT NULL DEFAULT 0,
        model TEXT,
        system_prompt TEXT NOT NULL DEFAULT '',
        sampling TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(sampling)),
        backend_kind TEXT NOT NULL DEFAULT 'local' CHECK (backend_kind IN ('local', 'remote')),
        backend_url TEXT,
        backend_endpoint TEXT,
        backend_api_key TEXT,
        selected_leaf_id INTEGER REFERENCES messages(id) ON DELETE SET NULL,
        archived INTEGER NOT NULL DEFAULT 0 CHECK (archived IN (0, 1))
    )""",
    """CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        -- No ON DELETE CASCADE here: cascades recurse once per tree level and
        -- SQLite stops at 1000 levels; delete_message removes a subtree itself.
        parent_id INTEGER REFERENCES messages(id),
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'complete'
            CHECK (status IN ('complete', 'streaming', 'incomplete', 'error')),
        created_at REAL NOT NULL,
        model TEXT,
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        tokens_per_second REAL,
        ttft_ms REAL,
        error TEXT,
        writer TEXT -- the store streaming this message; NULL once it is final
    )""",
    "CREATE INDEX messages_by_parent ON messages(parent_id)",
    "CREATE INDEX messages_by_session ON messages(session_id, parent_id)",
    "CREATE INDEX messages_streaming ON messages(writer) WHERE status = 'streaming'",
    "CREATE INDEX sessions_by_selected ON sessions(selected_leaf_id)",
    # Full-text search. These FTS tables keep their own copy of the text (not
    # "external content"): a row can then be deleted by rowid alone, which
    # keeps the triggers simple and the index impossible to desynchronise.
    # Streaming messages are indexed once they stop streaming, so the frequent
    # partial updates never touch the index.
    f"CREATE VIRTUAL TABLE message_search USING fts5(content, {_TOKENIZER})",
    f"CREATE VIRTUAL TABLE session_search USING fts5(title, {_TOKENIZER})",
    """CREATE TRIGGER messages_ai AFTER INSERT ON messages WHEN new.status <> 'streaming' BEGIN
        INSERT INTO message_search(rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER messages_au AFTER UPDATE OF content, status ON messages
    WHEN old.status <> 'streaming' OR new.status <> 'streaming' BEGIN
        DELETE FROM message_search WHERE rowid = old.id;
        INSERT INTO message_search(rowid, content)
            SELECT new.id, new.content WHERE new.status <> 'streaming';
    END""",
    """CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
        DELETE FROM message_search WHERE rowid = old.id;
    END""",
    """CREATE TRIGGER sessions_ai AFTER INSERT ON sessions BEGIN
        INSERT INTO session_search(rowid, title) VALUES (new.id, new.title);
    END""",
    """CREATE TRIGGER sessions_au AFTER UPDATE OF title ON sessions BEGIN
        DELETE FROM session_search WHERE rowid = old.id;
        INSERT INTO session_search(rowid, title) VALUES (new.id, new.title);
    END""",
    """CREATE TRIGGER sessions_ad AFTER DELETE ON sessions BEGIN
        DELETE FROM session_search WHERE rowid = old.id;
    END""",
)


def _migrate_to_v1(conn: sqlite3.Connection) -> None:
    """The first release's schema."""
    for statement in _V1:
        conn.execute(statement)


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_migrate_to_v1]
"""Migration i brings a database from version i to i + 1. Only ever append."""


def schema_version() -> int:
    """The schema version this code writes (the number of migrations)."""
    return len(MIGRATIONS)


def default_path() -> Path:
    """The history file under the user's data directory."""
    from chatapp import paths

    return paths.data_dir() / DB_FILENAME


# -- live-writer locks ----------------------------------------------------------

_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_open_locks: weakref.WeakSet[_WriterLock] = weakref.WeakSet()


class _WriterLock:
    """An exclusively locked file that exists while this store is open.

    Streaming messages are tagged with the store's token; another process
    that finds the token's lock file unlocked knows the writer died (the OS
    drops the lock even on SIGKILL) and may mark its answers incomplete.
    """

    def __init__(self, directory: Path) -> None:
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        if fcntl is None:  # pragma: no cover - Windows: no liveness check
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{self.token}.lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _open_locks.add(self)

    def release(self) -> None:
        if self._fd is None:
            return
        with suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)  # closing drops the lock
        self._fd = None

    def _forget_in_child(self) -> None:
        """After fork: close the child's copy, so the lock dies with the parent alone."""
        if self._fd is not None:
            with suppress(OSError):
                os.close(self._fd)
            self._fd = None

    @staticmethod
    def is_alive(directory: Path, token: str | None) -> bool:
        """Whether the store with this token is still open, in any process."""
        if fcntl is None or token is None or not _TOKEN_RE.fullmatch(token):
            return False
        path = directory / f"{token}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False  # its owner removed it on close, or a sweeper did after its death
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            with suppress(OSError):
                os.unlink(path)  # a dead writer's leftover
            return False
        finally:
            os.close(fd)

    @staticmethod
    def sweep(directory: Path) -> None:
        """Remove lock files left by writers that died."""
        with suppress(OSError):
            for entry in directory.iterdir():
                if entry.suffix == ".lock":
                    _WriterLock.is_alive(directory, entry.stem)


def _after_fork_in_child() -> None:
    for lock in list(_open_locks):
        lock._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _from_iso(text: Any, what: str) -> float:
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise HistoryFormatError(f"{what}: expected an ISO 8601 time, got {text!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _sampling_json(sampling: Mapping[str, Any] | None) -> str:
    if sampling is None:
        return "{}"
    if not isinstance(sampling, Mapping) or not all(isinstance(k, str) for k in sampling):
        raise ValueError("sampling parameters must be a mapping with string keys")
    try:
        return json.dumps(dict(sampling), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sampling parameters must be JSON values: {exc}") from None


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
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
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

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.db_path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise HistoryOpenError(f"cannot open the chat history {self.db_path}: {_reason(exc)}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")
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
        if found > schema_version():
            raise HistoryVersionError(
                f"the chat history {self.db_path} was written by a newer chatapp (schema version {found}; "
                f"this one knows up to {schema_version()}). Upgrade chatapp; the file was not changed."
            )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Bring the file up to :func:`schema_version` in one transaction (all or nothing)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have upgraded it
            self._check_version(found)
            for version in range(found, schema_version()):
                MIGRATIONS[version](conn)
            if found != schema_version():
                conn.execute(f"PRAGMA user_version = {schema_version()}")
            conn.execute("COMMIT")
        except BaseException as exc:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise HistoryOpenError(
                    f"cannot upgrade the chat history {self.db_path} to schema version {schema_version()}: "
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
    )
    _MESSAGE_COLUMNS: Final = ", ".join(_MESSAGE_FIELDS)
    _MESSAGE_COLUMNS_M: Final = ", ".join("m." + name for name in _MESSAGE_FIELDS)

    @staticmethod
    def _session(row: tuple[Any, ...]) -> Session:
        (
            sid,
            title,
            created,
            updated,
            position,
            model,
            system_prompt,
            sampling,
            kind,
            url,
            endpoint,
            api_key,
            leaf,
            archived,
        ) = row
        return Session(
            sid,
            title,
            created,
            updated,
            position,
            model,
            system_prompt,
            json.loads(sampling),
            Backend(kind, url, endpoint, api_key),
            leaf,
            bool(archived),
        )

    @staticmethod
    def _message(row: tuple[Any, ...]) -> Message:
        (
            mid,
            sid,
            parent,
            role,
            content,
            status,
            created,
            model,
            prompt_tokens,
            completion_tokens,
            tps,
            ttft,
            error,
        ) = row
        metrics = Metrics(prompt_tokens, completion_tokens, tps, ttft)
        return Message(
            mid, sid, parent, role, content, status, created, model, None if metrics.is_empty() else metrics, error
        )

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
            return self._get_session(conn, cursor.lastrowid)

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
    ) -> Session:
        """Change only the fields given. Archiving or restoring moves the session to the end."""
        changes: dict[str, Any] = {}
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
            message_id = cursor.lastrowid
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
    ) -> Message:
        """Store an answer's final text, status and metrics."""
        _check_choice(status, FINAL_STATUSES, "a finished message's status")
        metrics = metrics or Metrics()
        now = time.time()
        with self._write() as conn:
            message = self._get_message(conn, message_id)
            conn.execute(
                "UPDATE messages SET content = ?, status = ?, writer = NULL, error = ?, prompt_tokens = ?, "
                "completion_tokens = ?, tokens_per_second = ?, ttft_ms = ? WHERE id = ?",
                (
                    content,
                    status,
                    error,
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
                "backend_kind, backend_url, backend_endpoint, backend_api_key, archived) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
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
                ),
            )
            new_session = cursor.lastrowid
            new_ids: dict[Any, int] = {}
            for old_id, m in messages:  # parents come before their replies (checked by _parse_export)
                cursor = conn.execute(
                    "INSERT INTO messages (session_id, parent_id, role, content, status, created_at, model, "
                    "prompt_tokens, completion_tokens, tokens_per_second, ttft_ms, error) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
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
                    ),
                )
                new_ids[old_id] = cursor.lastrowid
            conn.execute("UPDATE sessions SET selected_leaf_id = ? WHERE id = ?", (new_ids.get(selected), new_session))
            return self._get_session(conn, new_session)


# -- export helpers -----------------------------------------------------------------------


def _message_dict(m: Message) -> dict[str, Any]:
    metrics = m.metrics or Metrics()
    return {
        "id": m.id,
        "parent_id": m.parent_id,
        "role": m.role,
        "content": m.content,
        "status": m.status,
        "created_at": _iso(m.created_at),
        "model": m.model,
        "metrics": {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.completion_tokens,
            "tokens_per_second": metrics.tokens_per_second,
            "ttft_ms": metrics.ttft_ms,
        },
        "error": m.error,
    }


def _markdown(session: Session, messages: list[Message]) -> str:
    lines = [f"# {session.title or 'Untitled chat'}", ""]
    backend = session.backend
    where = "local engine" if backend.kind == "local" else (backend.endpoint or backend.base_url or "remote")
    lines.append(f"- Model: {session.model or 'default'} ({where})")
    lines.append(f"- Started: {datetime.fromtimestamp(session.created_at, UTC):%Y-%m-%d %H:%M} UTC")
    lines.append("")
    if session.system_prompt:
        lines += ["## System prompt", "", session.system_prompt, ""]
    for m in messages:
        heading = m.role.capitalize() + (f" ({m.model})" if m.role == "assistant" and m.model else "")
        lines += [f"## {heading}", "", m.content, ""]
        if m.status == "incomplete":
            lines += ["> *This answer is incomplete: it was interrupted.*", ""]
        elif m.status == "streaming":
            lines += ["> *This answer was still being written when exported.*", ""]
        elif m.status == "error":
            lines += [f"> *Error: {m.error or 'the answer failed'}*", ""]
        if m.metrics is not None:
            lines += [f"*{m.metrics.describe(with_prompt=True)}*", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _field(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    """obj[key] checked against ``kinds`` (a bool is not accepted as a number)."""
    value = obj.get(key)
    if value is None and optional:
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise HistoryFormatError(f"{where}.{key}: unexpected value {value!r}")
    return value


def _parse_export(data: Any) -> tuple[dict[str, Any], list[tuple[Any, dict[str, Any]]], Any]:
    """Validate an export and return (session columns, [(old id, message columns)], selected old id)."""
    if not isinstance(data, Mapping) or data.get("format") != EXPORT_FORMAT:
        raise HistoryFormatError(f'not a chatapp session export (its "format" is not {EXPORT_FORMAT!r})')
    if data.get("version") != EXPORT_VERSION:
        raise HistoryFormatError(
            f"unsupported chatapp export version {data.get('version')!r} (this chatapp reads version {EXPORT_VERSION})"
        )
    s = data.get("session")
    if not isinstance(s, Mapping):
        raise HistoryFormatError('the export has no "session" object')
    b = _field(s, "backend", Mapping, "session")
    try:
        backend = Backend(
            _field(b, "kind", str, "session.backend"), b.get("base_url"), b.get("endpoint"), b.get("api_key")
        )
    except (ValueError, TypeError) as exc:
        raise HistoryFormatError(f"session.backend: {exc}") from None
    try:
        sampling = _sampling_json(_field(s, "sampling", Mapping, "session"))
    except ValueError as exc:
        raise HistoryFormatError(f"session.sampling: {exc}") from None
    session = {
        "title": _field(s, "title", str, "session"),
        "created_at": _from_iso(s.get("created_at"), "session.created_at"),
        "updated_at": _from_iso(s.get("updated_at"), "session.updated_at"),
        "model": _field(s, "model", str, "session", optional=True),
        "system_prompt": _field(s, "system_prompt", str, "session"),
        "sampling": sampling,
        "backend": (backend.kind, backend.base_url, backend.endpoint, backend.api_key),
        "archived": int(bool(_field(s, "archived", bool, "session"))),
    }
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list):
        raise HistoryFormatError('the export has no "messages" list')
    seen: set[Any] = set()
    messages: list[tuple[Any, dict[str, Any]]] = []
    for i, m in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise HistoryFormatError(f"{where}: expected an object")
        old_id = _field(m, "id", int, where)
        parent = _field(m, "parent_id", int, where, optional=True)
        if parent is not None and parent not in seen:
            raise HistoryFormatError(f"{where}: its parent {parent} is missing or comes after it")
        if old_id in seen:
            raise HistoryFormatError(f"{where}: duplicate id {old_id}")
        seen.add(old_id)
        role = _field(m, "role", str, where)
        status = _field(m, "status", str, where)
        if role not in ROLES or status not in STATUSES:
            raise HistoryFormatError(f"{where}: unknown role {role!r} or status {status!r}")
        metrics = m.get("metrics") or {}
        if not isinstance(metrics, Mapping):
            raise HistoryFormatError(f"{where}.metrics: expected an object")
        messages.append(
            (
                old_id,
                {
                    "parent_id": parent,
                    "role": role,
                    "content": _field(m, "content", str, where),
                    "status": "incomplete" if status == "streaming" else status,
                    "created_at": _from_iso(m.get("created_at"), f"{where}.created_at"),
                    "model": _field(m, "model", str, where, optional=True),
                    "prompt_tokens": _field(metrics, "prompt_tokens", int, f"{where}.metrics", optional=True),
                    "completion_tokens": _field(metrics, "completion_tokens", int, f"{where}.metrics", optional=True),
                    "tokens_per_second": _field(
                        metrics, "tokens_per_second", (int, float), f"{where}.metrics", optional=True
                    ),
                    "ttft_ms": _field(metrics, "ttft_ms", (int, float), f"{where}.metrics", optional=True),
                    "error": _field(m, "error", str, where, optional=True),
                },
            )
        )
    selected = s.get("selected_leaf_id")
    if selected is not None and selected not in seen:
        raise HistoryFormatError(f"session.selected_leaf_id: no message has id {selected!r}")
    return session, messages, selected
