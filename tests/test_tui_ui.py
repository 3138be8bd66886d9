"""TUI behaviour with a fake engine (canned streams): panes, streaming, branches, history, keys, screens."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from textual.geometry import Offset
from textual.selection import Selection
from textual.widgets import DataTable, Tabs

from chatapp.history import HistoryStore
from chatapp.tui.engine_link import LocalEngine
from chatapp.tui.screens.help import HelpScreen
from chatapp.tui.screens.models import ModelScreen
from chatapp.tui.screens.sessions import SessionsScreen
from chatapp.tui.widgets.markdown_text import MarkdownChunk, MarkdownText
from chatapp.tui.widgets.message_view import MessageView
from chatapp.tui.widgets.status_bar import StatusBar
from tests.tui_fakes import FakeClient, factory
from tests.tui_helpers import answered, drawn_text, main_screen, make_app, panes, send, wait_for

pytestmark = pytest.mark.timeout(120)

CODE_REPLY = "Here you go:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nThat is all."


def stored_path(tmp_path: Path, session_id: int) -> list:
    with HistoryStore(tmp_path / "history.sqlite3") as store:
        return store.path(session_id)


async def test_send_streams_the_answer_and_saves_it(tmp_path: Path) -> None:
    client = FakeClient(reply=CODE_REPLY)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "Write add()")
        await wait_for(pilot, lambda: answered(pane), "the answer finished")
        user, answer = pane.conversation.path()
        assert (user.role, user.content) == ("user", "Write add()")
        assert answer.content == CODE_REPLY and answer.status == "complete"
        n_tokens = -(-len(CODE_REPLY) // client.chunk)  # the fake sends one "token" per chunk
        assert answer.metrics is not None and answer.metrics.completion_tokens == n_tokens
        assert client.requests[0]["messages"] == [{"role": "user", "content": "Write add()"}]
        assert client.requests[0]["params"].temperature == 0
        footer = pane.view_for(answer).query_one(".message-footer")
        assert f"{n_tokens} tokens" in str(footer.render())
        session_id = pane.config.db_id
        await app.action_quit()
    saved = stored_path(tmp_path, session_id)
    assert [(m.role, m.content, m.status) for m in saved] == [
        ("user", "Write add()", "complete"),
        ("assistant", CODE_REPLY, "complete"),
    ]
    assert saved[1].metrics.completion_tokens == n_tokens


async def test_code_fence_keeps_its_code_when_the_stream_ends(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply=CODE_REPLY, chunk=3))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "code please")
        await wait_for(pilot, lambda: answered(pane), "the answer finished")
        await pilot.pause()
        view = pane.view_for(pane.conversation.path()[-1])
        chunks = view.body.query(MarkdownChunk)
        assert len(chunks) == 1  # the ended answer is drawn as one piece
        shown = drawn_text(chunks.first())
        assert "def add(a, b):" in shown and "return a + b" in shown  # the code, on screen
        assert "```" not in shown and "Here you go:" in shown and "That is all." in shown  # as Markdown
        # The streamed document equals the answer: nothing was lost or duplicated by batching.
        assert view.body.source == CODE_REPLY


async def test_an_answer_can_be_selected_with_the_mouse_and_copied_as_drawn(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply=CODE_REPLY, chunk=3))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "code please")
        await wait_for(pilot, lambda: answered(pane), "the answer finished")
        await pilot.pause()
        chunk = pane.view_for(pane.conversation.leaf).body.query_one(MarkdownChunk)
        drawn = drawn_text(chunk)
        unselected = {segment.text: segment.style for segment in chunk.render_line(0)}
        screen = app.screen
        # A drag inside the answer knows where it is (as over any text of the app), so part of it can
        # be selected; without it the whole answer was the only thing a drag could select.
        widget, at = screen.get_widget_and_offset_at(chunk.region.x + 2, chunk.region.y)
        assert widget is chunk and at == Offset(2, 0)
        screen.selections = {chunk: Selection(None, None)}  # (what a drag over all of it leaves)
        everything = screen.get_selected_text()
        assert everything is not None and "def add(a, b):" in everything and "That is all." in everything
        screen.selections = {chunk: Selection(Offset(0, 0), Offset(4, 0))}
        await pilot.pause()
        assert screen.get_selected_text() == "Here"
        assert drawn_text(chunk) == drawn  # the same characters, "Here" now drawn as selected
        selected = {segment.text: segment.style for segment in chunk.render_line(0)}
        assert selected["Here"] != unselected.get("Here", unselected.get("Here you go:"))
        # A selection that starts past a line's end (from a drag across widgets) draws and copies too.
        screen.selections = {chunk: Selection(Offset(500, 0), Offset(3, 2))}
        await pilot.pause()
        assert len(chunk.render_line(0).text) <= chunk.size.width and screen.get_selected_text() is not None


async def test_two_panes_stream_at_the_same_time(tmp_path: Path) -> None:
    hold = asyncio.Event()
    client = FakeClient(reply="one two three four five six", chunk=4, hold=hold, hold_after=2)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: len(panes(app)) == 2, "a second pane")
        first, second = panes(app)
        await send(pilot, first, "A")
        await send(pilot, second, "B")
        # Both are mid-stream at once, each showing its partial text.
        await wait_for(
            pilot,
            lambda: (
                first.busy
                and second.busy
                and all(p.conversation.path()[-1].content == "one two " for p in (first, second))
            ),
            "both streaming",
        )
        await wait_for(
            pilot,
            lambda: "one two" in first.view_for(first.conversation.path()[-1]).shown_text,
            "partial text on screen",
        )
        hold.set()
        await wait_for(pilot, lambda: answered(first) and answered(second), "both answers finished")
        assert [p.conversation.path()[-1].content for p in (first, second)] == ["one two three four five six"] * 2


async def test_escape_stops_mid_stream_and_keeps_the_partial_answer(tmp_path: Path) -> None:
    hold = asyncio.Event()
    client = FakeClient(reply="abcdefghijklmnopqrstuvwxyz", chunk=5, hold=hold, hold_after=2)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "alphabet")
        await wait_for(pilot, lambda: pane.busy and pane.conversation.path()[-1].content == "abcdefghij", "partial")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy, "stopped")
        answer = pane.conversation.path()[-1]
        assert (answer.content, answer.status) == ("abcdefghij", "incomplete")
        assert client.aborted  # the request was closed in the engine
        assert "incomplete" in str(pane.view_for(answer).query_one(".message-header").render())
        session_id = pane.config.db_id
    saved = stored_path(tmp_path, session_id)
    assert (saved[-1].content, saved[-1].status) == ("abcdefghij", "incomplete")


async def test_regenerate_and_edit_make_branches_that_the_keys_switch(tmp_path: Path) -> None:
    client = FakeClient()
    replies = iter(["first answer", "second answer", "answer to the edit"])
    client.reply_for = lambda messages: next(replies)  # type: ignore[method-assign]
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "question")
        await wait_for(pilot, lambda: answered(pane), "first answer")
        await pilot.press("alt+r")
        await wait_for(
            pilot, lambda: answered(pane) and pane.conversation.leaf.content == "second answer", "regenerated"
        )
        answer = pane.conversation.path()[-1]
        assert pane.conversation.branch(answer).index == 1 and pane.conversation.branch(answer).count == 2
        assert "‹ 2/2 ›" in str(pane.view_for(answer).query_one(".message-header").render())
        await pilot.press("alt+left")
        await wait_for(pilot, lambda: pane.conversation.leaf.content == "first answer", "previous branch")
        shown = pane.log_view.query(MessageView).last()
        assert "‹ 1/2 ›" in str(shown.query_one(".message-header").render())
        with HistoryStore(tmp_path / "history.sqlite3") as store:
            assert store.path(pane.config.db_id)[-1].content == "first answer"  # the choice is saved
        await pilot.press("alt+right")
        await wait_for(pilot, lambda: pane.conversation.leaf.content == "second answer", "next branch")

        await pilot.press("alt+e")
        await wait_for(pilot, lambda: pane.editing is not None, "editing")
        assert pane.prompt.text == "question"
        pane.prompt.text = "question, edited"
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: answered(pane) and pane.conversation.leaf.content == "answer to the edit",
            "answer to the edit",
        )
        user = pane.conversation.path()[0]
        assert user.content == "question, edited"
        assert pane.conversation.branch(user).count == 2  # the edit is a sibling of the original question
        assert client.requests[-1]["messages"] == [{"role": "user", "content": "question, edited"}]


async def test_panes_beyond_the_width_are_reached_through_tabs(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        for _ in range(3):
            await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: len(panes(app)) == 4, "four panes")
        screen = main_screen(app)
        shown = [p for p in panes(app) if p.display]
        assert len(shown) == 3  # 120 columns fit three panes
        assert screen.active == 3 and panes(app)[3].display and panes(app)[3].has_class("active")
        tabs = screen.query_one(Tabs)
        assert tabs.tab_count == 4 and tabs.active == f"tab-{panes(app)[3].id}"
        await pilot.press("ctrl+pagedown")  # wraps to the first
        await wait_for(pilot, lambda: screen.active == 0, "first pane focused")
        assert panes(app)[0].display and not panes(app)[3].display
        assert panes(app)[0].prompt.has_focus
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen is not screen, "rename dialog")
        await pilot.press("ctrl+a")
        app.screen.query_one("Input").value = "Renamed"
        await pilot.press("enter")
        await wait_for(pilot, lambda: panes(app)[0].config.title == "Renamed", "renamed")
        assert "Renamed" in str(tabs.query_one(f"#tab-{panes(app)[0].id}").label)


async def test_closed_session_is_found_by_search_and_reopened(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply="Paris is the capital of France."))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: len(panes(app)) == 2, "two panes")
        pane = panes(app)[1]
        await send(pilot, pane, "capital of France?")
        await wait_for(pilot, lambda: answered(pane), "answer")
        session_id = pane.config.db_id
        await pilot.press("f8")
        await wait_for(pilot, lambda: len(panes(app)) == 1, "closed")
        await pilot.press("f7")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "sessions list")
        await pilot.press(*"pari")
        table = app.screen.query_one(DataTable)
        await wait_for(pilot, lambda: table.row_count == 1, "one match")
        assert "Paris" in str(table.get_row_at(0)[4]) and table.get_row_at(0)[2] == "closed"
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: len(panes(app)) == 2, "reopened")
        reopened = panes(app)[1]
        assert reopened.config.db_id == session_id
        assert [m.content for m in reopened.conversation.path()] == [
            "capital of France?",
            "Paris is the capital of France.",
        ]


async def test_export_writes_markdown_and_json(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply="An **answer**."))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "hi")
        await wait_for(pilot, lambda: answered(pane), "answer")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: (tmp_path / "exports").exists(), "export folder")
    md = next((tmp_path / "exports").glob("*.md")).read_text()
    assert "## User\n\nhi" in md and "An **answer**." in md
    assert '"content": "An **answer**."' in next((tmp_path / "exports").glob("*.json")).read_text()


async def test_history_write_failure_warns_and_the_chat_goes_on_in_memory(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply="still answering"))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        store = app.store
        assert store is not None
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        store._conn.execute(f"PRAGMA max_page_count = {pages}")  # the "disk" is now full
        big = "x" * 100_000
        await send(pilot, pane, big)
        await wait_for(pilot, lambda: answered(pane), "answer in memory")
        assert [m.content for m in pane.conversation.path()] == [big, "still answering"]
        assert app.recorder.failing
        assert any("Could not save the chat history" in (n.title or "") for n in app._notifications)
        await wait_for(pilot, lambda: main_screen(app).query_one(StatusBar).history_failing, "status warning")
        assert "history not saved" in str(main_screen(app).query_one(StatusBar).render())

        store._conn.execute("PRAGMA max_page_count = 1073741823")  # space again
        await send(pilot, pane, "after")
        await wait_for(pilot, lambda: answered(pane, 2), "second answer")
        assert not app.recorder.failing
        session_id = pane.config.db_id
    saved = stored_path(tmp_path, session_id)
    assert [m.content for m in saved] == [big, "still answering", "after", "still answering"]
    conn = sqlite3.connect(tmp_path / "history.sqlite3")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


async def test_dead_engine_is_shown_and_restarted(tmp_path: Path) -> None:
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        bar = main_screen(app).query_one(StatusBar)
        await wait_for(pilot, lambda: bar.engine.state == "ready", "ready")
        client.state = "dead"
        await wait_for(pilot, lambda: bar.engine.state == "dead", "dead shown")
        assert "dead" in str(bar.render()) and "F10 restarts" in str(bar.render())
        pane = panes(app)[0]
        await send(pilot, pane, "anyone?")
        await wait_for(pilot, lambda: answered(pane), "error answer")
        assert pane.conversation.leaf.status == "error"
        await pilot.press("f10")
        await wait_for(pilot, lambda: bar.engine.state == "ready", "ready again")
        assert client.restarts == 1
        await pilot.press("alt+r")
        await wait_for(
            pilot, lambda: answered(pane) and pane.conversation.leaf.status == "complete", "answer after restart"
        )


class SilentStatsClient(FakeClient):
    """An engine that takes every status call and never answers it (a call lost as a connection closes)."""

    async def stats(self) -> Any:
        await asyncio.Event().wait()  # until cancelled


async def test_an_engine_that_never_answers_its_status_call_neither_freezes_nor_keeps_the_app(
    tmp_path: Path,
) -> None:
    """The status poll runs beside the app's message loop, never in it, and gives up after a while: before,
    the first poll waited inside the loop, so the app stopped handling keys and could never exit."""
    client = SilentStatsClient(reply="Still here.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        bar = main_screen(app).query_one(StatusBar)
        await wait_for(pilot, lambda: bar.engine.state == "ready", "ready without counters")
        assert bar.engine.kv_used is None
        pane = panes(app)[0]
        await send(pilot, pane, "anyone?")
        await wait_for(pilot, lambda: answered(pane), "answer")
        assert pane.conversation.leaf.content == "Still here."
        await app.action_quit()
    assert app.return_code == 0


async def test_a_status_poll_cancelled_as_its_counters_arrive_ends_cancelled() -> None:
    """Cancelled at any turn of the loop, a poll ends cancelled. Python 3.11's wait_for dropped a cancellation
    that came as the call ended: the status timer, stopped at quit, ran on, and the app never exited (CI)."""
    engine = LocalEngine(factory(FakeClient()))
    await engine.start()
    assert (await engine.snapshot()).state == "ready"
    dropped = []
    for turns in range(8):  # the cancel lands on each step of the poll in turn
        poll = asyncio.create_task(engine.snapshot())
        for _ in range(turns):
            await asyncio.sleep(0)
        if not poll.cancel():
            continue  # it had ended already
        try:
            await poll
            dropped.append(turns)
        except asyncio.CancelledError:
            pass
    assert dropped == []


async def test_keys_can_be_remapped_in_the_settings_file(tmp_path: Path) -> None:
    (tmp_path / "settings.toml").write_text('[keys]\nregenerate = "f11"\nhelp = "f12"\n')
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "q")
        await wait_for(pilot, lambda: answered(pane), "answer")
        await pilot.press("alt+r")  # no longer bound
        await pilot.pause()
        assert len(client.requests) == 1
        await pilot.press("f11")
        await wait_for(pilot, lambda: len(client.requests) == 2 and answered(pane), "regenerated with F11")
        await pilot.press("f12")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "help on F12")
        rows = [app.screen.query_one(DataTable).get_row_at(i) for i in range(app.screen.query_one(DataTable).row_count)]
        assert ["F11", "Regenerate the selected (else the last) answer (a new branch)", "regenerate"] in [
            list(r) for r in rows
        ]


async def test_command_palette_offers_the_same_actions(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        titles = {c.title for c in app.get_system_commands(main_screen(app))}
        from chatapp.tui.keymap import ACTIONS

        assert {a.description for a in ACTIONS} <= titles
        await pilot.press("ctrl+p")
        await pilot.press(*"new session pane")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(panes(app)) == 2, "new pane from the palette")


async def test_copy_keys_put_the_answer_and_its_code_on_the_clipboard(tmp_path: Path) -> None:
    app = make_app(tmp_path, FakeClient(reply=CODE_REPLY))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "code")
        await wait_for(pilot, lambda: answered(pane), "answer")
        await pilot.press("ctrl+o")
        assert app.clipboard == CODE_REPLY
        await pilot.press("alt+c")
        assert app.clipboard == "def add(a, b):\n    return a + b\n"


async def test_model_screen_downloads_in_the_background_and_switches(tmp_path: Path) -> None:
    import threading

    client = FakeClient()
    app = make_app(tmp_path, client)
    gate = threading.Event()
    app.catalog.gate = gate  # type: ignore[attr-defined]
    notes: list[str] = []
    notify = app.notify
    app.notify = lambda message, **kw: (notes.append(str(message)), notify(message, **kw))[1]  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine.state == "ready", "engine ready")
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), "model screen")
        screen = app.screen
        local = screen.query_one("#local", DataTable)
        await wait_for(pilot, lambda: local.row_count == 2, "local models listed")
        screen.query_one("#hub-search").focus()
        await pilot.press(*"qwen", "enter")
        hub = screen.query_one("#hub", DataTable)
        await wait_for(pilot, lambda: hub.row_count == 1, "search results")
        assert list(hub.get_row_at(0))[0] == "Qwen/Qwen2.5-7B-Instruct"
        assert str(list(hub.get_row_at(0))[3]) == "will be slow"
        hub.focus()
        await pilot.press("enter")
        await wait_for(
            pilot, lambda: app.latest_pull is not None and app.latest_pull.state == "downloading", "download started"
        )
        gate.set()
        await pilot.press("escape")  # the download goes on without the screen
        await wait_for(pilot, lambda: app.latest_pull.state == "done", "download finished")
        assert app.latest_pull.done_bytes == app.latest_pull.total_bytes == 4000
        # The download's thread said so by a message; the app told the user.
        await wait_for(pilot, lambda: any(n.startswith("Downloaded Qwen/Qwen2.5-7B-Instruct") for n in notes), "told")
        # Chats went on meanwhile and can switch to a local model: every pane is told.
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), "model screen again")
        local = app.screen.query_one("#local", DataTable)
        await wait_for(pilot, lambda: local.row_count == 2, "local models listed")
        local.focus()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: client.switched_to == ["Qwen/Qwen2.5-0.5B-Instruct"], "switched")
        await pilot.press("escape")
        await wait_for(
            pilot,
            lambda: "now runs Qwen/Qwen2.5-0.5B-Instruct" in str(panes(app)[0].query_one(".pane-notice").render()),
            "pane told",
        )
        assert panes(app)[0].border_subtitle == "Qwen/Qwen2.5-0.5B-Instruct"


async def test_download_can_be_cancelled(tmp_path: Path) -> None:
    import threading

    app = make_app(tmp_path)
    gate = threading.Event()
    app.catalog.gate = gate  # type: ignore[attr-defined]
    async with app.run_test(size=(120, 40)) as pilot:
        job = app.start_pull("HuggingFaceTB/SmolLM2-360M-Instruct")
        assert job is not None
        await wait_for(pilot, lambda: job.state == "downloading", "downloading")
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), "model screen")
        await pilot.press("ctrl+x")
        gate.set()
        await wait_for(pilot, lambda: job.state == "cancelled", "cancelled")
        assert job.done_bytes < 4000


async def test_settings_screen_saves_the_file(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen.query("#port"), "settings screen")
        app.screen.query_one("#port").value = "not a port"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "whole number" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#port").value = "8123"
        app.screen.query_one("#kv-gib").value = "2.5"
        app.screen.query_one("#memory-gib").value = "lots"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "models' memory must be a number" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#memory-gib").value = "12"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: (tmp_path / "settings.toml").exists(), "saved")
    from chatapp.settings import load

    saved = load(tmp_path / "settings.toml")
    assert saved.server.port == 8123 and saved.engine.kv_cache_memory_gib == 2.5 and saved.engine.memory_gib == 12


async def test_broken_settings_file_is_reported_and_defaults_are_used(tmp_path: Path) -> None:
    (tmp_path / "settings.toml").write_text('[server]\nport = "eighty"\n')
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.settings.server.port == 8000
        assert any("Settings file has errors" == n.title for n in app._notifications)


async def test_session_settings_validate_and_apply(tmp_path: Path) -> None:
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.screen.query("#s-temperature"), "session settings")
        app.screen.query_one("#s-temperature").value = "hot"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "temperature must be a number" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#s-temperature").value = "0.3"
        app.screen.query_one("#system-prompt").text = "Be brief."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: pane.config.system_prompt == "Be brief.", "applied")
        await send(pilot, pane, "hi")
        await wait_for(pilot, lambda: answered(pane), "answer")
        request = client.requests[-1]
        assert request["messages"][0] == {"role": "system", "content": "Be brief."}
        assert request["params"].temperature == 0.3
    with HistoryStore(tmp_path / "history.sqlite3") as store:
        session = store.get_session(pane.config.db_id)
        assert session.system_prompt == "Be brief." and session.sampling["temperature"] == 0.3


async def test_four_fast_streams_are_batched_into_few_markdown_appends(tmp_path: Path, monkeypatch) -> None:
    appends: list[int] = []
    original = MarkdownText.append

    def counting_append(self: MarkdownText, markdown: str):
        appends.append(id(self))
        return original(self, markdown)

    monkeypatch.setattr(MarkdownText, "append", counting_append)
    reply = "word " * 400  # 400 deltas per pane
    client = FakeClient(reply=reply, chunk=5)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(170, 40)) as pilot:
        for _ in range(3):
            await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: len(panes(app)) == 4, "four panes")
        for pane in panes(app):
            await send(pilot, pane, "go")
        await wait_for(pilot, lambda: all(answered(p) for p in panes(app)), "four answers", steps=3000)
        for pane in panes(app):
            body = pane.view_for(pane.conversation.leaf).body
            assert body.source == reply  # every token arrived, in order
            assert appends.count(id(body)) <= 400 // 4  # batched: far fewer appends than deltas


def test_keymap_from_settings_unbinds_and_reports_unknown_actions() -> None:
    from chatapp.tui import keymap

    mapping, warnings = keymap.keymap({"stop": "", "regenerate": "f11", "teleport": "f12", "new_session": "ctrl+t"})
    assert mapping == {"stop": keymap.UNBOUND, "regenerate": "f11"}  # ctrl+t is the settings default: ours stays
    assert len(warnings) == 1 and "'teleport'" in warnings[0]
    assert keymap.key_for("next_session", {"next_session": "ctrl+pagedown"}) == "ctrl+pagedown,f6"
    assert keymap.display_key(keymap.key_for("stop", {"stop": ""})) == "(unbound)"


async def test_a_think_block_is_folded_above_the_answer(tmp_path: Path) -> None:
    """A reasoning model's <think> block streams into a folded "Thinking" section, the answer into the
    Markdown; the message keeps the whole text (history, export), and a reload folds it again."""
    from textual.widgets import Collapsible

    reply = "<think>\nThe user asks for 2 + 2 [/usr/lib]. That is 4.\n</think>\n\nIt is **4**."  # not markup
    app = make_app(tmp_path, FakeClient(reply=reply, chunk=3))  # tags split across deltas
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "2 + 2?")
        await wait_for(pilot, lambda: answered(pane), "the answer finished")
        answer = pane.conversation.path()[-1]
        assert answer.content == reply
        view = pane.view_for(answer)
        fold = view.query_one(".message-thinking", Collapsible)
        assert fold.collapsed and fold.title == "Thinking"
        assert str(fold.query_one(".thinking-text").render()) == "The user asks for 2 + 2 [/usr/lib]. That is 4.\n"
        assert view.body.source == "It is **4**."
        await pane.show_path()  # rebuilt from the stored node
        again = pane.view_for(answer)
        assert again.body.source == "It is **4**." and again.query_one(".message-thinking", Collapsible).collapsed
        await app.action_quit()
