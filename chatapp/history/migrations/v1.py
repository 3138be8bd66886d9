"""Schema version 1: sessions, messages and their full-text index."""

from __future__ import annotations

import sqlite3
from typing import Final

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


def migrate(conn: sqlite3.Connection) -> None:
    """The first release's schema."""
    for statement in _V1:
        conn.execute(statement)
