"""The app settings that are worth a form: default model, theme, engine memory, API port."""

from __future__ import annotations

from pydantic import ValidationError
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from chatapp.settings import Settings


class SettingsScreen(ModalScreen[Settings | None]):
    """Returns a validated copy of the settings to save, or None when cancelled.

    Keys are remapped in the file itself (``[keys]``); the help screen says so.
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, settings: Settings, themes: list[str]) -> None:
        super().__init__()
        self._settings = settings
        self._themes = themes

    def compose(self) -> ComposeResult:
        s = self._settings
        with Vertical(classes="dialog wide"):
            yield Label("Settings", classes="dialog-title")
            yield Label("Default model (name, directory or .gguf; blank: the bundled SmolLM2)")
            yield Input(s.default_model or "", id="default-model")
            yield Label("Theme")
            themes = sorted(set(self._themes) | {s.theme})
            yield Select([(t, t) for t in themes], value=s.theme, allow_blank=False, id="theme")
            yield Label("Engine (applies on the next engine start)")
            with Horizontal(classes="fields"):
                with Vertical(classes="field"):
                    yield Label("Context in tokens (blank: the model's)")
                    yield Input("" if s.engine.max_model_len is None else str(s.engine.max_model_len), id="context")
                with Vertical(classes="field"):
                    yield Label("KV cache cap in GiB (blank: sized to the context)")
                    yield Input(
                        "" if s.engine.kv_cache_memory_gib is None else str(s.engine.kv_cache_memory_gib), id="kv-gib"
                    )
                with Vertical(classes="field"):
                    yield Label("All models in GiB (blank: what is free)")
                    yield Input("" if s.engine.memory_gib is None else str(s.engine.memory_gib), id="memory-gib")
            with Horizontal(classes="fields"):
                with Vertical(classes="field"):
                    yield Label("API host")
                    yield Input(s.server.host, id="host")
                with Vertical(classes="field"):
                    yield Label("API port")
                    yield Input(str(s.server.port), id="port")
                with Vertical(classes="field"):
                    yield Label("API key (blank: none)")
                    yield Input(s.server.api_key or "", password=True, id="api-key")
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (Ctrl+S)", variant="primary", id="save")
                yield Button("Cancel (Esc)", id="cancel")

    def _value(self, selector: str) -> str:
        return self.query_one(selector, Input).value.strip()

    def read(self) -> Settings:
        """The form as Settings; raises ValueError with a readable message."""
        new = self._settings.model_copy(deep=True)
        kv = self._value("#kv-gib")
        budget = self._value("#memory-gib")
        port = self._value("#port")
        try:
            kv_gib = float(kv) if kv else None
        except ValueError:
            raise ValueError(f"engine memory must be a number of GiB, got {kv!r}") from None
        try:
            memory_gib = float(budget) if budget else None
        except ValueError:
            raise ValueError(f"the models' memory must be a number of GiB, got {budget!r}") from None
        if not port.isdigit():
            raise ValueError(f"the API port must be a whole number, got {port!r}")
        context = self._value("#context")
        if context and not context.isdigit():
            raise ValueError(f"the context must be a whole number of tokens, got {context!r}")
        try:
            new.default_model = self._value("#default-model") or None
            new.theme = str(self.query_one("#theme", Select).value)
            new.engine.kv_cache_memory_gib = kv_gib
            new.engine.memory_gib = memory_gib
            new.engine.max_model_len = int(context) if context else None
            new.server.host = self._value("#host")
            new.server.port = int(port)
            new.server.api_key = self._value("#api-key") or None
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(p) for p in error["loc"])
            raise ValueError(f"{field}: {error['msg']}") from None
        return new

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            self.dismiss(self.read())
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
