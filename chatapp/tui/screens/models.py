"""Models: those on disk, a Hub search with a fits/slow/won't-fit label, downloads, and switching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label, ProgressBar

from chatapp.model_facts import format_bytes, format_count
from chatapp.tui.model_catalog import HubEntry, LocalEntry

if TYPE_CHECKING:
    from chatapp.tui.services import ModelScreenServices

_LABEL_STYLES = {"fits": "green", "will be slow": "yellow", "will not fit": "red"}


class ModelScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+x", "cancel_download", "Cancel download", priority=True),
        Binding("ctrl+l", "reload", "Reload list", priority=True),
        Binding("u", "use_here", "Use in this pane"),
        Binding("n", "use_in_new_pane", "Use in a new pane"),
    ]

    def __init__(self, services: ModelScreenServices) -> None:
        super().__init__()
        self.services = services

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide tall"):
            yield Label("Models", classes="dialog-title")
            yield Label("", id="current-model")
            # U and N: a pane of its own beside the others; Enter: the engine's default model for every pane.
            yield Label("Local · U: this pane · N: new pane · Enter: default", classes="section")
            yield DataTable(id="local", cursor_type="row", zebra_stripes=True)
            yield Label("Hugging Face Hub (Enter searches; Enter on a result downloads it)", classes="section")
            yield Input(placeholder="Search text-generation models…", id="hub-search")
            yield Label("", id="hub-status", classes="dialog-error", markup=False)
            yield DataTable(id="hub", cursor_type="row", zebra_stripes=True)
            with Vertical(id="download"):
                yield Label("", id="download-label")
                yield ProgressBar(id="download-progress", show_eta=False)
            yield Label(
                "Ctrl+X cancels the download · downloads go on when this screen is closed · Esc closes",
                classes="dialog-hint",
            )

    def on_mount(self) -> None:
        self.query_one("#local", DataTable).add_columns("Model", "Source", "Size", "Details")
        self.query_one("#hub", DataTable).add_columns("Model", "Downloads", "Weights", "Here")
        self._show_current()
        self._load_local()
        self.set_interval(0.25, self._show_download)
        self._show_download()

    def _show_current(self) -> None:
        name = self.services.local_model_name() or "(none loaded)"
        self.query_one("#current-model", Label).update(f"The engine runs: {name} ({self.services.engine.state})")

    def action_reload(self) -> None:
        self._load_local()

    @work(thread=True, exclusive=True, group="local-models")
    def _load_local(self) -> None:
        try:
            entries = self.services.catalog.list_local()
        except Exception as exc:  # a broken cache entry must not break the screen
            self.app.call_from_thread(self.notify, f"Cannot list local models: {exc}", severity="error")
            return
        self.app.call_from_thread(self._fill_local, entries)

    def _fill_local(self, entries: list[LocalEntry]) -> None:
        table = self.query_one("#local", DataTable)
        table.clear()
        for e in entries:
            details = Text(e.details, style="" if e.runnable else "red")
            table.add_row(e.name, e.source, format_bytes(e.size_bytes), details, key=e.name)

    @on(Input.Submitted, "#hub-search")
    def _search(self, event: Input.Submitted) -> None:
        self.query_one("#hub", DataTable).loading = True
        self._run_search(event.value.strip())

    @work(thread=True, exclusive=True, group="hub-search")
    def _run_search(self, query: str) -> None:
        try:
            results = self.services.catalog.search(query)
        except Exception as exc:  # network and Hub errors arrive as HubError with a readable message
            self.app.call_from_thread(self._search_failed, str(exc))
            return
        self.app.call_from_thread(self._fill_hub, results)

    def _search_failed(self, message: str) -> None:
        """Said in the screen, beside the search (and kept there until the next search answers)."""
        self.query_one("#hub", DataTable).loading = False
        status = self.query_one("#hub-status", Label)
        status.update(f"Search failed: {message}")
        status.display = True

    def _fill_hub(self, results: list[HubEntry]) -> None:
        self.query_one("#hub-status", Label).display = False
        table = self.query_one("#hub", DataTable)
        table.loading = False
        table.clear()
        for r in results:
            label = Text(r.label, style=_LABEL_STYLES.get(r.label, "dim"))
            table.add_row(
                r.repo_id,
                format_count(r.downloads) if r.downloads is not None else "?",
                format_bytes(r.size_bytes),
                label,
                key=r.repo_id,
            )
        if not results:
            self.notify("No supported text-generation models found.")

    @on(DataTable.RowSelected, "#local")
    def _switch(self, event: DataTable.RowSelected) -> None:
        name = event.row_key.value
        if name:
            self.services.switch_model(name)
            self._show_current()

    def _highlighted_local(self) -> str | None:
        table = self.query_one("#local", DataTable)
        if not table.has_focus or table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return key if isinstance(key, str) else None

    def action_use_here(self) -> None:
        self._use(new_pane=False)

    def action_use_in_new_pane(self) -> None:
        self._use(new_pane=True)

    def _use(self, new_pane: bool) -> None:
        """The highlighted local model answers in the focused pane (or a new one), beside the others."""
        name = self._highlighted_local()
        if name is None:
            self.notify("Pick a model in the local list first.", severity="warning")
            return
        self.services.use_model(name, new_pane)
        self.dismiss(None)

    @on(DataTable.RowSelected, "#hub")
    def _pull(self, event: DataTable.RowSelected) -> None:
        repo_id = event.row_key.value
        if repo_id:
            self.services.start_pull(repo_id)
            self._show_download()

    def _show_download(self) -> None:
        job = self.services.latest_pull
        box = self.query_one("#download")
        box.display = job is not None
        if job is None:
            return
        label = {
            "planning": "Preparing",
            "downloading": "Downloading",
            "done": "Downloaded",
            "cancelled": "Cancelled",
            "failed": "Failed",
        }[job.state]
        text = f"{label} {job.spec}"
        if job.total_bytes:
            text += f": {format_bytes(job.done_bytes)} of {format_bytes(job.total_bytes)}"
        if job.error:
            text += f" ({job.error})"
        self.query_one("#download-label", Label).update(text)
        bar = self.query_one("#download-progress", ProgressBar)
        bar.update(total=job.total_bytes or None, progress=job.done_bytes)
        if job.state == "done" and not getattr(self, "_reloaded_for", None) == job:
            self._reloaded_for = job
            self._load_local()

    def action_cancel_download(self) -> None:
        job = self.services.latest_pull
        if job is None or not job.active:
            self.notify("No download is running.")
            return
        job.cancel()

    def action_close(self) -> None:
        self.dismiss(None)
