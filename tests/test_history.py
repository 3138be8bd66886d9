"""The chat history store: sessions, message trees, crash safety, search, export, failures."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp import history
from chatapp.history import (
    Backend,
    HistoryError,
    HistoryFormatError,
    HistoryNotFoundError,
    HistoryOpenError,
    HistoryStore,
    HistoryVersionError,
    HistoryWriteError,
    Metrics,
    fts_query,
    schema_version,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "history.sqlite3"


@pytest.fixture
def store(db_path: Path):
    with HistoryStore(db_path) as s:
        yield s


def raw(path: Path) -> sqlite3.Connection:
    """A plain connection, to look at the file the way another program would."""
    return sqlite3.connect(path, isolation_level=None)


def conversation(store: HistoryStore):
    """A session with a user turn, two answers to it, and an edited user turn (a sibling)."""
    s = store.create_session("Arithmetic", model="tiny")
    q = store.add_message(s.id, None, "user", "What is 2+2?")
    a1 = store.add_message(s.id, q.id, "assistant", "It is 4.", model="tiny")
    a2 = store.add_message(s.id, q.id, "assistant", "Four.", model="tiny")
    q2 = store.add_message(s.id, None, "user", "What is 3+3?")
    return s, q, a1, a2, q2


# -- opening and schema ----------------------------------------------------------------------


def test_new_file_uses_wal_foreign_keys_and_current_version(store, db_path):
    assert db_path.exists()
    conn = raw(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema_version() >= 1
    assert store._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_default_location_is_the_data_dir():
    from chatapp import paths

    with HistoryStore() as store:
        assert store.db_path == paths.data_dir() / history.DB_FILENAME
        assert store.db_path.is_relative_to(Path(os.environ["CHATAPP_DATA_DIR"]))


def test_newer_database_is_refused_and_left_unchanged(db_path):
    conn = raw(db_path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute(f"PRAGMA user_version = {schema_version() + 1}")
    conn.close()
    before = hashlib.sha256(db_path.read_bytes()).hexdigest()
    with pytest.raises(HistoryVersionError, match="newer chatapp"):
        HistoryStore(db_path)
    assert hashlib.sha256(db_path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in db_path.parent.iterdir() if p.name.startswith(db_path.name)) == [db_path.name]


def test_older_database_is_upgraded_keeping_its_data(db_path, monkeypatch):
    with HistoryStore(db_path) as store:
        s = store.create_session("kept")
        store.add_message(s.id, None, "user", "hello")

    def add_pinned(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")

    current = len(history.MIGRATIONS)
    monkeypatch.setattr(history.migrations, "MIGRATIONS", [*history.MIGRATIONS, add_pinned])
    with HistoryStore(db_path) as store:
        assert [m.content for m in store.path(s.id)] == ["hello"]
        assert store._conn.execute("SELECT pinned FROM sessions").fetchall() == [(0,)]
    assert raw(db_path).execute("PRAGMA user_version").fetchone()[0] == current + 1


def test_failed_upgrade_rolls_back_completely(db_path, monkeypatch):
    with HistoryStore(db_path) as store:
        store.create_session("kept")

    def half_done(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER")
        conn.execute("THIS IS NOT SQL")

    current = len(history.MIGRATIONS)
    monkeypatch.setattr(history.migrations, "MIGRATIONS", [*history.MIGRATIONS, half_done])
    with pytest.raises(HistoryOpenError, match="cannot upgrade .* left as it was"):
        HistoryStore(db_path)
    conn = raw(db_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == current
    columns = [row[1] for row in conn.execute("PRAGMA table_info(sessions)")]
    assert "pinned" not in columns
    assert conn.execute("SELECT title FROM sessions").fetchall() == [("kept",)]


def test_a_file_that_is_not_a_database_gives_a_clear_error(db_path):
    db_path.write_text("these are my notes, not a database\n" * 100)
    with pytest.raises(HistoryOpenError, match="not a chatapp history database"):
        HistoryStore(db_path)
    assert db_path.read_text().startswith("these are my notes")


def test_closed_store_raises_history_error(db_path):
    store = HistoryStore(db_path)
    store.close()
    with pytest.raises(HistoryError, match="closed"):
        store.list_sessions()


# -- sessions --------------------------------------------------------------------------------


def test_session_fields_round_trip(store):
    s = store.create_session(
        "Remote",
        model="gpt-x",
        system_prompt="Be brief.",
        sampling={"temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"]},
        backend=Backend.remote("https://example.test/v1", api_key="sk-1"),
    )
    got = store.get_session(s.id)
    assert got == s
    assert got.title == "Remote" and got.model == "gpt-x" and got.system_prompt == "Be brief."
    assert got.sampling == {"temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"]}
    assert got.backend == Backend("remote", "https://example.test/v1", None, "sk-1")
    assert got.selected_leaf_id is None and not got.archived
    assert got.created_at == got.updated_at > 0


def test_update_session_changes_only_given_fields(store):
    s = store.create_session("a", model="m1", sampling={"temperature": 1.0})
    u = store.update_session(s.id, model="m2", backend=Backend.remote(endpoint="work"))
    assert (u.title, u.model, u.sampling) == ("a", "m2", {"temperature": 1.0})
    assert u.backend == Backend("remote", endpoint="work")
    assert u.updated_at >= s.updated_at
    assert store.rename_session(s.id, "b").title == "b"
    assert store.update_session(s.id, model=None).model is None


def test_sessions_are_listed_in_pane_order_and_can_be_moved(store):
    a, b, c = (store.create_session(t) for t in "abc")
    assert [s.title for s in store.list_sessions()] == ["a", "b", "c"]
    assert [s.title for s in store.move_session(c.id, 0)] == ["c", "a", "b"]
    assert [s.title for s in store.move_session(c.id, 99)] == ["a", "b", "c"]
    store.update_session(a.id, archived=True)
    assert [s.title for s in store.list_sessions()] == ["b", "c"]
    assert [s.title for s in store.list_sessions(include_archived=True)] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="archived"):
        store.move_session(a.id, 0)
    store.update_session(a.id, archived=False)
    assert [s.title for s in store.list_sessions()] == ["b", "c", "a"]


def test_delete_session_removes_its_messages(store):
    s, *_ = conversation(store)
    other = store.create_session("other")
    store.add_message(other.id, None, "user", "stays")
    store.delete_session(s.id)
    assert [x.id for x in store.list_sessions()] == [other.id]
    assert store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1
    with pytest.raises(HistoryNotFoundError):
        store.get_session(s.id)
    with pytest.raises(HistoryNotFoundError):
        store.delete_session(s.id)


@pytest.mark.parametrize(
    "bad",
    [
        {"sampling": {"seed": object()}},
        {"sampling": {1: 2}},
        {"sampling": {"t": float("nan")}},
    ],
)
def test_bad_session_values_are_rejected_clearly(store, bad):
    with pytest.raises(ValueError, match="sampling"):
        store.create_session("x", **bad)
    assert store.list_sessions() == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "local", "base_url": "http://x"}, "local backend"),
        ({"kind": "remote"}, "needs a base_url"),
        ({"kind": "remote", "base_url": "ftp://x"}, "http"),
        ({"kind": "cloud"}, "'local' or 'remote'"),
    ],
)
def test_bad_backends_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Backend(**kwargs)


# -- messages and the tree -----------------------------------------------------------------------


def test_branches_siblings_and_paths(store):
    s, q, a1, a2, q2 = conversation(store)
    # Adding a message shows its branch.
    assert [m.id for m in store.path(s.id)] == [q2.id]
    sib = store.siblings(a1.id)
    assert [m.id for m in sib.messages] == [a1.id, a2.id] and sib.index == 0 and sib.count == 2
    assert store.siblings(a2.id).index == 1
    roots = store.siblings(q2.id)
    assert [m.id for m in roots.messages] == [q.id, q2.id] and roots.index == 1
    assert [m.id for m in store.children(q.id)] == [a1.id, a2.id]
    assert [m.id for m in store.children(None, session_id=s.id)] == [q.id, q2.id]
    # Follow the first turn down: its newest leaf is the second answer.
    assert store.latest_leaf(q.id).id == a2.id
    assert [m.id for m in store.select_branch(q.id)] == [q.id, a2.id]
    assert store.get_session(s.id).selected_leaf_id == a2.id
    assert [m.id for m in store.select_branch(a1.id)] == [q.id, a1.id]
    assert [m.id for m in store.path(s.id)] == [q.id, a1.id]
    assert [m.id for m in store.path(s.id, a2.id)] == [q.id, a2.id]


def test_latest_leaf_follows_the_most_recent_activity(store):
    s = store.create_session()
    q = store.add_message(s.id, None, "user", "q")
    old = store.add_message(s.id, q.id, "assistant", "old")
    store.add_message(s.id, q.id, "assistant", "newer sibling")
    deep = store.add_message(s.id, old.id, "user", "continued the old branch later")
    assert store.latest_leaf(q.id).id == deep.id
    assert store.latest_leaf(deep.id).id == deep.id


def test_selected_leaf_is_kept_and_validated(store):
    s, q, a1, a2, q2 = conversation(store)
    store.set_selected_leaf(s.id, a1.id)
    store.add_message(s.id, q.id, "assistant", "background", select=False)
    assert [m.id for m in store.path(s.id)] == [q.id, a1.id]
    other = store.create_session()
    with pytest.raises(ValueError, match="not in session"):
        store.set_selected_leaf(other.id, a1.id)
    with pytest.raises(ValueError, match="not in session"):
        store.path(other.id, a1.id)
    store.set_selected_leaf(s.id, None)  # None: follow the newest message
    assert store.path(s.id)[-1].content == "background"
    assert store.path(other.id) == []


def test_add_message_validates_its_input(store):
    s, q, *_ = conversation(store)
    other = store.create_session()
    with pytest.raises(ValueError, match="role"):
        store.add_message(s.id, q.id, "robot", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="belongs to session"):
        store.add_message(other.id, q.id, "assistant", "x")
    with pytest.raises(HistoryNotFoundError, match="no chat session"):
        store.add_message(12345, None, "user", "x")
    with pytest.raises(HistoryNotFoundError, match="no message"):
        store.add_message(s.id, 12345, "user", "x")


def test_delete_message_removes_its_branch_only(store):
    s, q, a1, a2, q2 = conversation(store)
    follow = store.add_message(s.id, a1.id, "user", "and then?")
    store.select_branch(follow.id)
    store.delete_message(a1.id)
    with pytest.raises(HistoryNotFoundError):
        store.get_message(follow.id)
    assert [m.id for m in store.children(q.id)] == [a2.id]
    # The shown branch is gone: the pane falls back to the newest message.
    assert store.get_session(s.id).selected_leaf_id is None
    assert [m.id for m in store.path(s.id)] == [q2.id]
    assert store.search("then") == []


def test_very_deep_trees_work(store):
    """Long chats are deep trees; nothing may hit SQLite's 1000-level recursion limit."""
    depth = 1500
    export = {
        "format": "chatapp-session",
        "version": 1,
        "session": {
            "title": "long",
            "created_at": "2025-01-01T00:00:00+00:00",
            "updated_at": "2025-01-01T00:00:00+00:00",
            "model": None,
            "system_prompt": "",
            "sampling": {},
            "backend": {"kind": "local"},
            "selected_leaf_id": depth - 1,
            "archived": False,
        },
        "messages": [
            {
                "id": i,
                "parent_id": i - 1 if i else None,
                "role": "user",
                "content": f"m{i}",
                "status": "complete",
                "created_at": "2025-01-01T00:00:00+00:00",
            }
            for i in range(depth)
        ],
    }
    s = store.import_json(json.dumps(export))
    path = store.path(s.id)
    assert len(path) == depth and path[0].content == "m0" and path[-1].content == f"m{depth - 1}"
    assert store.latest_leaf(path[0].id).id == path[-1].id
    store.delete_message(path[1].id)
    assert [m.content for m in store.path(s.id)] == ["m0"]
    store.delete_session(s.id)
    assert store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


