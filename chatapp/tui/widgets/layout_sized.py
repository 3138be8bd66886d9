"""Widgets whose growth is settled by the layout pass that measured it (no second pass per frame)."""

from __future__ import annotations

from textual.geometry import Size
from textual.widget import Widget


class LaidOutOnce(Widget):
    """A widget whose new size, found by a layout pass, does not ask for another layout pass.

    Why: after each full layout Textual stores every widget's new virtual size through a reactive
    that requests a layout again. A streaming answer grows every tick, so each tick cost two
    layouts of the whole screen, the second changing nothing: the first already placed everything
    at that size (scrollbars follow it either way). Textual's own scrolling path stores the size
    this way, without the second pass; here the message log and the widgets of a message do too.
    """

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        return super()._size_updated(size, virtual_size, container_size, layout=False)
