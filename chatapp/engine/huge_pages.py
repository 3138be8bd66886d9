"""A model's packed weights in one mapping, moved into 2 MB pages once the model has loaded.

Why: a decode step reads every weight once. In 4 KB pages that is ~170,000 pages a token for a 1B model, each
a TLB miss, and the hardware prefetchers stop at every page's end; in 2 MB pages the same engine decoded the
1B files 4-15% faster, alternated round by round (README, twenty-fifth session). Why not ask for huge pages
before the weights are first written (MADV_HUGEPAGE): on this VM the first touch of 700 MB in fresh 2 MB pages
took anywhere from 0.02 to 0.84 s (the host backs them on demand), against ~0.12 s in small pages, and a
start-up is what the user waits on. So the weights load into small pages, and afterwards a thread at the
lowest priority asks the kernel to collapse them, 2 MB at a time (MADV_COLLAPSE, Linux 6.1). The bytes never
change, so the model runs throughout; the thread works while the engine idles (Pacer), and stops when the
model is unloaded or memory is short.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chatapp.engine.step_inputs import untouched_zeros

if TYPE_CHECKING:
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.weight_packer import WeightPacker

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
SLICE_ALIGN = 4096  # each slice starts on its own page: the repack maps whole pages ahead of its writes
MADV_COLLAPSE = 25  # <linux/mman.h>; Python's mmap module does not name it
_LOWEST_PRIORITY = 19
# The collapse waits this long after the load: what follows it (the engine's last start-up steps, the first
# /health, often a first request) is what the user waits on, and a collapse competes with it for the cores and
# for the process's memory-map lock (first starts alternated: 0.705 s against 0.693 without the wait, 0.701
# against 0.702 with it).
START_DELAY_S = 1.0
# While the engine computes, a page at most this often. Collapsing beside a running decode slows it: at ten
# pages a second a 1B Q4_K_M decode ran 5-6% slower (16 alternated windows of 48 tokens, at nice 0 and 19
# alike; the kernel's work for each page, not this thread's CPU), ~5 ms of decoding per page. So pages wait for
# the engine to idle (IDLE_AFTER_S without a step), and one that never idles still gets there at ~1% of its
# speed, in under 3 minutes for a 1B model.
BUSY_PAGE_INTERVAL_S = 0.5
IDLE_AFTER_S = 0.2
_POLL_S = 0.02

_collapsers: list[threading.Thread] = []


def mapped_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array in an anonymous mapping of its own, in small pages.

    Why not np.zeros: numpy asks for transparent huge pages on big arrays, and where the kernel
    compacts memory to find them (THP defrag "madvise", as on this VM) the first touch of 690 MB
    took 1.7 s against 0.35 s here; the repack's threads then fault the pages in between them (a 1B
    Q4_K_M file loaded in 0.36 s against 1.36 s, and 0.43 s with the pages populated up front)."""
    size = int(np.prod(shape))
    return np.frombuffer(untouched_zeros(size), dtype=np.uint8, count=size).reshape(shape)


