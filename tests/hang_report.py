"""Before pytest-timeout ends a test, print where every asyncio task of the process waits.

Why: pytest-timeout's own report shows each thread's stack, and a hung async test shows only its event loop
idling in select(): the task that waits forever, and on what, is not in it (the TUI's hang at quit, CI 43).
conftest.py starts a watch for each test; at the test's timeout less a margin the watch prints the stack of
every task of every running event loop to stderr, which pytest shows with the failure.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from typing import TextIO

import pytest

MARGIN_S = 30.0
"""How long before the timeout the tasks are printed (at most half the timeout: short ones get half)."""

reports = 0
"""How many reports were printed (tests check the watch with it)."""


def timeout_of(item: pytest.Item) -> float | None:
    """The test's pytest-timeout limit: its marker's, else the ini option's; None when there is none."""
    marker = item.get_closest_marker("timeout")
    value = marker.args[0] if marker is not None and marker.args else marker.kwargs.get("timeout") if marker else None
    if value is None:
        value = item.config.getini("timeout") or None
    try:
        seconds = float(value) if value is not None else 0.0
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def print_tasks(test: str, file: TextIO | None = None) -> None:
    """Every task of every running event loop in this process, with its stack."""
    global reports
    out = file if file is not None else sys.stderr
    print(f"\n===== asyncio tasks of {test}, still running near its timeout =====", file=out)
    # type(o), not isinstance: isinstance reads o.__class__, which some objects answer with a warning
    loops = [o for o in gc.get_objects() if issubclass(type(o), asyncio.AbstractEventLoop)]
    for loop in loops:
        if loop.is_closed() or not loop.is_running():
            continue
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:  # the set changed under us too often: report what can be
            continue
        print(f"--- {len(tasks)} task(s) of {loop!r}", file=out)
        for task in tasks:
            print(f"* {task!r}", file=out)
            task.print_stack(limit=25, file=out)
    reports += 1


def watch(item: pytest.Item) -> threading.Event | None:
    """Start the watch of one test; setting the returned event (when the test ends) stops it."""
    limit = timeout_of(item)
    if limit is None:
        return None
    done = threading.Event()
    delay = max(limit - MARGIN_S, limit / 2)

    def wait_then_report() -> None:
        if not done.wait(delay):
            try:
                print_tasks(item.nodeid)
            except Exception as exc:  # a diagnostic must never fail the run
                print(f"(could not print the asyncio tasks: {exc!r})", file=sys.stderr)

    threading.Thread(target=wait_then_report, name="hang-report", daemon=True).start()
    return done