# -- streaming answers -------------------------------------------------------------------------


def test_streaming_answer_lifecycle(store):
    s = store.create_session()
    q = store.add_message(s.id, None, "user", "Tell me a story")
    a = store.start_answer(s.id, q.id, model="tiny")
    assert (a.role, a.status, a.content, a.metrics) == ("assistant", "streaming", "", None)
    store.update_partial(a.id, "Once upon")
    store.update_partial(a.id, "Once upon a time")
    assert store.get_message(a.id).content == "Once upon a time"
    assert store.search("upon") == []  # streaming text is indexed when it ends
    done = store.finish_message(
        a.id,
        "Once upon a time, the end.",
        metrics=Metrics(prompt_tokens=12, completion_tokens=7, tokens_per_second=31.5, ttft_ms=85.0),
    )
    assert done.status == "complete"
    assert done.metrics == Metrics(12, 7, 31.5, 85.0)
    assert store.get_message(a.id) == done
    assert [h.message_id for h in store.search("upon")] == [a.id]
    with pytest.raises(HistoryError, match="not streaming"):
        store.update_partial(a.id, "too late")
    assert store.get_message(a.id).content == "Once upon a time, the end."


def test_failed_answer_keeps_its_error(store):
    s = store.create_session()
    q = store.add_message(s.id, None, "user", "hi")
    a = store.start_answer(s.id, q.id)
    done = store.finish_message(a.id, "partial", status="error", error="connection reset")
    assert (done.status, done.error, done.content) == ("error", "connection reset", "partial")
    with pytest.raises(ValueError, match="status"):
        store.finish_message(a.id, "x", status="streaming")


