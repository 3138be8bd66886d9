"""What the TUI remembers between runs that is neither a setting nor history: today, whether the API
port (F9) was on, so a user who serves their editor from the TUI finds it serving again."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from chatapp import paths

log = logging.getLogger(__name__)

FILENAME = "tui-state.json"


@dataclass
class UiState:
    api_port_on: bool = False


def default_path() -> Path:
    return paths.data_dir() / FILENAME


def load(path: Path) -> UiState:
    """The saved state; a missing or unreadable file is the default state (it is only a convenience)."""
    try:
        data = json.loads(path.read_text())
        return UiState(api_port_on=bool(data.get("api_port_on", False)))
    except FileNotFoundError:
        return UiState()
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring the TUI state file %s: %s", path, exc)
        return UiState()


def save(state: UiState, path: Path) -> None:
    """Written whole, then renamed into place (a crash leaves the old file or the new, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(asdict(state)))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not save the TUI state to %s: %s", path, exc)
