"""How answers reach the screen while they stream (issue 18's CPU item): finished Markdown blocks are
drawn once each, as one text widget per batch, and only the block being written is redrawn; an ended
answer is one widget; every streaming pane is flushed by one clock in one frame; quitting mid-start
is clean."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest

from chatapp.history import HistoryStore
from chatapp.tui.app import ChatApp
from chatapp.tui.markdown_tail import settled_length
from chatapp.tui.stream_clock import UNFOCUSED_EVERY, StreamClock, clock_for
from chatapp.tui.widgets.markdown_text import MarkdownChunk
from tests.tui_fakes import FakeClient
from tests.tui_helpers import answered, drawn_text, make_app, panes, send, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("text", "settled"),
    [
        ("A sentence being writ", ""),
        ("A whole line\n", ""),  # a paragraph goes on until a blank line
        ("One.\n\nTwo is", "One.\n\n"),
        ("- a\n- b\n\nAfter", "- a\n- b\n\n"),
        ("Code:\n\n```py\nx = 1\n\ny = 2\n", "Code:\n\n"),  # a blank line inside a fence ends nothing
        ("```py\nx = 1\n```\nThen", "```py\nx = 1\n```\n"),  # the closing fence ends its block
        ("````\n```\nstill code\n", ""),  # a shorter fence does not close a longer one
        ("~~~\n```\n~~~\n", "~~~\n```\n~~~\n"),
        ("```\nx\n``` not a close\n\n", ""),
    ],
)
def test_the_settled_part_of_a_streaming_answer_ends_at_a_finished_block(text: str, settled: str) -> None:
    assert text[: settled_length(text)] == settled


REPLY = "Intro line.\n\n- first\n- second\n\n```python\nx = 1\ny = 2\n```\n\nDone **now**."
HELD_AT = REPLY.index("y = 2")  # mid-way through the code block


async def test_finished_blocks_go_to_the_markdown_and_only_the_block_being_written_is_plain_text(
    tmp_path: Path,
) -> None:
    hold = asyncio.Event()
    app = make_app(tmp_path, FakeClient(reply=REPLY, chunk=1, hold=hold, hold_after=HELD_AT))
    async with app.run_test(size=(100, 40)) as pilot:
        pane = panes(app)[0]
        await send(pilot, pane, "show me")
        await wait_for(pilot, lambda: pane._answer is not None and pane._answer.content == REPLY[:HELD_AT], "held")
        answer = pane.conversation.leaf
        assert answer is not None
        view = pane.view_for(answer)
        assert view is not None
        await wait_for(pilot, lambda: view.shown_text == REPLY[:HELD_AT], "the held text on screen")
        assert view.body.source == "Intro line.\n\n- first\n- second\n\n"
        chunks = view.body.query(MarkdownChunk)
        assert chunks and "".join(c.source for c in chunks) == view.body.source
        await pilot.pause(0.1)  # (the frame that lays out what the tick mounted)
        drawn = drawn_text(view.body)
        assert "• first" in drawn and "- first" not in drawn, drawn  # the finished list drawn as Markdown
        assert "```python" not in drawn and "x = 1" in drawn  # the open fence drawn as code already
        assert view.body.tail.display and view.body.tail.text == "```python\nx = 1\n"

        hold.set()
        await wait_for(pilot, lambda: answered(pane), "the answer finished")
        assert not view.body.tail.display and view.body.tail.text == ""
        assert view.body.source == REPLY
        assert len(view.body.query(MarkdownChunk)) == 1  # drawn again as one piece
        await pilot.pause()
        ended = drawn_text(view.body)
        assert "```" not in ended and "y = 2" in ended and "Done now." in ended
        # The same answer drawn at once (as when the session is opened again) looks the same.
        await pane.show_path()
        fresh = pane.view_for(answer)
        assert fresh is not None and fresh is not view
        await pilot.pause()
        assert fresh.body.source == REPLY and len(fresh.body.query(MarkdownChunk)) == 1
        assert drawn_text(fresh.body) == ended


class FlushCounter:
    def __init__(self, focused: bool) -> None:
        self.has_focus_within = focused
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


async def test_one_clock_flushes_the_focused_pane_every_tick_and_the_others_less_often(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)):
        clock = StreamClock(app)
        focused, other = FlushCounter(True), FlushCounter(False)
        assert not clock.running
        clock.join(focused)
        clock.join(other)
        assert clock.running
        for _ in range(4 * UNFOCUSED_EVERY):
            await clock._tick()
        assert (focused.flushes, other.flushes) == (4 * UNFOCUSED_EVERY, 4)
        clock.leave(focused)
        assert clock.running  # another pane still streams
        clock.leave(other)
        assert not clock.running
        assert clock_for(app) is clock_for(app)


async def test_three_panes_stream_through_the_one_clock_and_it_stops_when_they_end(tmp_path: Path) -> None:
    hold = asyncio.Event()
    app = make_app(tmp_path, FakeClient(reply="one two three four five six", chunk=4, hold=hold, hold_after=2))
    async with app.run_test(size=(150, 40)) as pilot:
        await pilot.press("ctrl+t", "ctrl+t")
        await wait_for(pilot, lambda: len(panes(app)) == 3, "three panes")
        for pane in panes(app):
            await send(pilot, pane, "count")
        clock = clock_for(app)
        await wait_for(pilot, lambda: all(p.busy for p in panes(app)), "all three streaming")
        assert clock.running
        await wait_for(
            pilot,
            lambda: all(p.view_for(p.conversation.leaf).shown_text == "one two " for p in panes(app)),  # type: ignore[union-attr]
            "every pane's partial text on screen",
        )
        hold.set()
        await wait_for(pilot, lambda: all(answered(p) for p in panes(app)), "all answered")
        assert not clock.running


async def test_quitting_before_a_just_started_answer_runs_is_clean_and_keeps_the_question(tmp_path: Path) -> None:
    """The answer's worker is cancelled before it first runs: Textual's wait then raised
    WorkerCancelled out of quit (a traceback on the user's screen)."""
    app = make_app(tmp_path, FakeClient(reply="never shown"))
    async with app.run_test(size=(100, 30)):
        pane = panes(app)[0]
        assert await pane.send("are you there?")
        await app.action_quit()
    with HistoryStore(tmp_path / "history.sqlite3") as store:
        sessions = store.list_sessions()
        assert [m.content for m in store.path(sessions[0].id)][:1] == ["are you there?"]


def test_an_app_that_streamed_is_freed_when_it_ends(tmp_path: Path) -> None:
    """Nothing of ours keeps an ended app alive (the stream clock once did, through the clocks' weak
    dictionary): every app a test suite or a benchmark runs stayed in memory, and the collector
    walked them all, again and again. (Its own event loop: the one of an async test holds the app's
    last callbacks until the test ends.)"""

    async def stream_once() -> weakref.ref[ChatApp]:
        app = make_app(tmp_path, FakeClient(reply="one two three", chunk=4))
        async with app.run_test(size=(100, 30)) as pilot:
            pane = panes(app)[0]
            await send(pilot, pane, "count")
            await wait_for(pilot, lambda: answered(pane), "the answer")
        return weakref.ref(app)

    ended = asyncio.run(stream_once())
    gc.collect()
    assert ended() is None


async def test_chunks_and_the_tail_are_spaced_like_one_markdown_document() -> None:
    """Blocks drawn as separate chunks (and the block being written) are one blank line apart, as
    the same blocks drawn at once are; Rich's own empty line above a list is not doubled."""
    from textual.app import App, ComposeResult

    from chatapp.tui.widgets.markdown_text import MarkdownText

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield MarkdownText()

    source = "Intro.\n\n- a\n- b\n\n1. one\n2. two"
    app = Host()
    async with app.run_test(size=(40, 20)) as pilot:
        body = app.query_one(MarkdownText)
        await body.append("Intro.\n\n")
        await body.append("- a\n- b\n\n")
        body.set_tail("1. one\n2. two")
        await pilot.pause()
        streamed = drawn_text(body).splitlines()
        await body.update(source)
        await pilot.pause()
        whole = drawn_text(body).splitlines()
    assert [line.strip() for line in streamed if line.strip()] == ["Intro.", "• a", "• b", "1 one", "2 two"]
    assert streamed[: len(whole)] == whole and not any(line.strip() for line in streamed[len(whole) :])
    assert [line.strip() for line in whole[:7]] == ["Intro.", "", "• a", "• b", "", "1 one", "2 two"]


async def test_a_continued_answer_cut_inside_a_block_draws_that_block_as_still_being_written() -> None:
    """Continuing an answer cut mid-way through a code block: the cut block goes back to the tail,
    so the continuation closes the fence it opened rather than starting a paragraph of its own."""
    from textual.app import App, ComposeResult

    from chatapp.tui.conversation import Branch, Node
    from chatapp.tui.widgets.message_view import MessageView

    cut = "Intro.\n\n```python\nprint(1)\n"
    view = MessageView(Node("assistant", cut, truncated=True), Branch(0, 1))

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield view

    async with Host().run_test(size=(60, 30)) as pilot:
        assert view.body.source == cut  # one chunk, as a finished message is drawn
        await view.begin_stream()
        assert view.body.source == "Intro.\n\n" and view.body.tail.text == "```python\nprint(1)\n"
        appending = view.stream("print(2)\n```\n\nDone")
        if appending is not None:
            await appending
        await pilot.pause()
        chunks = [chunk.source for chunk in view.body.query(MarkdownChunk)]
        assert chunks == ["Intro.\n\n", "```python\nprint(1)\nprint(2)\n```\n\n"]
        drawn = drawn_text(view.body)
        assert "```" not in drawn and "print(2)" in drawn and "Done" in drawn
        assert view.shown_text == cut + "print(2)\n```\n\nDone"
        await view.end_stream(view.shown_text)
        assert view.shown_text == cut + "print(2)\n```\n\nDone" and len(view.body.query(MarkdownChunk)) == 1


async def test_whitespace_alone_makes_no_chunk_and_no_gap() -> None:
    from textual.app import App, ComposeResult

    from chatapp.tui.widgets.markdown_text import MarkdownText

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield MarkdownText()

    async with Host().run_test(size=(40, 20)) as pilot:
        body = pilot.app.query_one(MarkdownText)
        await body.append("\n\n")  # an answer that starts with blank lines
        await body.append("One.\n\n")
        body.set_tail("Two")
        await pilot.pause()
        assert [line.strip() for line in drawn_text(body).splitlines()][:3] == ["One.", "", "Two"]


class PacedClient(FakeClient):
    """The fake engine, one piece every 10 ms: an answer that keeps streaming across clock ticks."""

    async def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        async for delta in super().generate(*args, **kwargs):
            await asyncio.sleep(0.01)
            yield delta


async def test_a_streaming_tick_lays_the_screen_out_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A growing answer changes sizes every tick; the layout pass that measured them must not ask for
    another (Textual's default for a new virtual size: layout_sized.py), which doubled the TUI's work."""
    ticks = 0
    tick = StreamClock._tick

    async def counted_tick(self: StreamClock) -> None:
        nonlocal ticks
        ticks += 1
        await tick(self)

    monkeypatch.setattr(StreamClock, "_tick", counted_tick)
    # One long paragraph: it grows every tick in the tail, with no finished block to mount.
    client = PacedClient(reply=" ".join(f"word{i}" for i in range(3000)))
    client.chunk = 8
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = app.screen
        pane = panes(app)[0]
        await send(pilot, pane, "go on")
        await wait_for(pilot, lambda: ticks >= 2, "the stream under way")
        layouts = 0
        layout = screen._refresh_layout

        def counted_layout(*args: object, **kwargs: object) -> None:
            nonlocal layouts
            layouts += 1
            layout(*args, **kwargs)  # type: ignore[arg-type]

        screen._refresh_layout = counted_layout  # type: ignore[method-assign]
        first = ticks
        await wait_for(pilot, lambda: ticks >= first + 6, "six more ticks")
        assert not answered(pane, 1), "the answer must still be streaming"
        assert layouts <= (ticks - first) + 2, f"{layouts} layouts in {ticks - first} ticks"
        pane.stop()
        await app.action_quit()
