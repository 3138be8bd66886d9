"""The history's records (sessions, messages, metrics) and the words they use."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from chatapp.history.errors import HistoryFormatError

DB_FILENAME: Final = "history.sqlite3"
EXPORT_FORMAT: Final = "chatapp-session"
EXPORT_VERSION: Final = 1

Role = Literal["system", "user", "assistant"]
Status = Literal["complete", "streaming", "incomplete", "error"]
ROLES: Final = ("system", "user", "assistant")
STATUSES: Final = ("complete", "streaming", "incomplete", "error")
FINAL_STATUSES: Final = ("complete", "incomplete", "error")


# -- errors ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backend:
    """Where a session's answers come from: the local engine or a remote OpenAI-compatible server.

    For a remote server, prefer ``endpoint`` (the name of an endpoint in the
    settings file, which holds the URL and key) over storing ``api_key`` here:
    keys in the history file end up in backups. ``base_url`` overrides the
    endpoint's URL when both are given. The model name is ``Session.model``.
    """

    kind: Literal["local", "remote"] = "local"
    base_url: str | None = None
    endpoint: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "local":
            if self.base_url or self.endpoint or self.api_key:
                raise ValueError("a local backend takes no base_url, endpoint or api_key")
        elif self.kind == "remote":
            if not (self.base_url or self.endpoint):
                raise ValueError("a remote backend needs a base_url or the name of an endpoint from the settings")
            if self.base_url and not re.match(r"https?://", self.base_url):
                raise ValueError(f"a remote base_url must start with http:// or https://, got {self.base_url!r}")
        else:
            raise ValueError(f"backend kind must be 'local' or 'remote', got {self.kind!r}")

    @classmethod
    def local(cls) -> Backend:
        return cls("local")

    @classmethod
    def remote(cls, base_url: str | None = None, *, endpoint: str | None = None, api_key: str | None = None) -> Backend:
        return cls("remote", base_url=base_url, endpoint=endpoint, api_key=api_key)


@dataclass(frozen=True, slots=True)
class Metrics:
    """The numbers shown under an answer; any may be unknown (None)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_per_second: float | None = None
    ttft_ms: float | None = None
    """Time to first token, in milliseconds."""

    def is_empty(self) -> bool:
        return all(
            v is None for v in (self.prompt_tokens, self.completion_tokens, self.tokens_per_second, self.ttft_ms)
        )

    def describe(self, *, with_prompt: bool = False) -> str:
        """'87.3 tok/s · 42 tokens · 0.21 s to first token', as LM Studio shows under an answer; the one
        wording for the TUI and exports (``with_prompt`` adds the prompt's token count)."""
        parts = []
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.completion_tokens is not None:
            parts.append(f"{self.completion_tokens} tokens")
        if with_prompt and self.prompt_tokens is not None:
            parts.append(f"{self.prompt_tokens} prompt tokens")
        if self.ttft_ms is not None:
            parts.append(f"{self.ttft_ms / 1000:.2f} s to first token")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class Session:
    """One chat pane: its settings and which branch of its tree is shown."""

    id: int
    title: str
    created_at: float
    updated_at: float
    position: int
    """Order of the panes (0 first); archived sessions come after the others."""
    model: str | None
    system_prompt: str
    sampling: dict[str, Any]
    backend: Backend
    selected_leaf_id: int | None
    """The message whose root path is shown; None means the newest message."""
    archived: bool
    draft: str = ""
    """What was typed in the pane's prompt and not sent."""
    context_fit: dict[str, Any] | None = None
    """How the chat's prompts leave old turns out once it outgrew the context (tui/context_fit.py)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One node of a session's message tree."""

    id: int
    session_id: int
    parent_id: int | None
    role: Role
    content: str
    status: Status
    created_at: float
    model: str | None = None
    metrics: Metrics | None = None
    error: str | None = None
    """Why the answer failed, when ``status == "error"``."""
    truncated: bool = False
    """The answer stopped at the token limit (max_tokens or the context's end): it can be continued."""


@dataclass(frozen=True, slots=True)
class Siblings:
    """The branches of one turn, oldest first, and where a given message is among them."""

    messages: list[Message]
    index: int

    @property
    def count(self) -> int:
        return len(self.messages)


@dataclass(frozen=True, slots=True)
class SearchHit:
    """A session matching a search, with its best matching text.

    ``message_id`` is None when the title matched; otherwise the TUI can show
    that message with :meth:`HistoryStore.select_branch`.
    """

    session_id: int
    title: str
    message_id: int | None
    snippet: str


# -- schema -----------------------------------------------------------------


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _from_iso(text: Any, what: str) -> float:
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise HistoryFormatError(f"{what}: expected an ISO 8601 time, got {text!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _sampling_json(sampling: Mapping[str, Any] | None) -> str:
    if sampling is None:
        return "{}"
    if not isinstance(sampling, Mapping) or not all(isinstance(k, str) for k in sampling):
        raise ValueError("sampling parameters must be a mapping with string keys")
    try:
        return json.dumps(dict(sampling), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sampling parameters must be JSON values: {exc}") from None
