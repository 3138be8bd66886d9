"""The main screen: session panes side by side (tabs for those that do not fit) and the status bar."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.events import Resize
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Tab, Tabs

from chatapp.tui import keymap
from chatapp.tui.api_keys import without_key
from chatapp.tui.conversation import Conversation
from chatapp.tui.screens.compare import CompareScreen
from chatapp.tui.screens.confirm import ConfirmScreen
from chatapp.tui.screens.rename import RenameScreen
from chatapp.tui.screens.session_settings import SessionSettingsScreen
from chatapp.tui.session_config import SessionConfig
from chatapp.tui.widgets.chat_pane import ChatPane, model_label
from chatapp.tui.widgets.status_bar import StatusBar

if TYPE_CHECKING:
    from chatapp.tui.services import MainScreenServices

MIN_PANE_WIDTH = 40
"""Columns a pane needs; the screen shows as many panes side by side as fit, and tabs for all."""

_pane_ids = itertools.count(1)


class MainScreen(Screen[None]):
    """Lays out the panes and routes the chat keys to the focused one."""

    BINDINGS = keymap.bindings("chat")

    active: reactive[int] = reactive(0, init=False)
    """Index of the focused pane."""

    def __init__(self, services: MainScreenServices, sessions: list[tuple[SessionConfig, Conversation]]) -> None:
        super().__init__()
        self.services = services
        self._initial = sessions
        self._first_visible = 0

    def compose(self) -> ComposeResult:
        yield Tabs(id="session-tabs")
        with Horizontal(id="panes"):
            for config, conversation in self._initial:
                yield ChatPane(self.services, config, conversation, id=f"pane-{next(_pane_ids)}")
        yield StatusBar(id="status-bar")

    async def on_mount(self) -> None:
        tabs = self.query_one(Tabs)
        for pane in self.panes:
            await tabs.add_tab(Tab(self._tab_label(pane), id=f"tab-{pane.id}"))
        self._layout()
        if self.panes:
            self.panes[0].prompt.focus()

    # -- panes -----------------------------------------------------------------------------------

    @property
    def panes(self) -> list[ChatPane]:
        return list(self.query_one("#panes").query_children(ChatPane))

    @property
    def active_pane(self) -> ChatPane | None:
        panes = self.panes
        return panes[min(self.active, len(panes) - 1)] if panes else None

    def _tab_label(self, pane: ChatPane) -> str:
        return ("● " if pane.busy else "") + (pane.config.title or "Untitled")

    def _layout(self) -> None:
        """Show as many panes as fit, always including the active one."""
        panes = self.panes
        if not panes:
            return
        width = self.size.width or self.app.size.width
        columns = max(1, min(len(panes), width // MIN_PANE_WIDTH))
        active = min(self.active, len(panes) - 1)
        first = min(self._first_visible, len(panes) - columns)
        if active < first:
            first = active
        elif active >= first + columns:
            first = active - columns + 1
        self._first_visible = max(0, first)
        for i, pane in enumerate(panes):
            pane.display = self._first_visible <= i < self._first_visible + columns
            pane.set_class(i == active, "active")
        self.query_one(Tabs).display = len(panes) > 1
        tab_id = f"tab-{panes[active].id}"
        tabs = self.query_one(Tabs)
        if tabs.active != tab_id:
            tabs.active = tab_id

    def on_resize(self, event: Resize) -> None:
        self._layout()

    def watch_active(self) -> None:
        self._layout()
        self._update_status()

    def focus_pane(self, index: int) -> None:
        panes = self.panes
        if not panes:
            return
        self.active = index % len(panes)
        self._layout()
        self.panes[self.active].prompt.focus()

    @on(ChatPane.Changed)
    def _pane_changed(self, event: ChatPane.Changed) -> None:
        pane = event.pane
        panes = self.panes
        if pane not in panes:
            return
        # Only focus arriving makes a pane active (a click in it): any other change of a pane that
        # still holds focus, between a move away (F6) and the focus following it, must not undo the move.
        if event.focused and pane.has_focus_within and panes.index(pane) != self.active:
            self.active = panes.index(pane)
        try:
            tab = self.query_one(f"#tab-{pane.id}", Tab)
        except NoMatches:  # the tab is added right after the pane mounts
            return
        label = self._tab_label(pane)
        if str(tab.label) != label:  # a tab's new label lays the whole screen out again
            tab.label = label
        self._update_status()

    @on(Tabs.TabActivated)
    def _tab_activated(self, event: Tabs.TabActivated) -> None:
        if event.tab is None or event.tab.id is None:
            return
        # A stale message: _layout moved the tabs on since (two next-session keys in one burst). Acting
        # on it would move focus back, whose own message would move it forward again, for ever.
        if event.tab.id != event.tabs.active:
            return
        pane_id = event.tab.id.removeprefix("tab-")
        panes = self.panes
        for i, pane in enumerate(panes):
            if pane.id == pane_id and i != self.active:
                self.focus_pane(i)

    def _update_status(self) -> None:
        pane = self.active_pane
        bar = self.query_one(StatusBar)
        bar.session_rate = pane.rate if pane is not None else None

    async def add_pane(self, config: SessionConfig, conversation: Conversation) -> ChatPane:
        pane = ChatPane(self.services, config, conversation, id=f"pane-{next(_pane_ids)}")
        await self.query_one("#panes").mount(pane)
        await self.query_one(Tabs).add_tab(Tab(self._tab_label(pane), id=f"tab-{pane.id}"))
        self.focus_pane(len(self.panes) - 1)
        return pane

    def pane_for_session(self, session_id: int) -> ChatPane | None:
        return next((p for p in self.panes if p.config.db_id == session_id), None)

    # -- actions ------------------------------------------------------------------------------------

    async def action_new_session(self) -> None:
        config = self.services.create_session_config()
        await self.add_pane(config, Conversation())

    @work(exclusive=True, group="close-session")  # a held F8 closes one pane at a time
    async def action_close_session(self) -> None:
        pane = self.active_pane
        if pane is None:
            return
        if pane.prompt.text.strip() and pane.editing is None:
            question = (
                f"Close {pane.config.title or 'this session'}? Its unsent message is kept with it "
                "and comes back when you reopen it from the sessions list."
            )
            if not await self.app.push_screen_wait(ConfirmScreen(question, yes="Close")):
                return
        pane.save_draft()
        pane.stop()
        index = self.panes.index(pane)
        c = pane.config
        empty = not pane.conversation.roots and not c.draft and not c.system_prompt and not c.is_remote
        if empty:  # nothing to come back to: no "Chat N" left behind in the sessions list
            self.services.recorder.delete_session(pane.config.db_id)
        else:
            self.services.recorder.update_session(pane.config.db_id, archived=True)
        await self.query_one(Tabs).remove_tab(f"tab-{pane.id}")
        await pane.remove()
        if not self.panes:
            await self.action_new_session()
        else:
            self.focus_pane(min(index, len(self.panes) - 1))
        if not empty:
            self.notify(f"Closed {pane.config.title or 'the session'}; reopen it from the sessions list.")

    @work
    async def action_rename_session(self) -> None:
        pane = self.active_pane
        if pane is None:
            return
        title = await self.app.push_screen_wait(RenameScreen(pane.config.title))
        if title is None:
            return
        pane.config.title = title
        self.services.recorder.update_session(pane.config.db_id, title=title)
        pane.update_titles()

    @work
    async def action_session_settings(self) -> None:
        pane = self.active_pane
        if pane is None:
            return
        new = await self.app.push_screen_wait(
            SessionSettingsScreen(pane.config, [e.name for e in self.services.settings.endpoints])
        )
        if new is None:
            return
        new = self.services.file_api_key(new)
        pane.config = new
        self.services.recorder.update_session(
            new.db_id,
            title=new.title,
            model=new.model,
            system_prompt=new.system_prompt,
            sampling=new.sampling,
            backend=without_key(new.backend),  # a key that could not be filed stays in memory only
        )
        pane.update_titles()

    def action_next_session(self) -> None:
        self.focus_pane(self.active + 1)

    def action_previous_session(self) -> None:
        self.focus_pane(self.active - 1)

    def action_stop(self) -> None:
        pane = self.active_pane
        if pane is not None and not pane.stop() and not pane.cancel_edit():
            pane.select(None)  # Esc also takes the message cursor off

    def action_previous_message(self) -> None:
        if (pane := self.active_pane) is not None:
            pane.move_selection(-1)

    def action_next_message(self) -> None:
        if (pane := self.active_pane) is not None:
            pane.move_selection(+1)

    def action_delete_message(self) -> None:
        if (pane := self.active_pane) is not None:
            pane.delete_message()

    async def action_regenerate(self) -> None:
        if (pane := self.active_pane) is not None:
            await pane.regenerate()

    async def action_continue_answer(self) -> None:
        if (pane := self.active_pane) is not None:
            await pane.continue_answer()

    def action_edit_message(self) -> None:
        if (pane := self.active_pane) is not None:
            pane.start_edit()

    async def action_previous_branch(self) -> None:
        if (pane := self.active_pane) is not None:
            await pane.switch_branch(-1)

    async def action_next_branch(self) -> None:
        if (pane := self.active_pane) is not None:
            await pane.switch_branch(+1)

    def action_copy_answer(self) -> None:
        pane = self.active_pane
        node = None
        if pane is not None:
            node = pane.selected or pane.conversation.last("assistant")
        if node is None or not node.content:
            self.notify("There is no answer to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(node.content)
        what = "the answer" if node.role == "assistant" else "your message"
        self.notify(f"Copied {what} ({len(node.content)} characters).")

    def action_copy_code(self) -> None:
        pane = self.active_pane
        found = pane.next_code_block() if pane is not None else None
        if found is None:
            self.notify("That message has no code block.", severity="warning")
            return
        code, number, count = found
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied code block {number} of {count} ({len(code.splitlines())} lines).")

    # -- compare mode ---------------------------------------------------------------------------------

    def action_compare_mark(self) -> None:
        pane = self.active_pane
        if pane is None:
            return
        pane.compare = not pane.compare
        marked = sum(1 for p in self.panes if p.compare)
        if pane.compare:
            self.notify(
                f"{pane.config.title} is marked for compare ({marked} marked): "
                "a message sent in any marked pane goes to all of them."
            )
        else:
            self.notify(f"{pane.config.title} is no longer compared ({marked} marked).")

    @on(ChatPane.CompareSubmitted)
    async def _compare_submitted(self, event: ChatPane.CompareSubmitted) -> None:
        """One message to every marked pane, the one it was typed in first."""
        others = [p for p in self.panes if p.compare and p is not event.pane]
        if not await event.pane.send(event.text):
            return
        for pane in others:
            await pane.send(event.text, from_prompt=False)

    @work(exclusive=True, group="new-comparison")
    async def action_new_comparison(self) -> None:
        """Open N panes (a model or system prompt each), marked for compare, and ask them one question."""
        active = self.active_pane
        draft = active.prompt.text if active is not None and active.editing is None else ""
        names = await self.services.local_model_names()
        comparison = await self.app.push_screen_wait(CompareScreen(names, draft))
        if comparison is None:
            return
        for pane in self.panes:
            pane.compare = False
        opened: list[ChatPane] = []
        for i, (model, system_prompt) in enumerate(comparison.panes, 1):
            config = self.services.create_session_config()
            config.model, config.system_prompt = model, system_prompt
            label = model_label(model) if model else self.services.local_model_name() or "default"
            config.title = f"Compare {i}: {label}" + (f" · {system_prompt[:20]}" if system_prompt else "")
            self.services.recorder.update_session(
                config.db_id, title=config.title, model=model, system_prompt=system_prompt
            )
            pane = await self.add_pane(config, Conversation())
            pane.compare = True
            opened.append(pane)
        for pane in opened:
            await pane.send(comparison.question, from_prompt=False)

    def action_export(self) -> None:
        if (pane := self.active_pane) is not None:
            self.services.export_session(pane.config)