_CRASHING_WRITER = textwrap.dedent("""
    import json, sys
    from chatapp.history import HistoryStore
    store = HistoryStore(sys.argv[1])
    s = store.create_session("crash test")
    q = store.add_message(s.id, None, "user", "count for me")
    a = store.start_answer(s.id, q.id, model="tiny")
    text = ""
    for i in range(5):
        text += f"{i} "
        store.update_partial(a.id, text)
    print(json.dumps({"session": s.id, "answer": a.id, "saved": text}), flush=True)
    i = 5
    while True:  # keep streaming until killed
        text += f"{i} "
        store.update_partial(a.id, text)
        i += 1
""")


def test_answer_streaming_when_the_process_is_killed_is_kept_as_incomplete(db_path):
    child = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(db_path)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    info = json.loads(line)
    with HistoryStore(db_path) as store:
        assert store._conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        answer = store.get_message(info["answer"])
        assert answer.status == "incomplete"
        assert answer.content.startswith(info["saved"])  # at least what was saved before the signal
        assert [m.role for m in store.path(info["session"])] == ["user", "assistant"]
        assert [h.message_id for h in store.search("0 1 2 3 4")] == [answer.id]  # indexed once final
        assert list(store._writer_dir.iterdir()) == [store._writer.path]  # the dead writer's lock was swept


