"""A session's message tree held in memory: what a pane shows, whatever the history file can do.

The history store is the copy on disk; this is the copy the UI works on, so a
chat goes on (and nothing typed is lost) when the store cannot be written.
Each node remembers its store id once saved (``db_id``); a node saved late
(after a write failure) is saved with its ancestors first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chatapp.history import Message, Metrics

_keys = itertools.count(1)


@dataclass(eq=False)
class Node:
    """One message; ``key`` is a stable in-memory id (the store id may not exist yet)."""

    role: str
    content: str
    parent: Node | None = None
    status: str = "complete"
    model: str | None = None
    metrics: Metrics | None = None
    error: str | None = None
    truncated: bool = False
    """The answer stopped at the token limit; Continue goes on with it."""
    db_id: int | None = None
    children: list[Node] = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_keys))


@dataclass(frozen=True)
class Branch:
    """Where a node sits among its siblings: index is 0-based, count >= 1."""

    index: int
    count: int


class Conversation:
    """The tree plus which leaf is shown (None: the newest node)."""

    def __init__(self) -> None:
        self.roots: list[Node] = []
        self.leaf: Node | None = None

    # -- building ---------------------------------------------------------------------------

    def add(self, parent: Node | None, role: str, content: str, **fields: Any) -> Node:
        """A new node under ``parent`` (None: a new root); it becomes the shown leaf."""
        node = Node(role, content, parent=parent, **fields)
        (parent.children if parent is not None else self.roots).append(node)
        self.leaf = node
        return node

    @classmethod
    def from_messages(cls, messages: Iterable[Message], selected_id: int | None) -> Conversation:
        """Rebuild from store messages (parents before children, as ids grow)."""
        conv = cls()
        by_id: dict[int, Node] = {}
        for m in sorted(messages, key=lambda m: m.id):
            parent = by_id.get(m.parent_id) if m.parent_id is not None else None
            node = Node(
                m.role,
                m.content,
                parent=parent,
                status=m.status,
                model=m.model,
                metrics=m.metrics,
                error=m.error,
                truncated=m.truncated,
                db_id=m.id,
            )
            (parent.children if parent is not None else conv.roots).append(node)
            by_id[m.id] = node
        conv.leaf = by_id.get(selected_id) if selected_id is not None else None
        if conv.leaf is None and by_id:
            conv.leaf = by_id[max(by_id)]
        return conv

    @classmethod
    def from_export(cls, data: Mapping[str, Any]) -> Conversation:
        """From ``HistoryStore.export_dict``: the one call that returns every branch of a session."""
        session_id = data["session"]["id"]
        messages = []
        for m in data["messages"]:
            metrics = Metrics(**m["metrics"]) if m.get("metrics") else None
            if metrics is not None and metrics.is_empty():
                metrics = None
            messages.append(
                Message(
                    m["id"],
                    session_id,
                    m["parent_id"],
                    m["role"],
                    m["content"],
                    m["status"],
                    0.0,
                    m.get("model"),
                    metrics,
                    m.get("error"),
                    bool(m.get("truncated")),
                )
            )
        return cls.from_messages(messages, data["session"].get("selected_leaf_id"))

    # -- reading ------------------------------------------------------------------------------

    def path(self) -> list[Node]:
        """Root-to-leaf: what the pane shows."""
        out: list[Node] = []
        node = self.leaf
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def siblings(self, node: Node) -> list[Node]:
        return node.parent.children if node.parent is not None else self.roots

    def branch(self, node: Node) -> Branch:
        sibs = self.siblings(node)
        return Branch(sibs.index(node), len(sibs))

    @staticmethod
    def newest_leaf(node: Node) -> Node:
        """The most recently added node below ``node`` (itself when it has no replies)."""
        while node.children:
            node = node.children[-1]
        return node

    def last(self, role: str) -> Node | None:
        """The last node with this role on the shown path."""
        return next((n for n in reversed(self.path()) if n.role == role), None)

    def branch_point(self) -> Node | None:
        """The deepest node on the shown path that has siblings: what the branch keys switch."""
        return next((n for n in reversed(self.path()) if len(self.siblings(n)) > 1), None)

    # -- changing -------------------------------------------------------------------------------

    def switch(self, node: Node, step: int) -> Node | None:
        """Show the sibling ``step`` away from ``node`` (down to its newest leaf); None at either end."""
        sibs = self.siblings(node)
        index = sibs.index(node) + step
        if not 0 <= index < len(sibs):
            return None
        self.leaf = self.newest_leaf(sibs[index])
        return sibs[index]

    @staticmethod
    def subtree(node: Node) -> list[Node]:
        """``node`` and every reply under it, in every branch."""
        out, stack = [], [node]
        while stack:
            current = stack.pop()
            out.append(current)
            stack.extend(current.children)
        return out

    def remove(self, node: Node) -> int:
        """Take ``node`` and every reply under it out of the tree; the number of messages removed.

        If the shown leaf went with it, the branch shown ends at the node's parent (or, for a first
        message, at the newest leaf of another first message)."""
        self.siblings(node).remove(node)
        gone = len(self.subtree(node))
        leaf = self.leaf
        while leaf is not None and leaf is not node:
            leaf = leaf.parent
        if leaf is node:  # the shown branch ran through it
            if node.parent is not None:
                self.leaf = node.parent
            else:
                self.leaf = self.newest_leaf(self.roots[-1]) if self.roots else None
        return gone

    def chat_messages(self, system_prompt: str, upto: Node | None) -> list[dict[str, str]]:
        """OpenAI-style messages for the path ending at ``upto`` (the prompt of a new answer)."""
        chain: list[Node] = []
        node: Node | None = upto
        while node is not None:
            chain.append(node)
            node = node.parent
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages += [{"role": n.role, "content": n.content} for n in reversed(chain) if n.role != "system"]
        return messages
