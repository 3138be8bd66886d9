"""All sessions, open or closed, with full-text search; open one as a pane or export it."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from chatapp.history import HistoryError
from chatapp.tui.screens.confirm import ConfirmScreen

if TYPE_CHECKING:
    from chatapp.tui.services import SessionsScreenServices

_MARK = ("\x01", "\x02")


def highlighted(snippet: str) -> Text:
    """A search snippet with the matched words (between the marks) in bold."""
    text = Text()
    bold = False
    for part in snippet.replace(_MARK[1], _MARK[0]).split(_MARK[0]):
        text.append(part.replace("\n", " "), style="bold reverse" if bold else "")
        bold = not bold
    return text


class SessionsScreen(ModalScreen[int | None]):
    """Returns the id of the session to show (the app opens or focuses its pane), or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("down", "focus_table", "Results", show=False),
        Binding("ctrl+s", "export", "Export", priority=True),
        Binding("delete", "delete", "Delete"),  # not a priority: in the search box it deletes a character
    ]

    def __init__(self, services: SessionsScreenServices) -> None:
        super().__init__()
        self.services = services

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide tall"):
            yield Label("Sessions", classes="dialog-title")
            yield Input(placeholder="Search titles and messages…", id="search")
            yield DataTable(id="sessions", cursor_type="row", zebra_stripes=True)
            yield Label(
                "Type to search · ↓ to the list · Enter opens · Ctrl+S exports (Markdown and JSON) · "
                "Delete deletes a closed one · Esc closes",
                classes="dialog-hint",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Session", "Model", "Where", "Updated", "Match")
        self._fill("")

    def _fill(self, query: str) -> None:
        table = self.query_one(DataTable)
        table.clear()
        store = self.services.store
        if store is None:
            table.add_row("The history is not available in this run.", "", "", "", "")
            return
        try:
            sessions = {s.id: s for s in store.list_sessions(include_archived=True)}
            rows: list[tuple[int, Text]] = []
            if query.strip():
                rows = [(hit.session_id, highlighted(hit.snippet)) for hit in store.search(query, mark=_MARK)]
            else:  # the most recently used first
                recent = sorted(sessions.values(), key=lambda s: (s.updated_at, s.id), reverse=True)
                rows = [(s.id, Text("")) for s in recent]
        except HistoryError as exc:
            self.notify(str(exc), severity="error")
            return
        for sid, match in rows:
            s = sessions.get(sid)
            if s is None:
                continue
            where = "open" if not s.archived else "closed"
            model = s.model or ("local engine" if s.backend.kind == "local" else "remote")
            updated = datetime.fromtimestamp(s.updated_at).strftime("%Y-%m-%d %H:%M")
            table.add_row(Text(s.title or "Untitled"), Text(model), where, updated, match, key=str(sid))

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self._fill(event.value)

    @on(Input.Submitted, "#search")
    def _submitted(self) -> None:
        self.action_focus_table()

    def action_focus_table(self) -> None:
        self.query_one(DataTable).focus()

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return int(key) if key and key.isdigit() else None

    @on(DataTable.RowSelected)
    def _open(self) -> None:
        sid = self._selected()
        if sid is not None:
            self.dismiss(sid)

    def action_export(self) -> None:
        sid = self._selected()
        if sid is None:
            self.notify("Pick a session first (↓ then arrows).", severity="warning")
            return
        self.services.export_by_id(sid)

    @work
    async def action_delete(self) -> None:
        """Delete a closed session for good, after asking (an open one is closed first, with F8)."""
        sid, store = self._selected(), self.services.store
        if sid is None or store is None:
            self.notify("Pick a session first (↓ then arrows).", severity="warning")
            return
        try:
            session = store.get_session(sid)
            count = len(store.export_dict(sid)["messages"])
        except HistoryError as exc:
            self.notify(str(exc), severity="error")
            return
        if not session.archived:
            self.notify("That session is open in a pane: close it first (F8), then delete it here.", severity="warning")
            return
        title = session.title or "Untitled"
        question = f"Delete {title!r} and its {count} message{'s' if count != 1 else ''}? This cannot be undone."
        if not await self.app.push_screen_wait(ConfirmScreen(question, yes="Delete", focus_yes=False)):
            return
        try:
            store.delete_session(sid)
        except HistoryError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"Deleted {title!r}.")
        self._fill(self.query_one("#search", Input).value)

    def action_close(self) -> None:
        self.dismiss(None)