def test_a_live_writers_answer_is_not_marked_incomplete(db_path):
    with HistoryStore(db_path) as first:
        s = first.create_session()
        q = first.add_message(s.id, None, "user", "hi")
        a = first.start_answer(s.id, q.id)
        first.update_partial(a.id, "still going")
        with HistoryStore(db_path) as second:  # another window opens the same file
            assert second.get_message(a.id).status == "streaming"
        first.update_partial(a.id, "still going strong")
        assert first.finish_message(a.id, "done").status == "complete"


def test_closing_keeps_an_unfinished_answer_as_incomplete(db_path):
    with HistoryStore(db_path) as store:
        s = store.create_session()
        q = store.add_message(s.id, None, "user", "hi")
        a = store.start_answer(s.id, q.id)
        store.update_partial(a.id, "half an ans")
    with HistoryStore(db_path) as store:
        assert (store.get_message(a.id).status, store.get_message(a.id).content) == ("incomplete", "half an ans")


# -- search ----------------------------------------------------------------------------------------


def test_search_returns_one_ranked_hit_per_session_with_snippets(store):
    s1, q, a1, a2, q2 = conversation(store)
    s2 = store.create_session("Cooking")
    store.add_message(s2.id, None, "user", "How long do I boil an egg? Is 4 minutes enough?")
    s3 = store.create_session("Four seasons")
    hits = store.search("four")
    assert [h.session_id for h in hits] == [s3.id, s1.id]  # title matches first
    assert hits[0].message_id is None and hits[0].snippet == "**Four** seasons"
    assert hits[1].message_id == a2.id and hits[1].snippet == "**Four**."
    assert [h.session_id for h in store.search("boil")] == [s2.id]
    assert store.search("egg", mark=("[", "]"))[0].snippet.count("[egg]") == 1
    assert [h.session_id for h in store.search("min")] == [s2.id]  # the last word is a prefix
    assert store.search("   ") == []
    assert len(store.search("four", limit=1)) == 1


