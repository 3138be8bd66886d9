"""One chat session: its messages, its prompt box, and the worker streaming its answer.

Why it streams this way: the engine call runs in a Textual worker, which only
appends each delta's text to a list; the app's one stream clock
(``stream_clock``) tells every streaming pane to flush on the same tick, and a
flush hands what has gathered to the answer's view in one piece without
awaiting, so all panes change in one frame and the screen is laid out once for
all of them (each layout costs tens of milliseconds: it, not the text, is most
of the TUI's CPU). The partial answer is saved to the history at most every
``SAVE_S``. The UI therefore does a bounded amount of work per tick, however
many panes stream and however fast, and none while nothing streams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import var
from textual.timer import Timer
from textual.widgets import Static, TextArea
from textual.worker import Worker

from chatapp.engine.api import EngineDeadError, EngineError, InvalidRequestError
from chatapp.engine.reasoning import ReasoningSplitter
from chatapp.history import Metrics
from chatapp.tui import titles
from chatapp.tui.code_blocks import code_blocks
from chatapp.tui.context_fit import ContextFit, is_context_error
from chatapp.tui.conversation import Conversation, Node
from chatapp.tui.fitted_stream import chained, open_stream
from chatapp.tui.session_config import SessionConfig, SessionConfigError
from chatapp.tui.stream_clock import clock_for
from chatapp.tui.widgets.layout_sized import LaidOutOnce
from chatapp.tui.widgets.message_view import MessageView
from chatapp.tui.widgets.prompt_input import PromptInput

if TYPE_CHECKING:
    from chatapp.tui.services import ChatServices

_RUN = uuid.uuid4().hex[:8]
"""Makes request ids unique among the TUIs (processes) that share one engine."""
SAVE_S = 0.5
"""How often a streaming answer's text so far is saved to the history."""
DRAFT_SAVE_S = 1.0
"""How long the prompt rests before its unsent text is saved with the session."""
RATE_MIN_S = 0.05
"""Shortest span a tokens-per-second figure is taken over: a rate over a few tokens in a millisecond
(a stream cut off at once, the engine dying) is noise, not speed."""


def model_label(spec: str) -> str:
    """A model as a pane shows it: a store name as it is, a file or folder by its name."""
    if spec.startswith(("/", "~", ".")):
        name = spec.rstrip("/").rsplit("/", 1)[-1]
        return name.removesuffix(".gguf")
    return spec


class MessageLog(LaidOutOnce, VerticalScroll):
    """The pane's scrolling list of messages (it grows with every streamed tick: layout_sized.py)."""


