"""A small dialog asking for a session's new title."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class RenameScreen(ModalScreen[str | None]):
    """Returns the new title, or None when cancelled (Escape)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self._title = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Rename session", classes="dialog-title")
            yield Input(self._title, placeholder="Session title", id="title")
            yield Label("Enter saves, Esc cancels", classes="dialog-hint")

    @on(Input.Submitted)
    def _save(self, event: Input.Submitted) -> None:
        title = event.value.strip()
        if not title:
            self.notify("A title cannot be empty.", severity="warning")
            return
        self.dismiss(title[:200])

    def action_cancel(self) -> None:
        self.dismiss(None)