def test_search_follows_renames_edits_and_deletes(store):
    s = store.create_session("Old title")
    m = store.add_message(s.id, None, "user", "zebra")
    store.rename_session(s.id, "Shiny")
    assert store.search("old") == [] and store.search("shiny")[0].session_id == s.id
    a = store.start_answer(s.id, m.id)
    store.finish_message(a.id, "giraffe")
    store.finish_message(a.id, "okapi")  # re-finishing replaces the indexed text
    assert store.search("giraffe") == [] and store.search("okapi")[0].message_id == a.id
    store.delete_session(s.id)
    assert store.search("zebra") == [] and store.search("shiny") == []


@pytest.mark.parametrize(
    "query",
    [
        '"',
        '"unbalanced',
        "(",
        "a)",
        "c++",
        "-x",
        "foo:bar",
        "*",
        "NOT",
        "a OR",
        "NEAR(a b)",
        "^start",
        "title:x",
        "'",
        "\x00",
        "✓ 😀",
    ],
)
def test_search_accepts_fts_syntax_characters(store, query):
    """FTS syntax in a query is text, never syntax: no error, and a hit exactly when its words are there
    (each space-separated term is a phrase of the words in it, the last one a prefix)."""
    s = store.create_session("c++ and foo:bar")
    store.add_message(s.id, None, "user", "c++ foo:bar -x (a) NOT")
    found = query in ("a)", "c++", "-x", "foo:bar", "NOT")  # "a OR": no word starts "or"; "NEAR(a": not there
    assert [hit.session_id for hit in store.search(query)] == ([s.id] if found else [])


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    with HistoryStore(tmp_path_factory.mktemp("search") / "h.sqlite3") as s:
        session = s.create_session("some title")
        s.add_message(session.id, None, "user", 'quotes " and * and (parens) and col:on')
        yield s


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text())
def test_search_never_raises_on_any_text(shared_store, query):
    hits = shared_store.search(query)
    assert isinstance(hits, list)


def test_fts_query_quotes_every_word():
    assert fts_query('say "hi" -now') == '"say" """hi""" "-now"*'
    assert fts_query(" \t\n") is None


# -- export and import ------------------------------------------------------------------------


def test_markdown_export_shows_the_shown_branch(store):
    s, q, a1, a2, q2 = conversation(store)
    store.update_session(s.id, system_prompt="You are terse.")
    store.select_branch(a1.id)
    a3 = store.start_answer(s.id, q.id, model="tiny", select=False)
    store.finish_message(a1.id, "It is 4.", metrics=Metrics(10, 4, 12.25, 150))
    store.set_selected_leaf(s.id, a1.id)
    md = store.export_markdown(s.id)
    assert md.startswith("# Arithmetic\n")
    assert "## System prompt\n\nYou are terse." in md
    assert "## User\n\nWhat is 2+2?" in md
    assert "## Assistant (tiny)\n\nIt is 4." in md
    assert "12.2 tok/s · 4 tokens · 10 prompt tokens · 0.15 s to first token" in md  # the TUI's wording
    assert "Four." not in md and "3+3" not in md  # other branches are not in the Markdown
    store.finish_message(a3.id, "Fo", status="incomplete")
    store.set_selected_leaf(s.id, a3.id)
    assert "incomplete" in store.export_markdown(s.id)


