"""Every key the app answers to, in the user's current keymap."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from chatapp.tui import keymap

EXTRA_KEYS: tuple[tuple[str, str], ...] = (
    ("Enter", "Send the message in the prompt box"),
    ("Ctrl+J", "New line in the prompt box"),
    ("Tab / Shift+Tab", "Move the focus"),
    ("Ctrl+P", "Command palette (every action by name)"),
)
"""Keys that are not remappable actions but belong in the list."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "close", "Close")]

    def __init__(self, keys: Mapping[str, str], log_path: Path | None = None) -> None:
        super().__init__()
        self._keys = keys
        self._log_path = log_path

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide tall"):
            yield Label("Keys", classes="dialog-title")
            yield DataTable(id="keys", cursor_type="row", zebra_stripes=True)
            yield Label(
                'Remap keys in settings.toml under [keys], e.g. regenerate = "f7" ("" unbinds). Esc closes.',
                classes="dialog-hint",
                markup=False,
            )
            if self._log_path is not None:
                yield Label(f"Log: {self._log_path}", id="log-path", classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Key", "Action", "Name in settings")
        for action in keymap.ACTIONS:
            table.add_row(keymap.display_key(keymap.key_for(action.name, self._keys)), action.description, action.name)
        for key, what in EXTRA_KEYS:
            table.add_row(key, what, "")

    def action_close(self) -> None:
        self.dismiss(None)