class ChatPane(Vertical):
    """A session pane. The main screen lays panes out and routes keys to the focused one."""

    class Changed(Message):
        """Title, busy state or rate changed, or focus came in (``focused``): the tab bar and status
        bar redraw, and a pane that focus came into becomes the active one."""

        def __init__(self, pane: ChatPane, focused: bool = False) -> None:
            super().__init__()
            self.pane = pane
            self.focused = focused

    class CompareSubmitted(Message):
        """A message sent in a pane marked for compare mode: the main screen sends it to every marked pane."""

        def __init__(self, pane: ChatPane, text: str) -> None:
            super().__init__()
            self.pane = pane
            self.text = text

    # Plain vars, not repainting reactives: the pane draws none of them itself (the status bar and the
    # classes they set do), and repainting the whole pane per streamed tick was a third of the redraw.
    busy: var[bool] = var(False)
    """An answer is being generated."""
    rate: var[float | None] = var(None)
    """Tokens per second of the answer being written, else of the last one shown."""
    editing: var[Node | None] = var(None, init=False)
    """The user message being edited (Enter resends it as a new branch)."""
    compare: var[bool] = var(False, init=False)
    """Marked for compare mode: what is sent in any marked pane is sent in all of them."""

    def __init__(
        self, services: ChatServices, config: SessionConfig, conversation: Conversation, *, id: str | None = None
    ) -> None:
        super().__init__(id=id, classes="chat-pane")
        self.services = services
        self._config = config
        self.conversation = conversation
        self._pending: list[str] = []  # answer text not yet on screen
        self._pending_thought: list[str] = []  # think-block text not yet on screen
        self._worker: Worker[None] | None = None
        self._answer: Node | None = None
        # The stream in progress (one per pane at a time): the view it writes to
        self._stream: MessageView | None = None
        self._save_timer: Timer | None = None
        self._last_save = 0.0
        self._first_token: float | None = None
        self._n_out = 0
        self._draft_timer: Timer | None = None
        self._typed = config.draft  # the prompt's text as of its last change (kept here for on_unmount)
        self._before_continue: tuple[str, bool, Metrics | None, int] | None = None
        self.selected: Node | None = None
        """The message cursor: the message the message actions act on (None: the last one of its kind)."""
        self._code_copied: tuple[Node, int] | None = None  # the code block Alt+C copied last
        self._context_fit = ContextFit.from_json(config.context_fit)
        self._context_full: str | None = None  # the context error of the answer just ended

    # -- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield MessageLog(classes="message-log")
        yield Static("", classes="pane-notice")
        yield PromptInput(placeholder="Message (Enter sends, Ctrl+J new line)", id=f"{self.id}-prompt")

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one(".message-log", VerticalScroll)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def on_mount(self) -> None:
        await self.show_path()  # (which sets the titles too)
        self.log_view.anchor()
        if self.config.draft:
            self.prompt.text = self.config.draft
            self.prompt.move_cursor(self.prompt.document.end)

    # -- the draft ----------------------------------------------------------------------------

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area is not self.prompt or self.editing is not None:
            return  # an edit of a sent message is not a draft
        self._typed = event.text_area.text
        if self._draft_timer is not None:
            self._draft_timer.stop()
        self._draft_timer = self.set_timer(DRAFT_SAVE_S, self.save_draft)

    def save_draft(self) -> None:
        """Keep the prompt's unsent text with the session (at rest, on send, when the pane goes)."""
        if self._draft_timer is not None:
            self._draft_timer.stop()
            self._draft_timer = None
        if self.editing is not None:
            return  # the prompt holds a sent message being edited; the draft is stashed (start_edit)
        text = self._typed
        if text != self.config.draft:
            self.config.draft = text
            self.services.recorder.update_session(self.config.db_id, draft=text)

    def on_unmount(self) -> None:
        self.save_draft()

    def update_titles(self) -> None:
        self.border_title = ("⇶ " if self.compare else "") + (self.config.title or "Untitled")
        if self.config.is_remote:
            where = self.config.backend.endpoint or self.config.backend.base_url or "remote"
            self.border_subtitle = f"{self.config.model or '?'} @ {where}"
        else:
            self.border_subtitle = self.model_name() or "local engine"
        used = self.context_used()
        if used is not None:
            context = None if self.config.is_remote else self.services.local_context_length(self.config.model)
            self.border_subtitle += f" · {used:,}" + (f"/{context:,}" if context else "") + " tokens"
        self.post_message(self.Changed(self))

    @property
    def config(self) -> SessionConfig:
        return self._config

    @config.setter
    def config(self, new: SessionConfig) -> None:
        """A new configuration (F5, a model picked for this pane). A context fit was made for the
        model that needed it: another model starts from the whole chat again (and asks if it too
        runs out)."""
        old = self._config
        self._config = new

        def answerer(c: SessionConfig) -> tuple[str | None, ...]:
            return c.model, c.backend.kind, c.backend.base_url, c.backend.endpoint

        if answerer(old) != answerer(new):
            self.model_changed()

    def model_changed(self) -> None:
        """The model answering here changed (also the engine's default, for a pane that uses it)."""
        self.context_fit = None

    @property
    def context_fit(self) -> ContextFit | None:
        """Set once the chat outgrew the context: how its prompts leave old turns out (context_fit.py).
        Saved with the session whenever it changes."""
        return self._context_fit

    @context_fit.setter
    def context_fit(self, fit: ContextFit | None) -> None:
        if fit == self._context_fit:
            return
        self._context_fit = fit
        self.config.context_fit = None if fit is None else fit.to_json()
        self.services.recorder.update_session(self.config.db_id, context_fit=self.config.context_fit)

    def model_name(self) -> str | None:
        """The model this pane's answers come from: its own, else the local engine's default one."""
        if self.config.model:
            return model_label(self.config.model)
        return None if self.config.is_remote else self.services.local_model_name()

    def context_used(self) -> int | None:
        """Tokens the conversation shown takes: the last answer's prompt plus what it wrote (None before
        any answer has counts). The next question adds to it."""
        for node in reversed(self.conversation.path()):
            m = node.metrics
            if node.role == "assistant" and m is not None and m.prompt_tokens is not None:
                return m.prompt_tokens + (m.completion_tokens or 0)
        return None

    async def show_path(self) -> None:
        """Rebuild the message views for the shown branch (not per token: on send, switch, load)."""
        log = self.log_view
        path = self.conversation.path()
        if self.selected is not None and self.selected not in path:
            self.selected = None
        views = [MessageView(node, self.conversation.branch(node)) for node in path]
        for view in views:
            view.set_class(view.node is self.selected, "selected")
        async with self.batch():
            await log.remove_children()
            await log.mount_all(views)
        last = self.conversation.last("assistant")
        self.rate = last.metrics.tokens_per_second if last and last.metrics else None
        if self.selected is None:
            log.scroll_end(animate=False)
        self.update_titles()  # the context used follows the branch shown

    def notice(self, text: str) -> None:
        """A one-line note above the prompt (model switched, editing, errors)."""
        self.query_one(".pane-notice", Static).update(text)
        self.set_class(bool(text), "has-notice")

    def view_for(self, node: Node) -> MessageView | None:
        return next((v for v in self.log_view.query(MessageView) if v.node is node), None)

    def on_descendant_focus(self) -> None:
        self.post_message(self.Changed(self, focused=True))

    def watch_busy(self) -> None:
        self.set_class(self.busy, "busy")
        self.post_message(self.Changed(self))

    def watch_rate(self) -> None:
        self.post_message(self.Changed(self))

    def watch_compare(self) -> None:
        self.set_class(self.compare, "compare")
        self.update_titles()

    def watch_editing(self, node: Node | None) -> None:
        self.notice("Editing your message: Enter sends it as a new branch, Esc cancels." if node else "")

    # -- the message cursor ------------------------------------------------------------------------

    def select(self, node: Node | None) -> None:
        """Put the message cursor on ``node`` (None: off; the actions then take the last message)."""
        self.selected = node
        self._code_copied = None
        for view in self.log_view.query(MessageView):
            view.set_class(view.node is node, "selected")
            if view.node is node:
                self.log_view.scroll_to_widget(view, animate=False)

    def move_selection(self, step: int) -> None:
        """The cursor to the previous (-1) or next (+1) message; from none, up starts at the last one."""
        path = self.conversation.path()
        if not path:
            return
        if self.selected is None or self.selected not in path:
            index = len(path) - 1 if step < 0 else None
        else:
            index = path.index(self.selected) + step
            index = index if 0 <= index < len(path) else None if index >= len(path) else 0
        self.select(path[index] if index is not None else None)

    def target(self, role: str | None = None) -> Node | None:
        """What a message action acts on: the selected message (for a role, the nearest of that role at
        or above it), else the last message of that role."""
        node = self.selected
        if node is None:
            return self.conversation.last(role) if role else self.conversation.leaf
        while role is not None and node is not None and node.role != role:
            node = node.parent
        return node

    async def on_message_view_clicked(self, event: MessageView.Clicked) -> None:
        event.stop()
        self.select(event.view.node)
        if event.branch_step is not None:
            await self.switch_branch(event.branch_step)

    def next_code_block(self) -> tuple[str, int, int] | None:
        """The next code block of the target message to copy: (code, its number, how many); repeated
        presses go through them one by one."""
        node = self.target("assistant") if self.selected is None else self.selected
        blocks = code_blocks(node.content) if node is not None else []
        if node is None or not blocks:
            return None
        last = self._code_copied
        number = last[1] % len(blocks) + 1 if last is not None and last[0] is node else 1
        self._code_copied = (node, number)
        return blocks[number - 1], number, len(blocks)

    @work(group="delete-message", exclusive=True, exit_on_error=False)
    async def delete_message(self) -> None:
        """Delete the target message and every reply under it, after asking (Enter means no)."""
        from chatapp.tui.screens.confirm import ConfirmScreen

        if self.busy:
            self.app.notify("Stop the current answer first (Esc).", severity="warning")
            return
        node = self.target()
        if node is None:
            self.app.notify("There is no message to delete.", severity="warning")
            return
        below = len(self.conversation.subtree(node)) - 1
        what = "this message" + (f" and the {below} message(s) after it (every branch)" if below else "")
        if not await self.app.push_screen_wait(ConfirmScreen(f"Delete {what}?", yes="Delete", focus_yes=False)):
            return
        self.conversation.remove(node)
        self.services.recorder.delete_message(node)
        self.services.recorder.select_leaf(self.config.db_id, self.conversation.leaf)
        self.selected = None
        await self.show_path()

    # -- user actions (called by the main screen) -------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.compare and self.editing is None:
            self.post_message(self.CompareSubmitted(self, event.text))
            return
        await self.send(event.text)

    async def send(self, text: str, *, from_prompt: bool = True) -> bool:
        """Add the user's message (or the edit of one) and start the answer; False if refused.

        ``from_prompt=False``: the text came from another pane (compare mode); this pane's prompt,
        draft and edit in progress are left as they are."""
        if self.busy:
            self.app.notify(
                f"{self.config.title} is still answering; press Esc there to stop it first.", severity="warning"
            )
            return False
        editing = self.editing if from_prompt else None
        parent = editing.parent if editing is not None else self.conversation.leaf
        if parent is not None and parent.role == "user":
            # The last answer failed before it was saved: answer this message again rather than
            # stacking two user messages.
            parent = parent.parent
        user = self.conversation.add(parent, "user", text)
        self.services.recorder.save(self.config.db_id, user)
        if editing is not None:
            self.editing = None
            self._restore_draft()  # the edited message went; the unsent draft comes back
        elif from_prompt:
            self.prompt.clear()
            self._typed = ""
            self.save_draft()
        await self.start_answer(user)
        return True

    async def regenerate(self) -> None:
        """A new answer to the selected (else the last) question, as a sibling of the old one."""
        if self.busy:
            self.app.notify("Stop the current answer first (Esc).", severity="warning")
            return
        leaf = self.selected or self.conversation.leaf
        question = leaf.parent if leaf is not None and leaf.role == "assistant" else leaf
        if question is None or question.role != "user":
            self.app.notify("There is no answer to regenerate yet.", severity="warning")
            return
        await self.start_answer(question)

    def start_edit(self) -> None:
        """Put the last user message in the prompt box; Enter then sends it as a sibling."""
        if self.busy:
            self.app.notify("Stop the current answer first (Esc).", severity="warning")
            return
        node = self.target("user")
        if node is None:
            self.app.notify("There is no message of yours to edit.", severity="warning")
            return
        self.select(None)
        if self.editing is None:
            self.save_draft()  # what was typed comes back when the edit is sent or cancelled
        self.editing = node
        self.prompt.text = node.content
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def cancel_edit(self) -> bool:
        if self.editing is None:
            return False
        self.editing = None
        self._restore_draft()
        return True

    def _restore_draft(self) -> None:
        self.prompt.text = self.config.draft
        self._typed = self.config.draft
        self.prompt.move_cursor(self.prompt.document.end)

    async def switch_branch(self, step: int) -> None:
        """Show the previous (-1) or next (+1) branch of the deepest turn that has several."""
        if self.busy:
            self.app.notify("Stop the current answer first (Esc).", severity="warning")
            return
        selected = self.selected
        point = selected if selected is not None and len(self.conversation.siblings(selected)) > 1 else None
        point = point or self.conversation.branch_point()
        if point is None:
            self.app.notify("This conversation has no other branches.", severity="information")
            return
        shown = self.conversation.switch(point, step)
        if shown is None:
            return
        if selected is point:
            self.selected = shown  # the cursor stays on the turn, now on its other branch
        self.services.recorder.select_leaf(self.config.db_id, self.conversation.leaf)
        await self.show_path()

    def stop(self) -> bool:
        """Stop the answer being generated (it is kept, marked incomplete); False if none is."""
        if self._worker is None or not self.busy:
            return False
        self._worker.cancel()
        return True

    # -- streaming --------------------------------------------------------------------------

    async def continue_answer(self) -> None:
        """Go on with the shown answer where it stopped at the token limit (the same message grows)."""
        if self.busy:
            self.app.notify("Stop the current answer first (Esc).", severity="warning")
            return
        answer = self.conversation.leaf
        unfinished = answer is not None and (answer.truncated or answer.status == "incomplete")
        if answer is None or answer.role != "assistant" or not unfinished or not answer.content:
            self.app.notify(
                "Only an answer that stopped early (at the token limit, or stopped) can be continued.",
                severity="warning",
            )
            return
        # What it was, should the continuation fail before it adds a word (no room left, a server
        # without continue_final_message, Esc at once): the answer stays as it was, still continuable.
        self._before_continue = (answer.status, answer.truncated, answer.metrics, len(answer.content))
        answer.status, answer.truncated = "streaming", False
        self.services.recorder.reopen(answer)
        view = self.view_for(answer)
        if view is not None:
            view.refresh_meta()
        self.busy = True
        self._worker = self._generate(answer, continuing=True)

    async def start_answer(self, question: Node) -> None:
        answer = self.conversation.add(question, "assistant", "", status="streaming", model=self.model_name())
        self.services.recorder.save(self.config.db_id, answer, streaming=True)
        await self.show_path()
        self.busy = True
        self._worker = self._generate(answer)

    @work(group="generate", exit_on_error=False)
    async def _generate(self, answer: Node, continuing: bool = False) -> None:
        """Stream an answer into ``answer``; ``continuing``: its text so far is kept and extended."""
        view = self.view_for(answer)
        assert view is not None
        await view.begin_stream()
        self._stream = view
        clock = clock_for(self.app)
        clock.join(self)
        self._answer = answer
        self._pending, self._pending_thought = [], []
        self._last_save = started = time.monotonic()
        self._first_token = None
        n_prompt = n_out = 0
        finish: str | None = None
        error: str | None = None
        thinking = ReasoningSplitter()  # a think block goes to its fold, the rest to the Markdown
        try:
            params = self.config.sampling_params()
            client = await self.services.client_for(self.config)
            ready = getattr(client, "ready", None)  # a model beside the engine's default: loaded on demand
            if ready is not None and self.config.model and not self.config.is_remote:
                if self.services.local_context_length(self.config.model) is None:
                    self.notice(f"Loading {model_label(self.config.model)}…")
                    try:
                        await ready()
                    finally:
                        self.notice("")
            messages = self.conversation.chat_messages(self.config.system_prompt, answer.parent)
            if continuing:
                messages.append({"role": "assistant", "content": answer.content})
            request_id = f"tui-{_RUN}-{answer.key}" + (f"-{len(answer.content)}" if continuing else "")
            gen, first = await open_stream(self, client, messages, params, request_id, continuing)
            try:
                async for delta in chained(first, gen):
                    n_prompt, n_out = delta.num_prompt_tokens, delta.num_output_tokens
                    self._n_out = n_out
                    if delta.text:
                        if self._first_token is None:
                            self._first_token = time.monotonic()
                        answer.content += delta.text
                        self._gather(*thinking.feed(delta.text))
                    if delta.finished:
                        finish, error = delta.finish_reason, delta.error
                        self._gather(*thinking.finish())
            finally:
                aclose = getattr(gen, "aclose", None)
                if aclose is not None:
                    await aclose()
        except asyncio.CancelledError:
            finish = "abort"
        except EngineDeadError as exc:
            finish, error = "error", str(exc) or "the engine died"
            if not self.config.is_remote:
                self.services.engine_died(error)
        except (EngineError, InvalidRequestError, SessionConfigError) as exc:
            finish, error = "error", str(exc)
            if isinstance(exc, InvalidRequestError) and is_context_error(exc) and not continuing:
                self._context_full = str(exc)  # offered a way out once the answer is recorded
        finally:
            clock.leave(self)
            await self._end_stream(answer, view, finish, error, started, n_prompt, n_out)

    @work(group="context-fit", exclusive=True, exit_on_error=False)
    async def _offer_context_fit(self, answer: Node, detail: str) -> None:
        """The chat outgrew the context: ask whether to drop or summarise old turns, then answer again."""
        from chatapp.tui.screens.context_full import ContextFullScreen

        choice = await self.app.push_screen_wait(ContextFullScreen(detail))
        question = answer.parent
        if choice is None or self.busy or question is None or question.role != "user":
            return
        self.context_fit = ContextFit(choice)
        await self.start_answer(question)

    def _gather(self, thought: str, text: str) -> None:
        """Keep a delta's reasoning and answer text for the next tick."""
        if thought:
            self._pending_thought.append(thought)
        if text:
            self._pending.append(text)

    def flush(self) -> AwaitComplete | None:
        """Hand the text gathered since the last tick to the answer's view, in one piece (the stream
        clock calls this for every pane in one frame); returns the Markdown append it started."""
        view = self._stream
        if view is None or not (self._pending or self._pending_thought):
            return None
        appending = None
        if self._pending_thought:
            view.add_thinking("".join(self._pending_thought))
            self._pending_thought.clear()
        if self._pending:
            appending = view.stream("".join(self._pending))
            self._pending.clear()
        now = time.monotonic()
        if self._first_token is not None and now - self._first_token >= RATE_MIN_S:
            self.rate = self._n_out / (now - self._first_token)
        if self._save_timer is None:
            delay = SAVE_S - (now - self._last_save)
            if delay > 0:
                self._save_timer = self.set_timer(delay, self._save_partial)
            else:  # due already: a 0-second Textual timer divides by its interval when it runs late
                self._save_partial()
        return appending

    def _save_partial(self) -> None:
        """Save the streaming answer's text so far (at most every SAVE_S, and only after new text)."""
        self._save_timer = None
        if self._answer is not None:
            self._last_save = time.monotonic()
            self.services.recorder.update_partial(self.config.db_id, self._answer)

    async def _end_stream(
        self,
        answer: Node,
        view: MessageView,
        finish: str | None,
        error: str | None,
        started: float,
        n_prompt: int,
        n_out: int,
    ) -> None:
        """Deliver the last text, record the outcome and metrics, and save the answer for good."""
        ended = time.monotonic()
        first = self._first_token
        if self._save_timer is not None:
            self._save_timer.stop()
            self._save_timer = None
        self._stream = None
        self._pending.clear()
        if self._pending_thought:
            view.add_thinking("".join(self._pending_thought))
            self._pending_thought.clear()
        _reasoning, shown = view.parts()
        await view.end_stream(shown)  # the whole answer as Markdown, whatever the ticks delivered
        before, self._before_continue = self._before_continue, None
        if before is not None and len(answer.content) == before[3] and finish != "stop":
            # A continuation that added nothing and did not end the answer: it stays as it was.
            answer.status, answer.truncated, answer.metrics, _ = before
            if finish == "error":
                self.app.notify(f"Could not continue the answer: {error or 'it failed'}", severity="error")
        else:
            answer.status = {"stop": "complete", "length": "complete", "abort": "incomplete", None: "incomplete"}.get(
                finish, "error"
            )
            answer.truncated = finish == "length"
            if answer.status == "error":
                answer.error = error or "the answer failed"
            answer.metrics = Metrics(
                n_prompt or None,
                n_out or None,
                (n_out - 1) / (ended - first)
                if first is not None and n_out > 1 and ended - first >= RATE_MIN_S
                else None,
                (first - started) * 1000 if first is not None else None,
            )
        self.services.recorder.finish(self.config.db_id, answer)
        self.rate = answer.metrics.tokens_per_second if answer.metrics else None
        view.refresh_meta()
        self._answer = None
        self._worker = None
        self.busy = False
        self.update_titles()
        if self._context_full is not None:
            detail, self._context_full = self._context_full, None
            self._offer_context_fit(answer, detail)
        saved = answer.db_id is not None or self.config.db_id is None  # (no history at all: name it anyway)
        question = answer.parent
        first_exchange = question is not None and question.parent is None  # (not an older session's later turn)
        if answer.status == "complete" and question is not None and first_exchange and saved:
            if titles.is_placeholder(self.config.title):
                self._name_session(question.content)

    @work(group="titles", exclusive=True, exit_on_error=False)
    async def _name_session(self, question: str) -> None:
        """Name a placeholder-titled session from its first exchange (see titles.py)."""
        title: str | None = None
        if not self.config.is_remote:
            try:
                client = await self.services.client_for(self.config)
                title = await titles.ask_model(client, question, f"tui-{_RUN}-title-{self.id}")
            except (EngineError, InvalidRequestError, SessionConfigError):
                title = None
        title = title or titles.from_question(question)
        if title and titles.is_placeholder(self.config.title):  # the user may have renamed it meanwhile
            self.config.title = title
            self.services.recorder.update_session(self.config.db_id, title=title)
            self.update_titles()