def test_json_export_has_every_branch_and_imports_losslessly(store):
    s, q, a1, a2, q2 = conversation(store)
    store.update_session(
        s.id,
        system_prompt="sys",
        sampling={"temperature": 0.2},
        backend=Backend.remote("https://example.test/v1", endpoint="work", api_key="sk-secret"),
        context_fit={"mode": "summarise", "dropped": 2, "summary": "They added numbers."},
    )
    store.finish_message(a1.id, "It is 4.", metrics=Metrics(10, 4, 12.5, 150))
    store.select_branch(a1.id)
    data = json.loads(store.export_json(s.id))
    assert data["session"]["context_fit"] == {"mode": "summarise", "dropped": 2, "summary": "They added numbers."}
    assert data["format"] == "chatapp-session"
    assert {m["id"] for m in data["messages"]} == {q.id, a1.id, a2.id, q2.id}
    assert data["session"]["selected_leaf_id"] == a1.id
    assert "sk-secret" not in store.export_json(s.id)  # keys are not exported by default
    assert json.loads(store.export_json(s.id, include_secrets=True))["session"]["backend"]["api_key"] == "sk-secret"

    copy = store.import_json(store.export_json(s.id, include_secrets=True))
    assert copy.id != s.id and copy.backend == store.get_session(s.id).backend
    assert copy.context_fit == store.get_session(s.id).context_fit
    assert [m.content for m in store.path(copy.id)] == ["What is 2+2?", "It is 4."]

    def without_ids(d: dict) -> dict:
        index = {m["id"]: i for i, m in enumerate(d["messages"])}
        for m in d["messages"]:
            m["id"], m["parent_id"] = index[m["id"]], index.get(m["parent_id"])
        d["session"]["selected_leaf_id"] = index[d["session"]["selected_leaf_id"]]
        del d["session"]["id"]
        return d

    assert without_ids(store.export_dict(copy.id)) == without_ids(store.export_dict(s.id))


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "invalid JSON"),
        ('{"format": "other"}', "not a chatapp session export"),
        ('{"format": "chatapp-session", "version": 99}', "version 99"),
    ],
)
def test_import_rejects_bad_files_clearly(store, text, match):
    with pytest.raises(HistoryFormatError, match=match):
        store.import_json(text)
    assert store.list_sessions() == []


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # SQLite's TEXT column stored 0 as "0", which the session then could not be read back with
        (lambda d: d["session"]["backend"].update(base_url=0), r"session\.backend\.base_url: unexpected value 0"),
        (lambda d: d["session"].update(selected_leaf_id=[1]), r"session\.selected_leaf_id: unexpected value \[1\]"),
        (lambda d: d["messages"][0]["metrics"].update(prompt_tokens=2**70), r"prompt_tokens: \d+ is out of range"),
    ],
)
def test_import_rejects_values_the_database_cannot_hold_clearly(store, edit, match):
    """Found by fuzzing exports: each of these was a ValueError, TypeError or OverflowError, the first after
    the session had been written."""
    s, *_ = conversation(store)
    data = store.export_dict(s.id)
    edit(data)
    with pytest.raises(HistoryFormatError, match=match):
        store.import_json(json.dumps(data))
    assert len(store.list_sessions()) == 1


def test_import_rejects_a_message_whose_parent_is_missing(store):
    s, *_ = conversation(store)
    data = store.export_dict(s.id)
    data["messages"][1]["parent_id"] = 999
    with pytest.raises(HistoryFormatError, match=r"messages\[1\]: its parent 999"):
        store.import_json(data)
    assert len(store.list_sessions()) == 1


# -- write failures and concurrency ---------------------------------------------------------------


def test_disk_full_raises_a_write_error_and_keeps_earlier_data(store, db_path):
    s, q, a1, a2, q2 = conversation(store)
    before = store.export_dict(s.id)
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")  # the "disk" is now full
    with pytest.raises(HistoryWriteError, match="disk is full"):
        store.add_message(s.id, a1.id, "user", "x" * 200_000)
    too_big = json.loads(json.dumps(before))
    too_big["messages"][-1]["content"] = "y" * 200_000
    with pytest.raises(HistoryWriteError, match="disk is full"):
        store.import_json(too_big)  # many rows: none of them may stay
    assert [x.id for x in store.list_sessions()] == [s.id]
    assert store.export_dict(s.id) == before
    assert raw(db_path).execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    store._conn.execute("PRAGMA max_page_count = 1073741823")  # space is available again
    big = store.add_message(s.id, a1.id, "user", "x" * 200_000)
    assert store.path(s.id)[-1] == big


def test_database_locked_too_long_raises_a_write_error(db_path):
    with HistoryStore(db_path, busy_timeout_s=0.05) as store:
        s = store.create_session("before")
        other = raw(db_path)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with pytest.raises(HistoryWriteError, match="locked"):
                store.rename_session(s.id, "after")
            assert store.get_session(s.id).title == "before"  # reads still work
        finally:
            other.execute("ROLLBACK")
        assert store.rename_session(s.id, "after").title == "after"


