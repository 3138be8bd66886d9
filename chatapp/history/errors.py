"""What the history store raises: every failure is a HistoryError with a message a user can read."""

from __future__ import annotations


class HistoryError(Exception):
    """Base class: something about the chat history went wrong (message is user-readable)."""


class HistoryWriteError(HistoryError):
    """A change could not be saved (disk full, read-only, locked too long...).

    The change was rolled back; everything saved earlier is intact. The UI
    should tell the user and keep the chat in memory.
    """


class HistoryOpenError(HistoryError):
    """The history file cannot be opened (not a database, unreadable, upgrade failed)."""


class HistoryVersionError(HistoryOpenError):
    """The file was written by a newer chatapp; it is left untouched."""


class HistoryNotFoundError(HistoryError, LookupError):
    """No session or message with that id (it may have been deleted by another window)."""


class HistoryFormatError(HistoryError, ValueError):
    """An imported session file is not in chatapp's export format."""


# -- records returned to callers --------------------------------------------
