"""Advisory lock files that mark live writers, so a store never marks another live process's answers."""

from __future__ import annotations

import os
import re
import uuid
import weakref
from contextlib import suppress
from pathlib import Path

try:  # advisory locks mark live writers; not available on Windows
    import fcntl
except ImportError:  # pragma: no cover - exercised only on Windows
    fcntl = None  # type: ignore[assignment]

_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_open_locks: weakref.WeakSet[_WriterLock] = weakref.WeakSet()


class _WriterLock:
    """An exclusively locked file that exists while this store is open.

    Streaming messages are tagged with the store's token; another process
    that finds the token's lock file unlocked knows the writer died (the OS
    drops the lock even on SIGKILL) and may mark its answers incomplete.
    """

    def __init__(self, directory: Path) -> None:
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        if fcntl is None:  # pragma: no cover - Windows: no liveness check
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{self.token}.lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _open_locks.add(self)

    def release(self) -> None:
        if self._fd is None:
            return
        with suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)  # closing drops the lock
        self._fd = None

    def _forget_in_child(self) -> None:
        """After fork: close the child's copy, so the lock dies with the parent alone."""
        if self._fd is not None:
            with suppress(OSError):
                os.close(self._fd)
            self._fd = None

    @staticmethod
    def is_alive(directory: Path, token: str | None) -> bool:
        """Whether the store with this token is still open, in any process."""
        if fcntl is None or token is None or not _TOKEN_RE.fullmatch(token):
            return False
        path = directory / f"{token}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False  # its owner removed it on close, or a sweeper did after its death
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            with suppress(OSError):
                os.unlink(path)  # a dead writer's leftover
            return False
        finally:
            os.close(fd)

    @staticmethod
    def sweep(directory: Path) -> None:
        """Remove lock files left by writers that died."""
        with suppress(OSError):
            for entry in directory.iterdir():
                if entry.suffix == ".lock":
                    _WriterLock.is_alive(directory, entry.stem)


def _after_fork_in_child() -> None:
    for lock in list(_open_locks):
        lock._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
