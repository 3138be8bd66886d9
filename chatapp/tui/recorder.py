"""Saving what the panes do to the history store, without ever stopping the chat.

Every write goes through :class:`Recorder`, which turns a failed write
(:class:`~chatapp.history.HistoryWriteError`: disk full, read-only...) into a
call of ``on_error`` -- the app shows a notice -- and a False return. The
in-memory conversation keeps the text; nodes not yet saved are saved, parents
first, by the next write that works, so nothing typed is lost once the disk
recovers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from chatapp.history import Backend, HistoryError, HistoryStore, Metrics, Session
from chatapp.tui.conversation import Node


class Recorder:
    """Best-effort writes to a HistoryStore (or none at all: ``store=None`` keeps everything in memory)."""

    def __init__(self, store: HistoryStore | None, on_error: Callable[[HistoryError, bool], None]) -> None:
        """``on_error(exc, first)``: ``first`` is True for the first failure after writes worked."""
        self.store = store
        self.on_error = on_error
        self.failing = False
        """True after a write failed, until one succeeds again (the status bar shows it)."""

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any | None:
        if self.store is None:
            return None
        try:
            result = fn(*args, **kwargs)
        except HistoryError as exc:
            first = not self.failing
            self.failing = True
            self.on_error(exc, first)
            return None
        self.failing = False
        return result

    # -- sessions ----------------------------------------------------------------------------

    def create_session(
        self, title: str, *, model: str | None, system_prompt: str, sampling: Mapping[str, Any], backend: Backend
    ) -> Session | None:
        if self.store is None:
            return None
        return self._call(
            self.store.create_session,
            title,
            model=model,
            system_prompt=system_prompt,
            sampling=sampling,
            backend=backend,
        )

    def update_session(self, session_id: int | None, **changes: Any) -> None:
        if self.store is not None and session_id is not None:
            self._call(self.store.update_session, session_id, **changes)

    def reopen(self, node: Node) -> None:
        """A saved answer streams again (it is being continued)."""
        if self.store is not None and node.db_id is not None:
            self._call(self.store.reopen_answer, node.db_id)

    def delete_message(self, node: Node) -> None:
        """Delete a saved message and its replies (a whole branch)."""
        if self.store is not None and node.db_id is not None:
            self._call(self.store.delete_message, node.db_id)

    def delete_session(self, session_id: int | None) -> None:
        if self.store is not None and session_id is not None:
            self._call(self.store.delete_session, session_id)

    def select_leaf(self, session_id: int | None, node: Node | None) -> None:
        if self.store is not None and session_id is not None and (node is None or node.db_id is not None):
            self._call(self.store.set_selected_leaf, session_id, node.db_id if node else None)

    # -- messages --------------------------------------------------------------------------------

    def save(self, session_id: int | None, node: Node, *, streaming: bool = False) -> bool:
        """Save ``node`` (and any unsaved ancestors); True once it has a store id."""
        if self.store is None or session_id is None:
            return False
        if node.db_id is not None:
            return True
        if node.parent is not None and not self.save(session_id, node.parent):
            return False
        parent_id = node.parent.db_id if node.parent is not None else None
        if streaming:
            saved = self._call(self.store.start_answer, session_id, parent_id, model=node.model)
        else:
            saved = self._call(
                self.store.add_message,
                session_id,
                parent_id,
                node.role,
                node.content,
                model=node.model,
                status=node.status,
            )
            if (
                saved is not None
                and (node.metrics is not None or node.error is not None)
                and node.status != "streaming"
            ):
                self._call(
                    self.store.finish_message,
                    saved.id,
                    node.content,
                    status=node.status,
                    metrics=node.metrics,
                    error=node.error,
                )
        if saved is None:
            return False
        node.db_id = saved.id
        return True

    def update_partial(self, session_id: int | None, node: Node) -> None:
        """The streaming answer's text so far; saves the answer first if its start was never saved."""
        if not self.save(session_id, node, streaming=True) or self.store is None or node.db_id is None:
            return
        self._call(self.store.update_partial, node.db_id, node.content)

    def finish(self, session_id: int | None, node: Node) -> None:
        """The answer's final text, status and metrics."""
        if not self.save(session_id, node, streaming=True) or self.store is None or node.db_id is None:
            return
        self._call(
            self.store.finish_message,
            node.db_id,
            node.content,
            status=node.status if node.status != "streaming" else "complete",
            metrics=node.metrics or Metrics(),
            error=node.error,
            truncated=node.truncated,
        )
