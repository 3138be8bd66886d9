"""The message cursor (issue 18): every turn reachable, not only the last: copy, edit and resend,
regenerate, delete and branch switching at any message; code blocks copied one by one; clickable ‹ ›."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Static

from chatapp.history import HistoryStore
from chatapp.tui.screens.confirm import ConfirmScreen
from chatapp.tui.widgets.message_view import MessageView
from tests.tui_fakes import FakeClient
from tests.tui_helpers import answered, ask, make_app, panes, wait_for

pytestmark = pytest.mark.timeout(60)

TWO_BLOCKS = "First:\n\n```python\nprint(1)\n```\n\nThen:\n\n```sh\necho 2\n```\n"


class NumberedReplies(FakeClient):
    """Each answer says which it is, so branches can be told apart."""

    def reply_for(self, messages: list[dict]) -> str:
        return f"Answer {len(self.requests)}."


async def two_exchanges(pilot, app):  # noqa: ANN001, ANN201
    pane = panes(app)[0]
    await ask(pilot, pane, "first question")
    await ask(pilot, pane, "second question")
    return pane


def shown(pane) -> list[str]:  # noqa: ANN001
    return [n.content for n in pane.conversation.path()]


async def test_regenerate_and_switch_branches_at_an_earlier_turn(tmp_path: Path) -> None:
    client = NumberedReplies()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await two_exchanges(pilot, app)
        assert shown(pane) == ["first question", "Answer 1.", "second question", "Answer 2."]
        for _ in range(3):  # up from the last message: answer 2, question 2, answer 1
            await pilot.press("alt+up")
        assert pane.selected is pane.conversation.path()[1]
        assert [v.has_class("selected") for v in pane.log_view.query(MessageView)] == [False, True, False, False]
        await pilot.press("alt+r")
        await wait_for(pilot, lambda: answered(pane) and len(client.requests) == 3, "the new first answer")
        assert [m["content"] for m in client.requests[-1]["messages"]] == ["first question"]
        assert shown(pane) == ["first question", "Answer 3."]  # a new branch at the first turn

        # Back to the old branch: by the key on the selected turn, then by clicking ‹ ›.
        pane.select(pane.conversation.path()[1])
        await pilot.press("alt+left")
        await pilot.pause()
        assert shown(pane) == ["first question", "Answer 1.", "second question", "Answer 2."]
        view = next(v for v in pane.log_view.query(MessageView) if v.node.content == "Answer 1.")
        header = view.query_one(".message-header", Static)
        right = len("Assistant  ‹ 1/2 ")  # the column of the › in "Assistant  ‹ 1/2 ›"
        await pilot.click(header, offset=(right, 0))
        await wait_for(pilot, lambda: shown(pane) == ["first question", "Answer 3."], "the click's branch")
        await app.action_quit()


async def test_edit_and_resend_an_earlier_message(tmp_path: Path) -> None:
    client = NumberedReplies()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await two_exchanges(pilot, app)
        pane.select(pane.conversation.path()[1])  # an answer: its question is the one edited
        await pilot.press("alt+e")
        await pilot.pause()
        assert pane.prompt.text == "first question" and pane.selected is None
        pane.prompt.text = "first question, rephrased"
        await pilot.press("enter")
        await wait_for(pilot, lambda: answered(pane) and len(client.requests) == 3, "the answer to the edit")
        assert [m["content"] for m in client.requests[-1]["messages"]] == ["first question, rephrased"]
        assert shown(pane) == ["first question, rephrased", "Answer 3."]
        assert pane.conversation.branch(pane.conversation.path()[0]).count == 2
        await app.action_quit()


async def test_delete_a_message_and_its_replies_after_asking(tmp_path: Path) -> None:
    client = NumberedReplies()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await two_exchanges(pilot, app)
        pane.select(pane.conversation.path()[2])  # the second question (and its answer with it)
        await pilot.press("alt+x")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "asked")
        assert "and the 1 message(s) after it" in str(app.screen.query_one("#question").render())
        await pilot.press("enter")  # Enter means no: deleting cannot be undone
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmScreen), "closed")
        assert len(shown(pane)) == 4
        await pilot.press("alt+x")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "asked again")
        await pilot.press("y")
        await wait_for(pilot, lambda: shown(pane) == ["first question", "Answer 1."], "deleted")
        session_id = pane.config.db_id
        await app.action_quit()
    with HistoryStore(tmp_path / "history.sqlite3") as store:
        assert [m.content for m in store.path(session_id)] == ["first question", "Answer 1."]
        assert store.search("second") == []


async def test_copy_a_selected_message_and_each_code_block_one_by_one(tmp_path: Path) -> None:
    client = FakeClient(reply=TWO_BLOCKS)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = panes(app)[0]
        await ask(pilot, pane, "show me code")
        view = pane.log_view.query(MessageView).last()
        assert "2 code blocks" in str(view.query_one(".message-footer", Static).render())
        for expected in ("print(1)\n", "echo 2\n", "print(1)\n"):  # and round again
            await pilot.press("alt+c")
            await pilot.pause()
            assert app.clipboard == expected
        await pilot.press("alt+up", "alt+up")  # the question
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.clipboard == "show me code"
        await pilot.press("escape")  # the cursor off: the actions take the last message again
        assert pane.selected is None
        await app.action_quit()
