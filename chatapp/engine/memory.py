"""Process memory housekeeping."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def return_freed_memory() -> None:
    """Hand the float layers freed while quantizing back to the OS (glibc keeps freed chunks under
    its adaptive mmap threshold in its heap, where they would count in the resident set for good)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


# Memory the engine process gives back once it has run nothing for a while.
#
# Why: a long prompt's activations stay in the C++ kernels' pool between steps (up to 256 MiB,
# csrc/activation_pool.h), so that the next step's layers reuse them instead of mapping fresh pages.
# While no chat runs they only hold memory that the laptop's other programs could use. Given back after
# IDLE_SECONDS without work, they cost the next long prompt its page faults once more (~20 ms for a 1B
# model's 512 tokens); back-to-back requests (an agent, a benchmark) never wait that long.
IDLE_SECONDS = 5.0


class IdleMemoryRelease:
    """Calls ``release`` (which returns the bytes it gave back) once per idle spell of ``idle_seconds``."""

    def __init__(
        self,
        release: Callable[[], int],
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._release, self._idle_seconds, self._clock = release, idle_seconds, clock
        self._last_busy = clock()
        self._held = False  # work ran since the last release: the pool may hold blocks

    def note(self, busy: bool) -> None:
        """One pass of the engine loop: whether it had work."""
        now = self._clock()
        if busy:
            self._last_busy, self._held = now, True
            return
        if self._held and now - self._last_busy >= self._idle_seconds:
            self._held = False
            freed = self._release()
            if freed:
                log.info("idle for %g s: gave back %.0f MiB of activation memory", self._idle_seconds, freed / 2**20)
