"""The text box under a pane: Enter sends, Ctrl+J (or Shift+Enter where the terminal tells) adds a line."""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line prompt box that posts :class:`PromptInput.Submitted` on Enter.

    It edits as a shell's line does: TextArea's own Ctrl+A/E (line start/end), Ctrl+W (word back),
    Ctrl+U/K (to line start/end), plus these; app actions stay on function keys and Alt keys."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+b", "cursor_left", "Back a character", show=False),
        Binding("ctrl+f", "cursor_right", "Forward a character", show=False),
        Binding("alt+b", "cursor_word_left", "Back a word", show=False),
        Binding("alt+f", "cursor_word_right", "Forward a word", show=False),
    ]

    class Submitted(Message):
        """The user pressed Enter with this text (already stripped, never empty)."""

        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, *, id: str | None = None, placeholder: str = "") -> None:
        super().__init__(
            id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus", placeholder=placeholder, compact=True
        )

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(self, text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
