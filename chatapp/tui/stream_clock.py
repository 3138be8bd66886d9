"""One clock for every streaming pane, so that the screen is laid out once per tick for all of them.

Why: laying out and painting a screen of conversations costs Textual tens of milliseconds, whatever
changed, and that (not the text) is most of the TUI's CPU while answers stream. Panes that each
kept their own timer were laid out one after another, several times per tick. Here one interval
timer, running only while something streams, calls every streaming pane's ``flush`` in one
callback, inside one batch of screen updates that also waits for the Markdown blocks the flushes
mounted: all the changes land in one frame. The focused pane flushes every tick (``TICK_S``);
the others every ``UNFOCUSED_EVERY`` ticks (about once a second), as they are read at a glance, not
word by word.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import Protocol
from weakref import WeakKeyDictionary

from textual.app import App
from textual.timer import Timer

TICK_S = 0.3
"""How often the focused pane's streamed text reaches the screen."""
UNFOCUSED_EVERY = 3
"""The other panes take every third tick."""


class Flushable(Protocol):
    """A pane that streams: it hands its gathered text to its widgets when told, and returns the work
    that must end before the screen is drawn (Markdown blocks being mounted), if any."""

    @property
    def has_focus_within(self) -> bool: ...

    def flush(self) -> Awaitable[object] | None: ...


class StreamClock:
    """Ticks while at least one pane streams; see the module's docstring."""

    def __init__(self, app: App[object]) -> None:
        # Weakly: the clocks are kept by app in a WeakKeyDictionary, whose values must not hold their
        # keys (each app ever run would stay in memory: the test suite's hundreds, a benchmark's).
        self._app = weakref.ref(app)
        self._panes: dict[Flushable, None] = {}  # (ordered, like the panes on screen)
        self._timer: Timer | None = None
        self._ticks = 0

    def join(self, pane: Flushable) -> None:
        """``pane`` starts streaming: flush it on the ticks from now on."""
        self._panes[pane] = None
        if self._timer is None:
            self._ticks = 0
            app = self._app()
            if app is not None:
                self._timer = app.set_interval(TICK_S, self._tick, name="stream-clock")

    def leave(self, pane: Flushable) -> None:
        """``pane`` stopped streaming (it flushes its rest itself); the clock stops with the last one."""
        self._panes.pop(pane, None)
        if not self._panes and self._timer is not None:
            self._timer.stop()
            self._timer = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    async def _tick(self) -> None:
        self._ticks += 1
        everyone = self._ticks % UNFOCUSED_EVERY == 0
        app = self._app()
        if app is None:
            return
        with app.batch_update():
            mounting = [
                work
                for pane in list(self._panes)
                if (everyone or pane.has_focus_within) and (work := pane.flush()) is not None
            ]
            if mounting:
                await asyncio.gather(*mounting)


_clocks: WeakKeyDictionary[App[object], StreamClock] = WeakKeyDictionary()


def clock_for(app: App[object]) -> StreamClock:
    """The app's one clock (made on first use)."""
    clock = _clocks.get(app)
    if clock is None:
        clock = _clocks[app] = StreamClock(app)
    return clock