_CONCURRENT_WRITER = textwrap.dedent("""
    import sys
    from chatapp.history import HistoryStore
    with HistoryStore(sys.argv[1]) as store:
        session = int(sys.argv[2])
        for i in range(30):
            store.add_message(session, None, "user", f"child {i}", select=False)
""")


def test_two_processes_share_the_file(store, db_path):
    s = store.create_session()
    child = subprocess.Popen([sys.executable, "-c", _CONCURRENT_WRITER, str(db_path), str(s.id)])
    for i in range(30):
        store.add_message(s.id, None, "user", f"parent {i}", select=False)
    assert child.wait() == 0
    contents = {m.content for m in store.children(None, session_id=s.id)}
    assert contents == {f"{who} {i}" for who in ("parent", "child") for i in range(30)}


def test_threads_can_share_one_store(store):
    s = store.create_session()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(20):
                store.add_message(s.id, None, "user", f"{n}-{i}", select=False)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.children(None, session_id=s.id)) == 80


def test_the_history_is_readable_by_its_owner_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversations are private: the file (and SQLite's -wal/-shm beside it) 0600, the data dir 0700."""
    import stat

    from chatapp import paths

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    monkeypatch.setenv("CHATAPP_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir(mode=0o755)
    assert mode(paths.data_dir()) == 0o700
    db = tmp_path / "new" / "history.sqlite3"
    with HistoryStore(db) as store:
        session = store.create_session("private")
        store.add_message(session.id, None, "user", "my secret")
        sidecars = [p for p in (Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]
        assert sidecars  # WAL mode: written beside the file
        assert {mode(p) for p in [db, *sidecars]} == {0o600}
    assert mode(db.parent) == 0o700
    old = tmp_path / "old.sqlite3"
    with HistoryStore(old):
        pass
    old.chmod(0o644)  # made by an older chatapp
    with HistoryStore(old):
        pass
    assert mode(old) == 0o600


def test_a_version_1_history_gains_truncation_marks_drafts_and_context_fits(db_path):
    """Schema 2: answers say whether they stopped at the token limit, sessions keep a draft. Schema 3:
    sessions keep how their prompts are fitted to the context."""
    from chatapp.history.migrations import v1

    conn = sqlite3.connect(db_path)  # a file written by a chatapp that knew schema 1
    v1.migrate(conn)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO sessions (id, title, created_at, updated_at, position) VALUES (1, 'old', 0, 0, 0)")
    conn.execute("INSERT INTO messages (id, session_id, role, content, created_at) VALUES (1, 1, 'user', 'hi', 0)")
    conn.execute(
        "INSERT INTO messages (id, session_id, parent_id, role, content, created_at) "
        "VALUES (2, 1, 1, 'assistant', 'hello', 0)"
    )
    conn.commit()
    conn.close()
    with HistoryStore(db_path) as store:
        assert raw(db_path).execute("PRAGMA user_version").fetchone()[0] == schema_version() == 3
        s, q = store.get_session(1), store.get_message(1)
        assert s.title == "old" and [m.content for m in store.path(s.id)] == ["hi", "hello"]
        assert s.draft == "" and [m.truncated for m in store.path(s.id)] == [False, False]
        assert s.context_fit is None
        store.update_session(s.id, draft="half a thought", context_fit={"mode": "drop", "dropped": 2, "summary": ""})
        answer = store.start_answer(s.id, q.id, model="m")
        store.finish_message(answer.id, "a long answer that", truncated=True)
    with HistoryStore(db_path) as store:
        assert store.get_session(s.id).draft == "half a thought"
        assert store.get_session(s.id).context_fit == {"mode": "drop", "dropped": 2, "summary": ""}
        assert store.update_session(s.id, context_fit=None).context_fit is None
        assert store.get_message(answer.id).truncated is True
        exported = store.export_json(s.id)
        copy = store.import_json(exported)
        assert [m.truncated for m in store.path(copy.id)] == [False, True]
        assert "stopped at the token limit" in store.export_markdown(s.id)
