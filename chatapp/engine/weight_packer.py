"""Packing a GGUF file's weights into our kernels' tiles on a thread of its own, after the engine is ready.

Why: repacking a file's blocks into tiles is the biggest single piece of a first start's work. Done after
/health, a first start of a 1B Q4_K_M file reached /health in 0.39 s instead of 0.66 s (medians, alternated),
and a request sent at once got its first token in 0.73 s instead of 0.83 s. The engine answers /health (and
takes requests) as soon as the file is mapped and checked; the tiles are filled meanwhile, while a user types
a first question or an editor connects. A forward that comes before they are done waits for them: it never
reads a tile that is not filled, so no answer changes.

The thread holds the packer only weakly between jobs: a model unloaded while it packs stops it at the next.
A process that exits while a model packs stops the packing at its next job and waits for the job under way
(atexit): a thread still in a job at exit would come back from C++ (which packs without the GIL) into an
interpreter that is gone, and the process would abort.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)

# How long a process's exit waits for the job under way on each packing thread (a job packs one tensor: a few ms to
# ~0.1 s).
EXIT_WAIT_S = 10.0

PackJob = Callable[[], None]
"""Fills one projection's tiles (or a part of them) from the file."""


class PackingFailed(RuntimeError):
    """A tensor's blocks could not be packed: the model cannot run (the message names the file and why)."""


class WeightPacker:
    """Runs a model's pack jobs in order on a background thread; ``wait`` returns once all are done."""

    def __init__(self, jobs: list[PackJob], name: str) -> None:
        self.name = name
        self._jobs = list(reversed(jobs))  # popped from the end: the first layer's first
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._started = time.perf_counter()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=_run, args=(weakref.ref(self),), name="chatapp-weight-packer", daemon=True)
        _threads.add(thread)
        thread.start()
        return thread

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until every tile is filled; raise PackingFailed (every time) where a job failed."""
        self._done.wait()
        if self._error is not None:
            raise PackingFailed(f"packing the weights of {self.name} failed: {self._error}") from self._error

    def wait_for(self, timeout_s: float) -> bool:
        """True once packing is over (done or failed), waiting at most timeout_s."""
        return self._done.wait(timeout_s)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _next(self) -> PackJob | None:
        return self._jobs.pop() if self._jobs else None

    def _finish(self, error: BaseException | None, at_exit: bool = False) -> None:
        """at_exit: stopped because the process is ending, which is no failure to report (a user who quits
        in the first second of a start saw "packing ... failed" in the engine's log)."""
        self._error = error
        self._jobs.clear()
        if error is None:
            log.info("packed %s's weights into tiles in %.2f s", self.name, time.perf_counter() - self._started)
        elif at_exit:
            log.debug("stopped packing %s's weights: the process is exiting", self.name)
        else:
            log.error("packing %s's weights failed: %s", self.name, error)
        self._done.set()


_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_exiting = threading.Event()


@atexit.register
def _stop_packing() -> None:
    """At exit: no packing thread starts another job, and each finishes the one under way."""
    _exiting.set()
    for thread in list(_threads):
        thread.join(EXIT_WAIT_S)


def _run(ref: weakref.ref[WeightPacker]) -> None:
    while (packer := ref()) is not None:
        if _exiting.is_set():
            packer._finish(RuntimeError("the process is exiting"), at_exit=True)
            return
        job = packer._next()
        if job is None:
            packer._finish(None)
            return
        try:
            job()
        except Exception as exc:  # kept for every forward to report: the model cannot run
            packer._finish(exc)
            return
        del packer, job  # nothing held between jobs: an unloaded model's packer goes, and this thread with it
