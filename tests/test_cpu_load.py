"""The CPU-load monitor that decides whether a small step may use every thread (chatapp/engine/cpu_load.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from chatapp.engine.cpu_load import CpuLoadMonitor, cores_are_free, others_busy_cpus


def test_others_busy_is_the_machine_minus_us() -> None:
    assert others_busy_cpus(total_busy_s=3.0, ours_s=2.0, wall_s=1.0) == 1.0
    assert others_busy_cpus(total_busy_s=1.0, ours_s=1.2, wall_s=1.0) == 0.0  # counters tick apart: never below 0
    assert others_busy_cpus(total_busy_s=1.0, ours_s=0.0, wall_s=0.0) == 0.0


def test_all_threads_fit_only_beside_an_idle_machine() -> None:
    assert cores_are_free(0.1, logical_cpus=2, threads=2)
    assert not cores_are_free(1.0, logical_cpus=2, threads=2)  # a busy neighbour: one core is taken
    assert cores_are_free(1.0, logical_cpus=4, threads=2)  # ... unless there are cores to spare
    assert not cores_are_free(2.5, logical_cpus=4, threads=2)


def test_a_busy_process_beside_us_is_seen() -> None:
    """A real spinning child process: the monitor, asked for every core, says they are not free."""
    threads = psutil.cpu_count(logical=True) or 1
    monitor = CpuLoadMonitor(max(2, threads))
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.2)
        monitor.all_threads_fit()  # starts a fresh window with the spinner running
        deadline = time.monotonic() + 10
        verdicts = []
        while time.monotonic() < deadline and len(verdicts) < 3:
            time.sleep(0.6)
            verdicts.append(monitor.all_threads_fit())
        assert verdicts[-1] is False, verdicts
    finally:
        spinner.kill()
        spinner.wait()


def test_one_thread_never_asks() -> None:
    assert CpuLoadMonitor(1).all_threads_fit() is False


def test_samples_are_reused_within_the_interval() -> None:
    now = [100.0]
    monitor = CpuLoadMonitor(2, clock=lambda: now[0])
    calls = []
    monitor._sample = lambda: calls.append(1) or (now[0], 0.0, 0.0)  # type: ignore[method-assign]
    for _ in range(50):
        monitor.all_threads_fit()
    assert calls == []  # all within SAMPLE_INTERVAL_S of the first sample
    now[0] += 1.0
    monitor.all_threads_fit()
    assert calls == [1]


def test_the_model_runner_asks_the_monitor_for_small_steps(tiny_llama) -> None:
    """A small step gets every thread when the monitor says the cores are free, one thread when not."""
    import torch

    from chatapp.engine import LLM, SamplingParams

    before = torch.get_num_threads()
    llm = LLM(str(tiny_llama), num_threads=2, num_kv_blocks=64)
    asked = []

    class Monitor:
        def __init__(self, free: bool) -> None:
            self.free = free

        def all_threads_fit(self) -> bool:
            asked.append(self.free)
            return self.free

    try:
        for free, expected in ((True, 2), (False, 1), (True, 2)):
            llm.core.runner.cpu_load = Monitor(free)
            llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
            assert torch.get_num_threads() == expected, (free, asked)
        assert asked and set(asked) == {True, False}
    finally:
        torch.set_num_threads(before)
