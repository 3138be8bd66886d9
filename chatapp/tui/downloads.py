"""Model downloads that go on in the background while the user chats.

A :class:`PullJob` is what the model screen draws (bytes done of total, state);
the app runs each job in a thread worker of its own, so closing the model
screen does not stop a download. Cancelling makes the next progress callback
raise :class:`PullCancelled`, which unwinds the download; the Hub client resumes
a later pull of the same model where this one stopped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class PullCancelled(BaseException):
    """Raised inside the download thread to stop it (a BaseException, so no library wraps it)."""


@dataclass
class PullJob:
    spec: str
    total_bytes: int | None = None
    done_bytes: int = 0
    state: str = "planning"
    """"planning", "downloading", "done", "cancelled" or "failed"."""
    error: str | None = None
    name: str | None = None
    """The model's name once pulled (what to switch to)."""
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def progress(self, n: int) -> None:
        """The download thread's callback."""
        if self._cancel.is_set():
            raise PullCancelled()
        self.done_bytes += n

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def active(self) -> bool:
        return self.state in ("planning", "downloading")

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return min(1.0, self.done_bytes / self.total_bytes)
