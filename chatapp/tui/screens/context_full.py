"""The chat no longer fits the model's context: leave its oldest turns out, summarise them, or neither."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ContextFullScreen(ModalScreen[str | None]):
    """Returns "drop", "summarise", or None (leave the chat as it is)."""

    BINDINGS = [
        Binding("escape", "choose(None)", "Cancel"),
        Binding("d", "choose('drop')", "Drop oldest turns"),
        Binding("s", "choose('summarise')", "Summarise them"),
    ]

    def __init__(self, detail: str) -> None:
        super().__init__()
        self._detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(
                "This chat no longer fits the model's context. Leave its oldest turns out of the prompt "
                "(D), or have the model summarise them (S)? The history keeps every message either way, "
                "and the choice holds for this session's later messages.",
                id="question",
                markup=False,
            )
            yield Label(self._detail, classes="dialog-hint", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Drop oldest (D)", variant="warning", id="drop")
                yield Button("Summarise (S)", variant="primary", id="summarise")
                yield Button("Cancel (Esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#summarise", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)
