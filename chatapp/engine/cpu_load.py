"""How busy the rest of the machine is, so a CPU step knows whether its OpenMP threads will run.

Why: a forward split over every core runs ~150 parallel regions a step, and each one waits for
its slowest thread. When another process holds a core (the TUI redrawing, a browser, a second
engine), the thread that lands there waits for the scheduler and a decode step gets 3x slower
than on one thread (measured on 2 cores: 167 tok/s on one thread, 55 on two beside a busy
process; 200 on two when the machine was otherwise idle). So the model runner asks this monitor,
which samples the machine's CPU time twice a second, whether the cores it would use are free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

SAMPLE_INTERVAL_S = 0.5
_BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")
SLACK_CPUS = 0.25  # others may use this much of "our" cores (daemons, our own clients' streaming)


def others_busy_cpus(total_busy_s: float, ours_s: float, wall_s: float) -> float:
    """CPUs kept busy by every process but ours over a sampling interval."""
    return max(0.0, (total_busy_s - ours_s) / wall_s) if wall_s > 0 else 0.0


def cores_are_free(others_busy: float, logical_cpus: int, threads: int) -> bool:
    """True when `threads` of ours fit beside what the others use."""
    return others_busy <= logical_cpus - threads + SLACK_CPUS


class CpuLoadMonitor:
    """Answers "may this step use all its threads?", from samples at most SAMPLE_INTERVAL_S old."""

    def __init__(self, threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.logical_cpus = psutil.cpu_count(logical=True) or threads
        self._clock = clock
        self._process = psutil.Process()
        self._free = True
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall clock, machine busy CPU seconds, our CPU seconds), or None where the OS will not say."""
        try:
            machine = psutil.cpu_times()
            ours = self._process.cpu_times()
        except (psutil.Error, OSError):
            return None
        # Linux counts guest time inside user time too, so the guest fields stay out of the sum.
        busy = sum(getattr(machine, name, 0.0) for name in _BUSY_FIELDS)
        return self._clock(), busy, ours.user + ours.system

    def all_threads_fit(self) -> bool:
        """False where it cannot tell (no CPU counters): the caller keeps small steps on one thread."""
        if self.threads <= 1 or self._last is None:
            return False
        if self._clock() - self._last[0] >= SAMPLE_INTERVAL_S:
            now = self._sample()
            if now is None:
                self._last = None
                return False
            wall, busy, ours = (now[i] - self._last[i] for i in range(3))
            self._free = cores_are_free(others_busy_cpus(busy, ours, wall), self.logical_cpus, self.threads)
            self._last = now
        return self._free