class WeightArena:
    """One private anonymous mapping that a model's packed weights are carved from, its first slice on a
    2 MB boundary, so that nearly all of them can sit in huge pages (a mapping per tensor would leave the
    partial 2 MB pages at both ends of each: about a third of a 1B model's weights, by its tensors' sizes).

    Reserving costs nothing until written (step_inputs.untouched_zeros); past its capacity, slices get
    mappings of their own, as before the arena."""

    def __init__(self, capacity: int) -> None:
        self._map = untouched_zeros(capacity + HUGE_PAGE)
        self.address = _address_of(self._map)
        self.start = -self.address % HUGE_PAGE  # offset of the first 2 MB boundary
        self.used = self.start

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """A zeroed uint8 array of ``shape``: the arena's next slice, or a mapping of its own when full."""
        size = int(np.prod(shape))
        offset = -(-self.used // SLICE_ALIGN) * SLICE_ALIGN
        if offset + size > len(self._map):
            return mapped_zeros(shape)
        self.used = offset + size
        return np.frombuffer(self._map, dtype=np.uint8, count=size, offset=offset).reshape(shape)

    def huge_page_span(self) -> tuple[int, int]:
        """(address, bytes) of the whole 2 MB pages the slices so far cover (a partial last one stays small:
        collapsing it would commit the untouched rest)."""
        length = (self.used - self.start) // HUGE_PAGE * HUGE_PAGE
        return self.address + self.start, length

    def mapping(self) -> mmap.mmap:
        return self._map


def weight_arena_bytes(gguf: GGUFModelFile, weight_bytes: int) -> int:
    """An arena's capacity for a file's packings: their bytes (gguf_weights.native_weight_bytes) and each
    tensor's slice rounded up to its page."""
    return weight_bytes + SLICE_ALIGN * (len(gguf.tensors) + 1)


@dataclass
class CollapseReport:
    """What a collapse did: 2 MB pages asked for and made, and why it stopped early (None: it did not)."""

    pages: int
    collapsed: int = 0
    stopped: str | None = None
    seconds: float = 0.0


class StepActivity:
    """Whether this process's engine is computing, over every model it holds: collapsing one model's weights
    slows another model's decode as much as its own (compare mode runs several at once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._running = 0
        self._last_end = clock()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around each forward (core.py)."""
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._last_end = self._clock()

    def idle_seconds(self) -> float:
        """Seconds since the last step ended; 0 while one runs."""
        with self._lock:
            return 0.0 if self._running else self._clock() - self._last_end


ENGINE_STEPS = StepActivity()


class Pacer:
    """Holds each page back while the engine computes (see BUSY_PAGE_INTERVAL_S); ``idle_seconds`` says how
    long it has gone without a step (0 during one)."""

    def __init__(
        self,
        idle_seconds: Callable[[], float] = ENGINE_STEPS.idle_seconds,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._idle_seconds, self._clock, self._sleep = idle_seconds, clock, sleep
        self._last_page = clock()

    def wait(self) -> None:
        """Return when the next page may go: the engine idles, or a busy interval has passed since the last."""
        while True:
            now = self._clock()
            if self._idle_seconds() >= IDLE_AFTER_S or now - self._last_page >= BUSY_PAGE_INTERVAL_S:
                self._last_page = now
                return
            self._sleep(_POLL_S)


def collapse_in_background(
    arena: WeightArena, name: str, pacer: Pacer | None = None, packer: WeightPacker | None = None
) -> threading.Thread | None:
    """Start moving the arena's weights into huge pages on a lowest-priority thread (Linux only), a page at a
    time as ``pacer`` allows, once ``packer`` (where the weights are still being packed) has filled them:
    collapsing an unfilled page would commit memory the packing then writes anyway, beside it.

    The thread holds the arena and the packer only weakly: once the model is unloaded it stops."""
    if not sys.platform.startswith("linux"):
        return None
    address, length = arena.huge_page_span()
    if length == 0:
        return None
    mapping = weakref.ref(arena.mapping())
    packing = weakref.ref(packer) if packer is not None else None
    thread = threading.Thread(
        target=_collapse_logged,
        args=(mapping, address, length, name, pacer, packing),
        name="chatapp-huge-pages",
        daemon=True,
    )
    thread.start()
    _collapsers[:] = [t for t in _collapsers if t.is_alive()]  # an engine loads model after model
    _collapsers.append(thread)
    return thread


def wait_for_collapses(timeout_s: float) -> bool:
    """Wait for every collapse started in this process; False if one still runs after ``timeout_s``.

    For measurements of steady decoding (benchmarks/decode_alternated.py); the engine never waits."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_collapsers):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        _collapsers.remove(thread)
    return True


def _collapse_logged(
    mapping: weakref.ref[mmap.mmap],
    address: int,
    length: int,
    name: str,
    pacer: Pacer | None,
    packing: weakref.ref[WeightPacker] | None = None,
) -> None:
    with contextlib.suppress(OSError, AttributeError):  # this thread alone: the engine keeps its priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
    while packing is not None and (packer := packing()) is not None:
        if packer.wait_for(_POLL_S * 5):
            if packer.failed:
                return
            break
        del packer  # held only while waiting: an unloaded model's packer goes
    time.sleep(START_DELAY_S)
    report = collapse(mapping, address, length, pacer.wait if pacer else None)
    made = report.collapsed * HUGE_PAGE / 2**20
    asked = report.pages * HUGE_PAGE / 2**20
    if report.stopped:
        log.info("%s: %.0f of %.0f MB of weights in 2 MB pages (%s)", name, made, asked, report.stopped)
    else:
        log.info("%s: weights in 2 MB pages (%.0f MB) in %.1f s", name, made, report.seconds)


def collapse(
    mapping: weakref.ref[mmap.mmap], address: int, length: int, before_page: Callable[[], None] | None = None
) -> CollapseReport:
    """Collapse [address, address + length) of the mapping into huge pages, one at a time, while it lives."""
    report = CollapseReport(pages=length // HUGE_PAGE)
    start = time.perf_counter()
    madvise = _libc_madvise()
    for page in range(report.pages):
        if before_page is not None:
            before_page()
        alive = mapping()
        if alive is None or alive.closed:
            report.stopped = "the model was unloaded"
            break
        failed = madvise(address + page * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) != 0
        err = ctypes.get_errno()
        del alive
        if not failed:
            report.collapsed += 1
        elif err in (errno.EINVAL, errno.EPERM):
            report.stopped = f"this kernel does not collapse pages ({os.strerror(err)})"
            break
        elif err == errno.ENOMEM:
            report.stopped = "memory is short"
            break
        # EAGAIN and others: this page stays small; try the next
    report.seconds = time.perf_counter() - start
    return report


def _libc_madvise() -> Callable[[int, int, int], int]:
    """madvise(2) through ctypes, which lets go of the GIL for the call (mmap.madvise holds it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _address_of(m: mmap.mmap) -> int:
    """The address of a mapping's first byte (the temporary array lets go of the buffer at once)."""
    return int(np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data)
