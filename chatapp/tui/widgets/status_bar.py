"""The line at the bottom: engine state, model, device, KV cache, prefix hits, speed, API port, history."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from chatapp.tui.engine_link import EngineSnapshot

_STATE_STYLES = {
    "ready": "bold green",
    "busy": "bold yellow",
    "starting": "bold cyan",
    "loading": "bold cyan",
    "dead": "bold white on red",
    "off": "dim",
}


class StatusBar(Widget):
    """Draws reactives set by the main screen; holds no logic of its own."""

    engine: reactive[EngineSnapshot] = reactive(EngineSnapshot("starting"), layout=False)
    session_rate: reactive[float | None] = reactive(None)
    server_url: reactive[str | None] = reactive(None)
    api_requests: reactive[tuple[int, int]] = reactive((0, 0))
    api_elsewhere: reactive[bool] = reactive(False)
    """The API port at server_url is another chatapp window's (its counts are not ours to show)."""
    """The API port's requests (running now, served in all since it opened)."""
    history_failing: reactive[bool] = reactive(False)
    restart_key: reactive[str] = reactive("F10")
    help_key: reactive[str] = reactive("F1")

    def render(self) -> Text:
        e = self.engine
        state = e.state
        if state in ("starting", "loading") and e.progress is not None:
            state = f"{state} {e.progress:.0%}"
        text = Text()
        text.append(f" {state} ", style=_STATE_STYLES.get(e.state, "bold"))
        if e.state == "dead":
            text.append(f" {self.restart_key} restarts", style="bold")
        elif e.detail and e.state in ("starting", "loading"):
            # The whole line of what the engine is doing (compiling kernels, reading weights): while it
            # loads, this is the news, so it stands alone rather than being cut to fit the figures.
            text.append(f" {e.detail}", style="italic")
            if self.server_url:  # what stays true while it loads: the port is open, the history failing
                text.append(f"  │ API {self.server_url}/v1")
            if self.history_failing:
                text.append("  ⚠ history not saved", style="bold red")
            text.append(f"  {self.help_key} help", style="dim")
            return text
        parts = [e.model or "no model"]
        if e.device:
            parts.append(e.device)
        if e.kv_used is not None:
            parts.append(f"KV {e.kv_used:.0%}")
        if e.prefix_hit_rate is not None:
            parts.append(f"prefix hits {e.prefix_hit_rate:.0%}")
        parts.append(f"{self.session_rate:.1f} tok/s" if self.session_rate is not None else "– tok/s")
        if self.server_url and self.api_elsewhere:
            parts.append(f"API {self.server_url}/v1 (another window's)")
        elif self.server_url:
            running, total = self.api_requests
            parts.append(f"API {self.server_url}/v1 · {running} running, {total} served")
        else:
            parts.append("API off")
        text.append("  " + " │ ".join(parts))
        if self.history_failing:
            text.append("  ⚠ history not saved", style="bold red")
        text.append(f"  {self.help_key} help", style="dim")
        return text
