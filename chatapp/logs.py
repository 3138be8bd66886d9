"""Where log lines go: the terminal for the command-line tools, a rotating file for the TUI.

A warning printed to stderr while Textual owns the screen lands over the chat (huggingface_hub's
retry lines did, for half a minute, when the Hub was unreachable); in the TUI every log line goes
to ``tui.log`` in the log directory instead, whose path the F1 screen shows.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

from chatapp import paths

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TUI_LOG_NAME = "tui.log"
TUI_LOG_BYTES = 1_000_000
TUI_LOG_BACKUPS = 3


def log_to_terminal(verbose: bool) -> None:
    """Command-line tools (``chatapp serve``, ``chatapp models``): log lines on stderr."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)


def tui_log_path() -> Path:
    return paths.log_dir() / TUI_LOG_NAME


def log_to_file(verbose: bool) -> Path | None:
    """The TUI: every log line (and Python warning) to a rotating file, none to the terminal. A log
    that cannot be written (a read-only home) is no reason not to start: then lines go nowhere."""
    path: Path | None = None
    handler: logging.Handler = logging.NullHandler()
    try:
        path = tui_log_path()
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=TUI_LOG_BYTES, backupCount=TUI_LOG_BACKUPS, encoding="utf-8"
        )
    except OSError:
        path = None
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)
    _drop_terminal_handlers()
    return path


def _drop_terminal_handlers() -> None:
    """Libraries that give their own logger a handler on the terminal lose it; their lines still reach
    the file through the root. huggingface_hub adds one to its logger when first imported, so it is
    imported here (a few milliseconds) rather than later, when a Hub search would add it mid-session."""
    import huggingface_hub.utils.logging  # noqa: F401  (the import adds the handler: import, then drop)

    for logger in logging.Logger.manager.loggerDict.values():
        if not isinstance(logger, logging.Logger):
            continue  # (a placeholder for loggers below it: no handlers of its own)
        for handler in logger.handlers[:]:
            if type(handler) is logging.StreamHandler:  # (a FileHandler is a StreamHandler too: kept)
                logger.removeHandler(handler)
