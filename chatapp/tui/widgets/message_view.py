"""One message of a pane: who wrote it, which branch it is, the Markdown text (a reasoning model's
think block folded above it), and an answer's numbers."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static

from chatapp.engine.reasoning import split_reasoning
from chatapp.tui.conversation import Branch, Node

_STATUS_LABELS = {"streaming": "writing…", "incomplete": "incomplete", "error": "error"}


class MessageView(Vertical):
    """Renders a :class:`Node`; the pane streams into :attr:`body` while an answer is written."""

    def __init__(self, node: Node, branch: Branch) -> None:
        super().__init__(classes=f"message {node.role} status-{node.status}" + (" truncated" if node.truncated else ""))
        self.node = node
        self.branch = branch
        self._thought = ""  # the think block streamed so far

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="message-header")
        reasoning, content = self.parts()
        if reasoning is not None:
            yield self._thinking(reasoning)
        yield Markdown(content, classes="message-body")
        if self.node.role == "assistant":
            yield Static(self._footer(), classes="message-footer")

    def parts(self) -> tuple[str | None, str]:
        """(a reasoning model's think block, the answer) of the message's text."""
        if self.node.role != "assistant":
            return None, self.node.content
        return split_reasoning(self.node.content)

    @property
    def body(self) -> Markdown:
        return self.query_one(".message-body", Markdown)

    def _thinking(self, text: str) -> Collapsible:
        """The think block, folded under a title (Enter or a click opens it)."""
        text_view = Static(text, classes="thinking-text", markup=False)  # model text: no console markup
        return Collapsible(text_view, title="Thinking", classes="message-thinking")

    async def add_thinking(self, text: str) -> None:
        """Append streamed reasoning, folding it in above the answer the first time."""
        self._thought += text
        found = self.query(".message-thinking")
        if not found:
            await self.mount(self._thinking(self._thought), before=self.body)
            return
        found.first(Collapsible).query_one(".thinking-text", Static).update(self._thought)

    def _header(self) -> Text:
        node = self.node
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(node.role, node.role)
        text = Text(who, style="bold")
        # What the user acts on first (the branch, an unfinished answer), the model's name last: a
        # narrow pane wraps the line rather than losing "incomplete" or "‹ 1/2 ›".
        if self.branch.count > 1:
            text.append(f"  ‹ {self.branch.index + 1}/{self.branch.count} ›", style="bold")
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
        return Text(node.metrics.describe() if node.metrics else "", style="dim")

    def refresh_meta(self) -> None:
        """Redraw the header and footer after the node's status, branch or metrics changed."""
        self.remove_class(*(f"status-{s}" for s in ("complete", "streaming", "incomplete", "error")))
        self.add_class(f"status-{self.node.status}")
        self.set_class(self.node.truncated, "truncated")
        self.query_one(".message-header", Static).update(self._header())
        if self.node.role == "assistant":
            self.query_one(".message-footer", Static).update(self._footer())
