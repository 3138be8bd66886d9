"""What one pane is set up with: title, model, system prompt, sampling, local or remote backend."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from chatapp.engine.sampling_params import SamplingParams
from chatapp.history import Backend, Session

DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 1024}
"""New sessions start with these; a pane's settings screen changes them per session."""

SAMPLING_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "seed": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "stop": list,
}
"""The sampling parameters a session may set (every one of SamplingParams a chat needs), with their types;
``stop`` is a list of strings (one a line in the form, written with escapes: see ``stop_line``)."""

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "s": " ", "\\": "\\"}
_ESCAPE = re.compile(r"\\(?:([ntrs\\])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4}))")


def stop_line(stop: str) -> str:
    """A stop string as one line of the form: a newline, tab or return written \\n, \\t, \\r, a
    backslash \\\\, and spaces that begin or end it \\s (the form trims its lines), so that "\\n\\n"
    (a blank line, a common stop) can be written at all."""
    text = "".join(_escaped(character) for character in stop)
    core = text.strip(" ")
    if not core:
        return "\\s" * len(text)
    lead, trail = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    return "\\s" * lead + core + "\\s" * trail


def _escaped(character: str) -> str:
    """One character of a stop string as the form writes it: itself, unless the form's lines would
    split or trim it, or it cannot be seen."""
    if character == "\\":
        return "\\\\"
    simple = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(character)
    if simple is not None:
        return simple
    if character == " " or (character.isprintable() and not character.isspace()):
        return character
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else character


def parse_stop_line(line: str) -> str:
    """The stop string a form line writes (see ``stop_line``; \\xHH and \\uHHHH too; any other
    backslash is itself)."""

    def one(match: re.Match[str]) -> str:
        simple, byte, unit = match.groups()
        if simple:
            return _ESCAPES[simple]
        code = int(byte or unit, 16)
        if 0xD800 <= code <= 0xDFFF:
            raise SessionConfigError(f"stop string {line.strip()!r}: \\u{code:04x} is half a character (a surrogate)")
        return chr(code)

    return _ESCAPE.sub(one, line.strip())


class SessionConfigError(ValueError):
    """A session setting that cannot be used; the message says which and why."""


@dataclass
class SessionConfig:
    """A pane's settings. ``db_id`` is None until the session is saved (or when history is off)."""

    title: str
    model: str | None = None
    """Remote: the model name to ask the server for. Local: a local model (loaded on demand beside the
    others in the one engine), or None for the engine's default model."""
    system_prompt: str = ""
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    backend: Backend = field(default_factory=Backend.local)
    db_id: int | None = None
    draft: str = ""
    """The unsent prompt text saved with the session (restored into the pane's prompt)."""
    context_fit: dict[str, Any] | None = None
    """The saved context fit (see tui/context_fit.py), restored into the pane."""

    @classmethod
    def from_session(cls, session: Session) -> SessionConfig:
        return cls(
            session.title,
            session.model,
            session.system_prompt,
            dict(session.sampling),
            session.backend,
            session.id,
            session.draft,
            session.context_fit,
        )

    @property
    def is_remote(self) -> bool:
        return self.backend.kind == "remote"

    def sampling_params(self) -> SamplingParams:
        """The engine's SamplingParams; unknown or invalid values raise SessionConfigError."""
        known = {k: v for k, v in self.sampling.items() if k in SAMPLING_FIELDS and v is not None}
        try:
            return SamplingParams(**known)
        except (TypeError, ValueError) as exc:
            raise SessionConfigError(f"session {self.title!r}: bad sampling setting: {exc}") from None

    def copy(self, **changes: Any) -> SessionConfig:
        return replace(self, **changes)


def parse_sampling(values: dict[str, str]) -> dict[str, Any]:
    """Form text -> sampling dict ('' drops a field); raises SessionConfigError naming the field."""
    out: dict[str, Any] = {}
    for name, text in values.items():
        text = text.strip()
        if not text:
            continue
        kind = SAMPLING_FIELDS.get(name)
        if kind is None:
            raise SessionConfigError(f"unknown sampling setting {name!r}")
        if kind is list:
            out[name] = [parse_stop_line(line) for line in text.splitlines() if line.strip()]
            continue
        try:
            out[name] = kind(text)
        except ValueError:
            raise SessionConfigError(
                f"{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as exc:
        raise SessionConfigError(str(exc)) from None
    return out
