"""New comparison: one question asked in N new panes, each with its own model or system prompt."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, TextArea

MAX_PANES = 8
"""More panes than this would not show side by side on any terminal (and each is a stream)."""


@dataclass(frozen=True)
class Comparison:
    """What to open: one (model, system prompt) per pane, and the question they all get."""

    panes: list[tuple[str | None, str]]
    """(model; None: the engine's default, system prompt) of each pane."""
    question: str


def plan_comparison(models_text: str, prompts_text: str, question: str) -> Comparison:
    """The dialog's text -> a Comparison; ValueError says what to fix.

    One line per pane in either list; the other list may hold one line (shared by every pane) or
    none. A line ``default`` (or ``-``) in the models stands for the engine's default model."""
    models = [line.strip() for line in models_text.splitlines() if line.strip()]
    prompts = [line.strip() for line in prompts_text.splitlines() if line.strip()]
    if not question.strip():
        raise ValueError("write the question every pane is asked")
    count = max(len(models), len(prompts))
    if count < 2:
        raise ValueError("a comparison needs two models or two system prompts at least (one a line)")
    if count > MAX_PANES:
        raise ValueError(f"at most {MAX_PANES} panes, got {count}")
    for name, items in (("models", models), ("system prompts", prompts)):
        if len(items) not in (0, 1, count):
            raise ValueError(f"give one line of {name} per pane ({count}), or one for all, or none")
    picked = [None if m in ("default", "-") else m for m in models] if models else [None]
    panes = [(picked[i % len(picked)], prompts[i % len(prompts)] if prompts else "") for i in range(count)]
    return Comparison(panes, question.strip())


class CompareScreen(ModalScreen[Comparison | None]):
    """Returns the comparison to open, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "start", "Start", priority=True)]

    def __init__(self, models: list[str], question: str = "") -> None:
        super().__init__()
        self._models = models
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide tall"):
            yield Label("New comparison", classes="dialog-title")
            with VerticalScroll():
                yield Label("Models, one a line (default: the engine's own); local models: " + self._known())
                yield TextArea("", id="compare-models", classes="short-text")
                yield Label("System prompts, one a line (optional; one line is shared by every pane)")
                yield TextArea("", id="compare-prompts", classes="short-text")
                yield Label("The question")
                yield TextArea(self._question, id="compare-question", classes="short-text")
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Start (Ctrl+S)", variant="primary", id="start")
                yield Button("Cancel (Esc)", id="cancel")

    def _known(self) -> str:
        return ", ".join(self._models[:6]) + (" …" if len(self._models) > 6 else "") if self._models else "(none)"

    def on_mount(self) -> None:
        self.query_one("#compare-models", TextArea).focus()

    @on(Button.Pressed, "#start")
    def action_start(self) -> None:
        try:
            comparison = plan_comparison(
                self.query_one("#compare-models", TextArea).text,
                self.query_one("#compare-prompts", TextArea).text,
                self.query_one("#compare-question", TextArea).text,
            )
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(comparison)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
