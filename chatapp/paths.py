"""Where chatapp keeps its files, from platformdirs.

Every directory can be moved with an environment variable so tests (and users
with unusual setups) never touch the real home directory:
``CHATAPP_CACHE_DIR``, ``CHATAPP_DATA_DIR``, ``CHATAPP_CONFIG_DIR``, ``CHATAPP_LOG_DIR``,
``CHATAPP_RUNTIME_DIR``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import platformdirs

APP_NAME = "chatapp"


def _dir(env_var: str, default: Callable[[str], str]) -> Path:
    path = Path(os.environ.get(env_var) or default(APP_NAME))  # the default only when needed
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Converted models and other data that can be rebuilt."""
    return _dir("CHATAPP_CACHE_DIR", platformdirs.user_cache_dir)


def data_dir() -> Path:
    """Chat history: data the user would be sad to lose, and nobody else's to read (mode 0700)."""
    path = _dir("CHATAPP_DATA_DIR", platformdirs.user_data_dir)
    try:
        if path.stat().st_uid == os.getuid():  # a directory someone else gave us is theirs to set
            os.chmod(path, 0o700)
    except OSError:
        pass  # the history's own file is still 0600
    return path


def config_dir() -> Path:
    """The settings file."""
    return _dir("CHATAPP_CONFIG_DIR", platformdirs.user_config_dir)


def log_dir() -> Path:
    """The TUI's log files (a full-screen app cannot print its warnings)."""
    return _dir("CHATAPP_LOG_DIR", platformdirs.user_log_dir)


def runtime_dir() -> Path:
    """The engine's IPC socket; private to this user (mode 0700).

    Without XDG_RUNTIME_DIR (no login session: containers, some SSH set-ups) platformdirs falls back
    to /tmp/runtime-UID and warns on the terminal; its concern, a directory another user made first,
    is checked here instead (it must be ours), so the warning is not shown.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        path = _dir("CHATAPP_RUNTIME_DIR", platformdirs.user_runtime_dir)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(
            f"the runtime directory {path} belongs to another user; set CHATAPP_RUNTIME_DIR to a directory of yours"
        )
    os.chmod(path, 0o700)
    return path
