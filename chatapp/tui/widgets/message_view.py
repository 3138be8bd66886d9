"""One message of a pane: who wrote it, which branch it is, the Markdown text (a reasoning model's
think block folded above it), and an answer's numbers.

While an answer streams, its finished blocks go to the Markdown once each and the block still being
written is shown as plain text below them (see ``markdown_tail`` and ``markdown_text``): a tick then
redraws one small widget, and the last block takes its formatting as soon as it ends.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Static

from chatapp.engine.reasoning import split_reasoning
from chatapp.tui.code_blocks import code_blocks
from chatapp.tui.conversation import Branch, Node
from chatapp.tui.markdown_tail import settled_length
from chatapp.tui.widgets.layout_sized import LaidOutOnce
from chatapp.tui.widgets.markdown_text import MarkdownText

_STATUS_LABELS = {"streaming": "writing…", "incomplete": "incomplete", "error": "error"}


class MessageView(LaidOutOnce, Vertical):
    """Renders a :class:`Node`; the pane streams into :attr:`body` while an answer is written."""

    class Clicked(Message):
        """The message was clicked: the pane's message cursor moves to it (``branch_step``: the click was
        on the ‹ or › of its branch counter, -1 or +1)."""

        def __init__(self, view: MessageView, branch_step: int | None) -> None:
            super().__init__()
            self.view = view
            self.branch_step = branch_step

    def __init__(self, node: Node, branch: Branch) -> None:
        super().__init__(classes=f"message {node.role} status-{node.status}" + (" truncated" if node.truncated else ""))
        self.node = node
        self.branch = branch
        self._thought = ""  # the think block streamed so far
        self._thought_view: Static | None = None  # its text widget, once folded in
        self._streamed: str | None = None  # the answer's text so far while it streams (else None)
        self._appending: AwaitComplete | None = None  # the Markdown's append in progress

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="message-header")
        reasoning, content = self.parts()
        if reasoning is not None:
            yield self._thinking(reasoning)
        yield MarkdownText(content, classes="message-body")
        if self.node.role == "assistant":
            yield Static(self._footer(), classes="message-footer")

    def parts(self) -> tuple[str | None, str]:
        """(a reasoning model's think block, the answer) of the message's text."""
        if self.node.role != "assistant":
            return None, self.node.content
        return split_reasoning(self.node.content)

    @property
    def body(self) -> MarkdownText:
        return self.query_one(".message-body", MarkdownText)

    @property
    def shown_text(self) -> str:
        """The answer's text on screen: the Markdown's, and while streaming the block being written."""
        if self._streamed is not None:
            return self._streamed
        return self.body.source

    async def begin_stream(self) -> None:
        """Streamed text comes next (after what the body shows: a continuation extends it, and its last
        block, which may be cut mid-way, goes back to being the block being written)."""
        source = self.body.source
        settled = settled_length(source)
        if settled < len(source):
            await self.body.update(source[:settled])
            self.body.set_tail(source[settled:])
        self._streamed = source

    def stream(self, text: str) -> AwaitComplete | None:
        """Show ``text`` more of the answer, without awaiting (the stream clock calls this for every
        pane in one tick). Finished blocks are appended to the Markdown, one append at a time: the
        append started, if any, is returned (the clock waits for it before the screen is drawn)."""
        if self._streamed is None:
            raise RuntimeError("stream() before begin_stream()")
        self._streamed += text
        body = self.body
        done = len(body.source)
        started: AwaitComplete | None = None
        if self._appending is None or self._appending.is_done:
            self._appending = None
            settled = settled_length(self._streamed)
            if settled > done:
                self._appending = started = body.append(self._streamed[done:settled])
                done = settled
        body.set_tail(self._streamed[done:])
        return started

    async def end_stream(self, shown: str) -> None:
        """The answer ended as ``shown``: it is drawn again as one piece of Markdown, tail gone."""
        if self._appending is not None:
            await self._appending
            self._appending = None
        await self.body.update(shown)
        self._streamed = None  # (after: until the new chunk is in, the text shown is the streamed one)

    def _thinking(self, text: str) -> Collapsible:
        """The think block, folded under a title (Enter or a click opens it)."""
        self._thought = text
        self._thought_view = Static(text, classes="thinking-text", markup=False)  # model text: no markup
        return Collapsible(self._thought_view, title="Thinking", classes="message-thinking")

    def add_thinking(self, text: str) -> None:
        """Append streamed reasoning, folding it in above the answer the first time (without awaiting:
        the stream clock calls this with the answer's text, for every pane in one tick)."""
        if self._thought_view is None:
            self.mount(self._thinking(text), before=self.body)
        else:
            self._thought += text
            self._thought_view.update(self._thought)

    def _header(self) -> Text:
        node = self.node
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(node.role, node.role)
        text = Text(who, style="bold")
        # What the user acts on first (the branch, an unfinished answer), the model's name last: a
        # narrow pane wraps the line rather than losing "incomplete" or "‹ 1/2 ›".
        if self.branch.count > 1:  # the arrows are clickable (their style carries the step)
            text.append("  ")
            text.append("‹", style=Style(bold=True, meta={"branch_step": -1}))
            text.append(f" {self.branch.index + 1}/{self.branch.count} ", style="bold")
            text.append("›", style=Style(bold=True, meta={"branch_step": 1}))
        label = _STATUS_LABELS.get(node.status)
        if label:
            text.append(f"  {label}", style="italic")
        elif node.truncated:
            text.append("  stopped at the token limit", style="italic")
        if node.role == "assistant" and node.model:
            text.append(f" · {node.model}", style="dim")
        return text

    def _footer(self) -> Text:
        node = self.node
        if node.status == "error" and node.error:
            return Text(f"⚠ {node.error}", style="bold")
        text = Text(node.metrics.describe() if node.metrics else "", style="dim")
        blocks = len(code_blocks(node.content)) if node.status != "streaming" else 0
        if blocks > 1:  # Alt+C copies them one by one, in this order
            text.append(f"{' · ' if text else ''}{blocks} code blocks", style="dim")
        return text

    def on_click(self, event: events.Click) -> None:
        step = event.style.meta.get("branch_step") if event.style else None
        self.post_message(self.Clicked(self, step if isinstance(step, int) else None))

    def refresh_meta(self) -> None:
        """Redraw the header and footer after the node's status, branch or metrics changed."""
        self.remove_class(*(f"status-{s}" for s in ("complete", "streaming", "incomplete", "error")))
        self.add_class(f"status-{self.node.status}")
        self.set_class(self.node.truncated, "truncated")
        self.query_one(".message-header", Static).update(self._header())
        if self.node.role == "assistant":
            self.query_one(".message-footer", Static).update(self._footer())
