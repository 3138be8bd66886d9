"""Every action the TUI offers, with its default key: one list for bindings, help and the command palette.

The names are the ones ``settings.toml``'s ``[keys]`` table uses, so a user
remaps an action by writing ``regenerate = "f5"`` there. Textual's keymap
(``App.set_keymap``) does the remapping: each binding's ``id`` is its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from textual.binding import Binding, BindingType

from chatapp.settings import DEFAULT_KEYS as SETTINGS_DEFAULTS

Scope = Literal["app", "chat"]

UNBOUND = "unbound"
"""Key name given to an action the user unbound ("" in settings): no key produces it."""


@dataclass(frozen=True)
class Action:
    """One user action: its settings name, Textual action, help text and default key."""

    name: str
    action: str
    description: str
    default: str
    scope: Scope
    """"app": works on every screen; "chat": only on the main screen with the panes."""


ACTIONS: tuple[Action, ...] = (
    Action("help", "help", "Show every key", "f1", "app"),
    Action("settings", "settings", "Edit settings (model, theme, memory, port)", "f2", "app"),
    Action("models", "models", "Models: local list, Hub search, downloads, a model per pane", "f4", "app"),
    Action("search", "sessions", "Sessions list: search, open, export", "f7", "app"),
    Action("quit", "quit", "Quit", "ctrl+q", "app"),
    Action("new_session", "new_session", "New session pane", "ctrl+t", "chat"),
    Action("close_session", "close_session", "Close the focused session (kept in history)", "f8", "chat"),
    Action("rename_session", "rename_session", "Rename the focused session", "f3", "chat"),
    Action(
        "session_settings",
        "session_settings",
        "Session settings: model, system prompt, sampling, local or remote",
        "f5",
        "chat",
    ),
    Action("next_session", "next_session", "Focus the next session", "ctrl+pagedown,f6", "chat"),
    Action("previous_session", "previous_session", "Focus the previous session", "ctrl+pageup,shift+f6", "chat"),
    Action("stop", "stop", "Stop the answer being generated", "escape", "chat"),
    Action(
        "previous_message",
        "previous_message",
        "Message cursor up: the message actions act on the selected message (a click selects too)",
        "alt+up",
        "chat",
    ),
    Action("next_message", "next_message", "Message cursor down (past the last: off)", "alt+down", "chat"),
    Action(
        "regenerate", "regenerate", "Regenerate the selected (else the last) answer (a new branch)", "alt+r", "chat"
    ),
    Action(
        "edit_message",
        "edit_message",
        "Edit and resend the selected (else your last) message (a new branch)",
        "alt+e",
        "chat",
    ),
    Action(
        "delete_message",
        "delete_message",
        "Delete the selected (else the last) message and its replies",
        "alt+x",
        "chat",
    ),
    Action("continue_answer", "continue_answer", "Continue an answer that stopped at the token limit", "alt+n", "chat"),
    Action(
        "previous_branch", "previous_branch", "Previous branch of the selected (else the last) turn", "alt+left", "chat"
    ),
    Action("next_branch", "next_branch", "Next branch of the selected (else the last) turn", "alt+right", "chat"),
    Action("copy_answer", "copy_answer", "Copy the selected message (else the last answer)", "ctrl+o", "chat"),
    Action(
        "copy_code",
        "copy_code",
        "Copy a code block of the selected (else last) answer; again: the next",
        "alt+c",
        "chat",
    ),
    Action("export", "export", "Export the focused session to Markdown and JSON", "ctrl+s", "chat"),
    Action(
        "compare_mark",
        "compare_mark",
        "Mark or unmark the focused pane for compare mode (a message sent in one marked pane goes to all)",
        "alt+m",
        "chat",
    ),
    Action(
        "new_comparison",
        "new_comparison",
        "New comparison: one question to N new panes with N models or system prompts",
        "alt+k",
        "chat",
    ),
    Action("toggle_server", "toggle_server", "Start or stop the local OpenAI-compatible API port", "f9", "app"),
    Action("restart_engine", "restart_engine", "Restart the engine (after it died)", "f10", "app"),
)

BY_NAME: Mapping[str, Action] = {a.name: a for a in ACTIONS}


def bindings(scope: Scope) -> list[BindingType]:
    """Textual bindings for one scope; ``priority`` so a focused text box cannot swallow them (which is
    why no default is a key the prompt box edits with: Ctrl+W, Ctrl+E, Ctrl+B, Ctrl+F, ...)."""
    return [
        Binding(a.default, a.action, a.description, show=False, priority=True, id=a.name)
        for a in ACTIONS
        if a.scope == scope
    ]


def keymap(keys: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Settings' ``[keys]`` -> (a Textual keymap, warnings about names this TUI has no action for)."""
    result: dict[str, str] = {}
    warnings: list[str] = []
    for name, key in keys.items():
        if _is_untouched_default(name, key):
            continue
        if name not in BY_NAME:
            warnings.append(
                f"settings [keys]: there is no action named {name!r}; known actions: {', '.join(sorted(BY_NAME))}"
            )
            continue
        result[name] = key if key else UNBOUND
    return result, warnings


def _is_untouched_default(name: str, key: str) -> bool:
    """Settings fill [keys] with their own defaults; those leave our default (which may add alternatives)."""
    return name in BY_NAME and SETTINGS_DEFAULTS.get(name) == key


def key_for(name: str, keys: Mapping[str, str]) -> str:
    """The key string in force for an action (the user's setting, else our default)."""
    key = keys.get(name)
    if key is None or _is_untouched_default(name, key):
        return BY_NAME[name].default
    return key


def display_key(key: str) -> str:
    """'ctrl+pagedown,f6' -> 'Ctrl+PageDown / F6' for the help screen."""
    if not key or key == UNBOUND:
        return "(unbound)"
    return " / ".join(
        "+".join(part.capitalize() if len(part) > 1 else part.upper() for part in k.split("+")) for k in key.split(",")
    )
