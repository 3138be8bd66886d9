"""Per-session settings: title, system prompt, sampling, and the model: local (any, loaded beside the
others) or on a remote server."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from chatapp.history import Backend
from chatapp.tui.session_config import SessionConfig, SessionConfigError, parse_sampling, stop_line

_SAMPLING_ROWS = (
    ("temperature", "top_p", "top_k", "min_p", "max_tokens"),
    ("seed", "repetition_penalty", "presence_penalty", "frequency_penalty"),
)
"""Every number a session's answers are sampled with, as two rows of fields (stop strings below them)."""
_SAMPLING_SHOWN = (*_SAMPLING_ROWS[0], *_SAMPLING_ROWS[1], "stop")


class SessionSettingsScreen(ModalScreen[SessionConfig | None]):
    """Returns the edited config (a copy), or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, config: SessionConfig, endpoints: list[str]) -> None:
        super().__init__()
        self._config = config
        self._endpoints = endpoints

    def compose(self) -> ComposeResult:
        c = self._config
        b = c.backend
        with Vertical(classes="dialog wide tall"):
            yield Label("Session settings", classes="dialog-title")
            with VerticalScroll():
                yield Label("Title")
                yield Input(c.title, id="title")
                yield Label("System prompt")
                yield TextArea(c.system_prompt, id="system-prompt", classes="short-text")
                for row in _SAMPLING_ROWS:
                    with Horizontal(classes="fields"):
                        for name in row:
                            with Vertical(classes="field"):
                                yield Label(name.replace("_penalty", " penalty").replace("_", " "))
                                value = c.sampling.get(name)
                                yield Input("" if value is None else str(value), id=f"s-{name}")
                yield Label(
                    "Stop strings, one a line (\\n newline, \\t tab, \\s space): the answer ends before any of them"
                )
                stops = c.sampling.get("stop") or []
                stops = [stops] if isinstance(stops, str) else stops  # one string (an imported session)
                yield TextArea("\n".join(stop_line(stop) for stop in stops), id="s-stop", classes="short-text")
                yield Label("Answers come from")
                yield Select(
                    [("the local engine", "local"), ("a remote OpenAI-compatible server", "remote")],
                    value=b.kind,
                    allow_blank=False,
                    id="backend",
                )
                with Vertical(id="local-fields"):
                    yield Label("Local model (a name from the models screen, F4; blank: the engine's default)")
                    yield Input("" if c.is_remote else c.model or "", id="local-model")
                with Vertical(id="remote-fields"):
                    yield Label("Endpoint from settings (or leave blank and give a URL)")
                    yield Select(
                        [(name, name) for name in self._endpoints], value=b.endpoint or Select.NULL, id="endpoint"
                    )
                    yield Label("Base URL, e.g. http://127.0.0.1:11434/v1")
                    yield Input(b.base_url or "", id="base-url")
                    yield Label("API key (saved as an endpoint in the settings file, never in the chat history)")
                    yield Input(b.api_key or "", password=True, id="api-key")
                    yield Label("Model name on that server")
                    yield Input(c.model or "", id="model")
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (Ctrl+S)", variant="primary", id="save")
                yield Button("Cancel (Esc)", id="cancel")

    def on_mount(self) -> None:
        self._show_remote(self._config.backend.kind == "remote")

    def _show_remote(self, remote: bool) -> None:
        self.query_one("#remote-fields").display = remote
        self.query_one("#local-fields").display = not remote

    @on(Select.Changed, "#backend")
    def _backend_changed(self, event: Select.Changed) -> None:
        self._show_remote(event.value == "remote")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            config = self._read()
        except (SessionConfigError, ValueError) as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(config)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)

    def _value(self, selector: str) -> str:
        field = self.query_one(selector)
        return (field.text if isinstance(field, TextArea) else self.query_one(selector, Input).value).strip()

    def _read(self) -> SessionConfig:
        sampling = dict(self._config.sampling)
        for name in _SAMPLING_SHOWN:
            sampling.pop(name, None)
        sampling.update(parse_sampling({name: self._value(f"#s-{name}") for name in _SAMPLING_SHOWN}))
        model = self._config.model
        if self.query_one("#backend", Select).value == "remote":
            endpoint = self.query_one("#endpoint", Select).value
            backend = Backend.remote(
                self._value("#base-url") or None,
                endpoint=endpoint if isinstance(endpoint, str) else None,
                api_key=self._value("#api-key") or None,
            )
            model = self._value("#model") or None
            if model is None:
                raise SessionConfigError("a remote session needs the model name to ask the server for")
        else:
            backend = Backend.local()
            model = self._value("#local-model") or None
        return self._config.copy(
            title=self._value("#title") or self._config.title,
            system_prompt=self.query_one("#system-prompt", TextArea).text,
            sampling=sampling,
            backend=backend,
            model=model,
        )
