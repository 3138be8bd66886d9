"""A model per pane and compare mode (issue 19), on the fake engine client (the engine side is tested
with real models in test_multi_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import DataTable, Input, Static, TextArea

from chatapp.engine.ipc import normalize_model_spec
from chatapp.history import HistoryStore
from chatapp.tui.screens.compare import CompareScreen, plan_comparison
from chatapp.tui.screens.models import ModelScreen
from chatapp.tui.screens.session_settings import SessionSettingsScreen
from tests.tui_fakes import FakeClient
from tests.tui_helpers import answered, main_screen, make_app, panes, send, wait_for

pytestmark = pytest.mark.timeout(60)

SMOL, QWEN = "SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"  # the fake catalog's local models


def stored_answers(tmp_path: Path) -> dict[int, list[tuple[str | None, str]]]:
    """Session id -> (model, text) of each stored answer, read back from the history file."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    try:
        out = {}
        for session in store.list_sessions(include_archived=True):
            out[session.id] = [(m.model, m.content) for m in store.path(session.id) if m.role == "assistant"]
        return out
    finally:
        store.close()


async def use_from_models_screen(pilot, app, row: int, key: str) -> None:  # noqa: ANN001
    """F4, highlight a local model, then U (this pane) or N (a new pane)."""
    await pilot.press("f4")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), "the models screen")
    table = app.screen.query_one("#local", DataTable)
    await wait_for(pilot, lambda: table.row_count >= 2, "the local models listed")
    table.focus()
    table.move_cursor(row=row)
    await pilot.pause()
    await pilot.press(key)
    await wait_for(pilot, lambda: not isinstance(app.screen, ModelScreen), "the models screen closed")


async def test_two_panes_on_two_models_and_compare_mode_sends_one_message_to_both(tmp_path: Path) -> None:
    client = FakeClient(reply="An answer.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine.state == "ready", "engine ready")
        first = panes(app)[0]
        await use_from_models_screen(pilot, app, 0, "u")  # this pane: SmolLM2
        await wait_for(pilot, lambda: first.config.model == SMOL, "the first pane's model")
        await use_from_models_screen(pilot, app, 1, "n")  # a new pane: Qwen
        await wait_for(pilot, lambda: len(panes(app)) == 2, "a second pane")
        second = panes(app)[1]
        await wait_for(pilot, lambda: second.config.model == QWEN and QWEN in client.loaded, "Qwen loaded")
        assert SMOL in str(first.border_subtitle) and QWEN in str(second.border_subtitle)

        # Mark both for compare; a draft in the first pane must survive a message sent from the second.
        main_screen(app).focus_pane(0)
        await pilot.press("alt+m")
        first.prompt.text = "my unsent draft"
        main_screen(app).focus_pane(1)
        await pilot.press("alt+m")
        assert first.compare and second.compare
        await send(pilot, second, "Which is the biggest planet?")
        await wait_for(pilot, lambda: answered(first) and answered(second), "both answers")

        asked = sorted((r["model"], r["messages"][-1]["content"]) for r in client.requests)
        assert asked == [(QWEN, "Which is the biggest planet?"), (SMOL, "Which is the biggest planet?")]
        assert first.conversation.path()[-1].content == f"[{SMOL}] An answer."
        assert second.conversation.path()[-1].model == QWEN
        assert first.prompt.text == "my unsent draft"
        assert first.conversation.path()[-1].metrics is not None  # tokens and speed shown under each answer

        # Unmarked panes are on their own again.
        await pilot.press("alt+m")
        await send(pilot, second, "And the smallest?")
        await wait_for(pilot, lambda: answered(second, 2), "the second answer")
        assert len(client.requests) == 3
        await app.action_quit()

    stored = stored_answers(tmp_path)
    models = sorted(model for answers in stored.values() for model, _text in answers[:1])
    assert models == [QWEN, SMOL]  # each stored with the name of the model that wrote it


async def test_new_comparison_opens_a_pane_per_model_and_asks_them_all(tmp_path: Path) -> None:
    client = FakeClient(reply="Hi.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(200, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine.state == "ready", "engine ready")
        await pilot.press("alt+k")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), "the comparison dialog")
        dialog = app.screen
        dialog.query_one("#compare-models", TextArea).text = "model-x\nmodel-y\ndefault"
        dialog.query_one("#compare-prompts", TextArea).text = "Answer in one word."
        dialog.query_one("#compare-question", TextArea).text = "Best colour?"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: len(panes(app)) == 4, "three new panes")
        opened = panes(app)[1:]
        await wait_for(pilot, lambda: all(answered(p) for p in opened), "three answers")
        assert [p.config.model for p in opened] == ["model-x", "model-y", None]
        assert all(p.compare and p.config.system_prompt == "Answer in one word." for p in opened)
        assert [p.conversation.path()[-1].content for p in opened] == ["[model-x] Hi.", "[model-y] Hi.", "Hi."]
        assert opened[0].config.title.startswith("Compare 1: model-x")
        assert not panes(app)[0].compare and not panes(app)[0].conversation.roots
        assert all(r["messages"][0] == {"role": "system", "content": "Answer in one word."} for r in client.requests)
        await app.action_quit()


async def test_a_pane_picks_its_local_model_in_session_settings(tmp_path: Path) -> None:
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine.state == "ready", "engine ready")
        pane = panes(app)[0]
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionSettingsScreen), "F5")
        app.screen.query_one("#local-model", Input).value = "model-z"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: pane.config.model == "model-z", "the model set")
        assert "model-z" in str(pane.border_subtitle)
        await send(pilot, pane, "hello")
        await wait_for(pilot, lambda: answered(pane), "the answer")
        assert client.requests[-1]["model"] == "model-z" and pane.conversation.path()[-1].model == "model-z"
        assert "model-z" in client.loaded  # loaded (with a "Loading model-z…" notice) before it was asked
        assert "4,096 tokens" in str(pane.border_subtitle)  # its own context, not the default model's

        # The engine's progress loading a pane's model shows in that pane (and only there).
        notice = pane.query_one(".pane-notice", Static)
        app._model_changed(normalize_model_spec("model-z"), "loading", "reading weights 3/30")
        app._model_changed(normalize_model_spec("other-model"), "loading", "not this pane's")
        await pilot.pause()
        assert str(notice.render()) == "Loading model-z: reading weights 3/30"
        app._model_changed(normalize_model_spec("model-z"), "ready", "model-z ready")
        await pilot.pause()
        assert str(notice.render()) == "" and not pane.has_class("has-notice")
        await app.action_quit()


def test_plan_comparison_pairs_models_and_prompts_or_says_what_to_fix() -> None:
    plan = plan_comparison("a\nb\n", "", "Q?")
    assert plan.panes == [("a", ""), ("b", "")] and plan.question == "Q?"
    assert plan_comparison("", "terse\nverbose", "Q").panes == [(None, "terse"), (None, "verbose")]
    assert plan_comparison("m", "one\ntwo", "Q").panes == [("m", "one"), ("m", "two")]
    for models, prompts, question, error in (
        ("a\nb", "", " ", "write the question"),
        ("a", "", "Q", "two models or two system prompts"),
        ("a\nb\nc", "x\ny", "Q", "one line of system prompts per pane"),
        ("\n".join(f"m{i}" for i in range(9)), "", "Q", "at most 8"),
    ):
        with pytest.raises(ValueError, match=error):
            plan_comparison(models, prompts, question)
