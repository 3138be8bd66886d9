"""A chat that outgrows the model's context (issue 18): the pane offers to drop or summarise its oldest
turns instead of failing every later message; the history keeps every message."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.tui.context_fit import SUMMARY_INTRO, ContextFit, can_drop, fit_messages, is_context_error
from chatapp.tui.screens.context_full import ContextFullScreen
from tests.tui_fakes import FakeClient
from tests.tui_helpers import answered, ask, make_app, panes, send, wait_for

pytestmark = pytest.mark.timeout(60)


async def overflow(pilot, app, client: FakeClient) -> None:  # noqa: ANN001
    """Two exchanges fit; the third question makes the prompt too long and the dialog opens."""
    pane = panes(app)[0]
    await ask(pilot, pane, "first question")
    await ask(pilot, pane, "second question")
    client.max_messages = 4  # the next prompt has 5 messages: over the "context"
    await send(pilot, pane, "third question")
    await wait_for(pilot, lambda: isinstance(app.screen, ContextFullScreen), "the offer to fit the chat")
    assert pane.conversation.path()[-1].status == "error"  # the refused answer is recorded as failed


async def overflow_and_drop(pilot, app, client: FakeClient):  # noqa: ANN001, ANN201
    """overflow(), then "Drop oldest": the third question is answered with the first exchange left out."""
    await overflow(pilot, app, client)
    pane = panes(app)[0]
    await pilot.press("d")
    await wait_for(pilot, lambda: answered(pane, 3) and pane.conversation.path()[-1].status == "complete", "answer")
    return pane


async def test_dropping_the_oldest_turns_answers_and_keeps_doing_so(tmp_path: Path) -> None:
    client = FakeClient(reply="Answer.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await overflow_and_drop(pilot, app, client)
        sent = [m["content"] for m in client.requests[-1]["messages"]]
        assert sent == ["second question", "Answer.", "third question"]  # the oldest exchange left out
        assert pane.context_fit == ContextFit("drop", dropped=1)
        assert "oldest exchange(s) are left out" in str(pane.query_one(".pane-notice").render())
        await ask(pilot, pane, "fourth question")  # the choice holds: one more old exchange goes
        sent = [m["content"] for m in client.requests[-1]["messages"]]
        assert sent == ["third question", "Answer.", "fourth question"]
        assert len(pane.conversation.chat_messages("", pane.conversation.leaf)) == 8  # history keeps them all
        await app.action_quit()
    # The choice is saved with the session: after a restart the next question is fitted, not refused.
    again = make_app(tmp_path, client)
    async with again.run_test(size=(120, 40)) as pilot:
        pane = panes(again)[0]
        assert pane.context_fit == ContextFit("drop", dropped=2)
        await ask(pilot, pane, "fifth question")
        assert not isinstance(again.screen, ContextFullScreen)
        sent = [m["content"] for m in client.requests[-1]["messages"]]
        assert sent == ["fourth question", "Answer.", "fifth question"]
        await again.action_quit()


async def test_another_model_starts_from_the_whole_chat_again(tmp_path: Path) -> None:
    """A fit was made for the model that ran out; a pane switched to another model (or the engine's
    default changing under it) sends the whole chat again, and is asked anew if that runs out too."""
    client = FakeClient(reply="Answer.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await overflow_and_drop(pilot, app, client)
        assert pane.context_fit == ContextFit("drop", dropped=1)
        saved = lambda: app.store.get_session(pane.config.db_id).context_fit  # noqa: E731
        await wait_for(pilot, lambda: saved() is not None, "the fit saved")

        pane.config = pane.config.copy(system_prompt="Be brief.")  # not a model change: the fit stays
        assert pane.context_fit == ContextFit("drop", dropped=1)
        pane.config = pane.config.copy(model="another-model")
        assert pane.context_fit is None
        await wait_for(pilot, lambda: saved() is None, "the fit dropped from the saved session")

        client.max_messages = 100  # the new model's context holds the whole chat
        await ask(pilot, pane, "fourth question")
        sent = [m["content"] for m in client.requests[-1]["messages"]]
        assert sent[:2] == ["Be brief.", "first question"] and len(sent) == 8  # system + 3 exchanges + new

        # A pane on the engine's default model: a new default is another model too.
        pane.config = pane.config.copy(model=None)
        pane.context_fit = ContextFit("drop", dropped=1)
        app.switch_model("a-bigger-model")
        await wait_for(pilot, lambda: pane.context_fit is None, "the fit dropped with the engine's new model")
        await app.action_quit()


async def test_summarising_the_oldest_turns_puts_the_summary_in_the_prompt(tmp_path: Path) -> None:
    client = FakeClient(reply="Answer.", summary_reply="They asked two questions.")
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        await overflow(pilot, app, client)
        pane = panes(app)[0]
        await pilot.press("s")
        await wait_for(pilot, lambda: answered(pane, 3) and pane.conversation.path()[-1].status == "complete", "answer")
        messages = client.requests[-1]["messages"]
        assert messages[0] == {"role": "system", "content": f"{SUMMARY_INTRO}\nThey asked two questions."}
        assert [m["content"] for m in messages[1:]] == ["second question", "Answer.", "third question"]
        assert "first question" in client.summary_requests[-1][0]["content"]  # what the summary covers
        await app.action_quit()


async def test_cancelling_leaves_the_chat_as_it_was(tmp_path: Path) -> None:
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 40)) as pilot:
        await overflow(pilot, app, client)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ContextFullScreen), "closed")
        pane = panes(app)[0]
        assert pane.context_fit is None and len(client.requests) == 2
        await app.action_quit()


@pytest.mark.parametrize(
    "saved",
    [None, {}, {"mode": "shrink"}, {"mode": "drop", "dropped": -1}, {"mode": "drop", "summary": 3}, "drop"],
)
def test_a_saved_fit_this_version_cannot_read_is_no_fit(saved: object) -> None:
    assert ContextFit.from_json(saved) is None  # type: ignore[arg-type]
    fit = ContextFit("summarise", dropped=2, summary="They met.")
    assert ContextFit.from_json(fit.to_json()) == fit


def test_a_fit_that_counts_more_exchanges_than_the_branch_has_keeps_the_question() -> None:
    """A fit saved on a longer branch (or in an earlier run) never leaves out the new question."""
    messages = [
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "new"},
    ]
    assert fit_messages(messages, ContextFit("drop", dropped=5)) == messages[2:]


def test_fit_messages_keeps_the_system_prompt_and_the_new_question() -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert fit_messages(chat, None) == chat
    assert fit_messages(chat, ContextFit("drop", 1)) == [chat[0], chat[3]]
    summarised = fit_messages(chat, ContextFit("summarise", 1, "S."))
    assert summarised[0]["content"] == f"Be brief.\n\n{SUMMARY_INTRO}\nS." and summarised[1:] == [chat[3]]
    assert can_drop(chat, 0) and not can_drop(chat, 1)  # the exchange with the new question stays
    assert is_context_error(ValueError("This model's maximum context length is 2048 tokens. However, ..."))
    assert not is_context_error(ValueError("the prompt is empty"))
