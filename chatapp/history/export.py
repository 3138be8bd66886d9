"""Sessions as JSON (to import again) and Markdown (to read), and the checks an imported file passes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from chatapp.history.errors import HistoryFormatError
from chatapp.history.records import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    ROLES,
    STATUSES,
    Backend,
    Message,
    Metrics,
    Session,
    _from_iso,
    _iso,
    _sampling_json,
)


def _message_dict(m: Message) -> dict[str, Any]:
    metrics = m.metrics or Metrics()
    return {
        "id": m.id,
        "parent_id": m.parent_id,
        "role": m.role,
        "content": m.content,
        "status": m.status,
        "created_at": _iso(m.created_at),
        "model": m.model,
        "metrics": {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.completion_tokens,
            "tokens_per_second": metrics.tokens_per_second,
            "ttft_ms": metrics.ttft_ms,
        },
        "error": m.error,
        "truncated": m.truncated,
    }


def _markdown(session: Session, messages: list[Message]) -> str:
    lines = [f"# {session.title or 'Untitled chat'}", ""]
    backend = session.backend
    where = "local engine" if backend.kind == "local" else (backend.endpoint or backend.base_url or "remote")
    lines.append(f"- Model: {session.model or 'default'} ({where})")
    lines.append(f"- Started: {datetime.fromtimestamp(session.created_at, UTC):%Y-%m-%d %H:%M} UTC")
    lines.append("")
    if session.system_prompt:
        lines += ["## System prompt", "", session.system_prompt, ""]
    for m in messages:
        heading = m.role.capitalize() + (f" ({m.model})" if m.role == "assistant" and m.model else "")
        lines += [f"## {heading}", "", m.content, ""]
        if m.status == "incomplete":
            lines += ["> *This answer is incomplete: it was interrupted.*", ""]
        elif m.status == "streaming":
            lines += ["> *This answer was still being written when exported.*", ""]
        elif m.status == "error":
            lines += [f"> *Error: {m.error or 'the answer failed'}*", ""]
        elif m.truncated:
            lines += ["> *This answer stopped at the token limit.*", ""]
        if m.metrics is not None:
            lines += [f"*{m.metrics.describe(with_prompt=True)}*", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _field(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    """obj[key] checked against ``kinds`` (a bool is not accepted as a number)."""
    value = obj.get(key)
    if value is None and optional:
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise HistoryFormatError(f"{where}.{key}: unexpected value {value!r}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # SQLite's INTEGER
        raise HistoryFormatError(f"{where}.{key}: {value} is out of range")
    return value


def _json_or_none(value: Mapping[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(dict(value))


def _parse_export(data: Any) -> tuple[dict[str, Any], list[tuple[Any, dict[str, Any]]], Any]:
    """Validate an export and return (session columns, [(old id, message columns)], selected old id)."""
    if not isinstance(data, Mapping) or data.get("format") != EXPORT_FORMAT:
        raise HistoryFormatError(f'not a chatapp session export (its "format" is not {EXPORT_FORMAT!r})')
    if data.get("version") != EXPORT_VERSION:
        raise HistoryFormatError(
            f"unsupported chatapp export version {data.get('version')!r} (this chatapp reads version {EXPORT_VERSION})"
        )
    s = data.get("session")
    if not isinstance(s, Mapping):
        raise HistoryFormatError('the export has no "session" object')
    b = _field(s, "backend", Mapping, "session")
    try:
        backend = Backend(
            _field(b, "kind", str, "session.backend"),
            *(_field(b, key, str, "session.backend", optional=True) for key in ("base_url", "endpoint", "api_key")),
        )
    except (ValueError, TypeError) as exc:
        raise HistoryFormatError(f"session.backend: {exc}") from None
    try:
        sampling = _sampling_json(_field(s, "sampling", Mapping, "session"))
    except ValueError as exc:
        raise HistoryFormatError(f"session.sampling: {exc}") from None
    session = {
        "title": _field(s, "title", str, "session"),
        "created_at": _from_iso(s.get("created_at"), "session.created_at"),
        "updated_at": _from_iso(s.get("updated_at"), "session.updated_at"),
        "model": _field(s, "model", str, "session", optional=True),
        "system_prompt": _field(s, "system_prompt", str, "session"),
        "sampling": sampling,
        "backend": (backend.kind, backend.base_url, backend.endpoint, backend.api_key),
        "archived": int(bool(_field(s, "archived", bool, "session"))),
        # How the chat was fitted to its model's context (exports made before it have none).
        "context_fit": _json_or_none(_field(s, "context_fit", Mapping, "session", optional=True)),
    }
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list):
        raise HistoryFormatError('the export has no "messages" list')
    seen: set[Any] = set()
    messages: list[tuple[Any, dict[str, Any]]] = []
    for i, m in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise HistoryFormatError(f"{where}: expected an object")
        old_id = _field(m, "id", int, where)
        parent = _field(m, "parent_id", int, where, optional=True)
        if parent is not None and parent not in seen:
            raise HistoryFormatError(f"{where}: its parent {parent} is missing or comes after it")
        if old_id in seen:
            raise HistoryFormatError(f"{where}: duplicate id {old_id}")
        seen.add(old_id)
        role = _field(m, "role", str, where)
        status = _field(m, "status", str, where)
        if role not in ROLES or status not in STATUSES:
            raise HistoryFormatError(f"{where}: unknown role {role!r} or status {status!r}")
        metrics = m.get("metrics") or {}
        if not isinstance(metrics, Mapping):
            raise HistoryFormatError(f"{where}.metrics: expected an object")
        messages.append(
            (
                old_id,
                {
                    "parent_id": parent,
                    "role": role,
                    "content": _field(m, "content", str, where),
                    "status": "incomplete" if status == "streaming" else status,
                    "created_at": _from_iso(m.get("created_at"), f"{where}.created_at"),
                    "model": _field(m, "model", str, where, optional=True),
                    "prompt_tokens": _field(metrics, "prompt_tokens", int, f"{where}.metrics", optional=True),
                    "completion_tokens": _field(metrics, "completion_tokens", int, f"{where}.metrics", optional=True),
                    "tokens_per_second": _field(
                        metrics, "tokens_per_second", (int, float), f"{where}.metrics", optional=True
                    ),
                    "ttft_ms": _field(metrics, "ttft_ms", (int, float), f"{where}.metrics", optional=True),
                    "error": _field(m, "error", str, where, optional=True),
                    "truncated": bool(_field(m, "truncated", bool, where, optional=True)),
                },
            )
        )
    selected = _field(s, "selected_leaf_id", int, "session", optional=True)
    if selected is not None and selected not in seen:
        raise HistoryFormatError(f"session.selected_leaf_id: no message has id {selected!r}")
    return session, messages, selected
