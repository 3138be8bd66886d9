"""A yes/no question before an action the user may not mean (closing a pane with an unsent message)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmScreen(ModalScreen[bool]):
    """Returns True for yes (Enter, y), False for no (Escape, n)."""

    BINDINGS = [
        Binding("escape,n", "answer(False)", "No"),
        Binding("y", "answer(True)", "Yes"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "Cancel", *, focus_yes: bool = True) -> None:
        """``focus_yes=False`` for what cannot be undone: Enter then means no."""
        super().__init__()
        self._question, self._yes, self._no = question, yes, no
        self._focus_yes = focus_yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self._question, id="question", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._yes, variant="warning", id="yes")
                yield Button(self._no, id="no")

    def on_mount(self) -> None:
        self.query_one("#yes" if self._focus_yes else "#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
