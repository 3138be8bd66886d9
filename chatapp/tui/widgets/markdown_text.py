"""A message's Markdown as a few text widgets, not a widget per paragraph, list item and fence.

Why: Textual's ``Markdown`` widget mounts a tree of widgets for every block (a bulleted list of seven
items is some thirty of them), and every frame that lays the screen out walks every widget of every
pane, on screen or not. While three answers stream that walk, and the mounting of each finished
block's subtree, was most of the TUI's CPU. Here a message is drawn by Rich's Markdown renderer into
one ``Static`` per *chunk*: a finished message is one chunk; a streaming answer gains a chunk each
time blocks finish (at most one per tick) and draws the block still being written in its tail,
again per tick (a long one as plain text: see ``TAIL_MARKDOWN_CHARS``). When the answer ends, its
chunks are drawn again as one.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.text import Text
from textual._context import active_app
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.containers import Vertical
from textual.css.styles import RulesMap
from textual.selection import Selection
from textual.strip import Strip
from textual.style import Style
from textual.visual import RenderOptions, RichVisual
from textual.widget import Widget
from textual.widgets import Static

from chatapp.tui.widgets.layout_sized import LaidOutOnce

CODE_THEME = "monokai"
"""Pygments theme of fenced code (Rich draws its background, so it reads on dark and light themes)."""
TAIL_MARKDOWN_CHARS = 4000
"""The block being written is drawn as Markdown up to this size, and as plain text beyond it (a long
code block still open, drawn again every tick, would cost the UI more than its highlighting gives)."""


def rendered(source: str) -> RichMarkdown:
    """``source`` as Rich draws it: fenced code highlighted, links live."""
    return RichMarkdown(source, code_theme=CODE_THEME, hyperlinks=True)


def _is_blank(line: list[Segment]) -> bool:
    """An empty line (not a line of a code block's padding, which has its background)."""
    return all(not segment.text.strip() and not (segment.style and segment.style.bgcolor) for segment in line)


class MarkdownVisual(RichVisual):
    """Markdown drawn once per width. Textual learns a Rich renderable's height by rendering it, then
    renders it again to draw it: for Markdown (highlighted code above all) that doubled the cost of
    every chunk and of the tail on every tick. Here the lines of the first render serve both."""

    def __init__(self, widget: Widget, source: str) -> None:
        super().__init__(widget, rendered(source))
        self._width = -1
        self._lines: list[list[Segment]] = []

    def _lines_at(self, width: int) -> list[list[Segment]]:
        if width != self._width:
            app = active_app.get()
            options = app.console_options.update(highlight=False, height=None).update_width(width)
            segments = app.console.render(self._renderable, options)
            lines = list(Segment.split_and_crop_lines(segments, width, include_new_lines=False, pad=False))
            while lines and _is_blank(lines[0]):  # (Rich opens a list with an empty line: the chunks'
                del lines[0]  # own margins space them)
            while lines and _is_blank(lines[-1]):
                del lines[-1]
            self._lines = lines
            self._width = width
        return self._lines

    def get_height(self, rules: RulesMap, width: int) -> int:
        return len(self._lines_at(width))

    def render_strips(self, width: int, height: int | None, style: Style, options: RenderOptions) -> list[Strip]:
        base = style.rich_style  # (under the Markdown's own styles, as Textual's wrapping of a renderable does)
        selection, selected = options.selection, options.selection_style
        strips = []
        for y, line in enumerate(self._lines_at(width)[:height]):
            # Offsets (character positions, as Textual's own text has) let a drag select part of a line.
            strip = Strip(list(Segment.apply_style(line, base))).apply_offsets(0, y)
            span = selection.get_span(y) if selection is not None else None
            if span is not None and selected is not None:  # (the mouse selection, drawn over the text)
                text, length = "".join(segment.text for segment in line), strip.cell_length
                start = min(cell_len(text[: span[0]]), length)  # (characters to cells: wide ones take two)
                end = length if span[1] == -1 else min(cell_len(text[: span[1]]), length)
                if start < end:
                    before, chosen, after = strip.divide([start, end, length])
                    over = Strip(list(Segment.apply_style(chosen, post_style=selected.rich_style)))
                    strip = Strip.join([before, over, after])
            strips.append(strip)
        return strips

    def drawn_text(self) -> str:
        """The characters last drawn, line by line: what a mouse selection over them copies."""
        return "\n".join("".join(segment.text for segment in line).rstrip() for line in self._lines)


class _SelectableMarkdown(LaidOutOnce, Static):
    """Text of a MarkdownVisual can be selected with the mouse and copied, as any text of the app."""

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        visual = self.visual
        if not isinstance(visual, MarkdownVisual):
            return super().get_selection(selection)
        return selection.extract(visual.drawn_text()), "\n"


class MarkdownChunk(_SelectableMarkdown):
    """Whole Markdown blocks, drawn once (Textual keeps the lines until the width changes)."""

    def __init__(self, source: str, *, follows: bool) -> None:
        super().__init__(classes="md-chunk follows" if follows else "md-chunk")
        self.source = source
        self.display = bool(source.strip())  # (blank lines alone draw nothing, and take no margin)
        self.update(MarkdownVisual(self, source))


class MarkdownTail(_SelectableMarkdown):
    """The block of a streaming answer still being written (an open list, paragraph or fence)."""

    def __init__(self) -> None:
        super().__init__("", classes="md-tail")
        self.text = ""
        self.display = False

    def show(self, text: str, *, follows: bool) -> None:
        """Draw ``text`` (a blank line above it when chunks are above it); "" hides the tail."""
        self.set_class(follows, "follows")
        if text == self.text:
            return
        self.text = text
        self.display = bool(text)
        self.update(MarkdownVisual(self, text) if len(text) <= TAIL_MARKDOWN_CHARS else Text(text))


class MarkdownText(LaidOutOnce, Vertical):
    """The Markdown of one message: chunks of finished blocks, then (while it streams) the tail."""

    # The widget's own spacing (in the widget, not the app's stylesheet: it is part of drawing the
    # Markdown right): a blank line between chunks, as between the blocks inside one.
    DEFAULT_CSS = """
    MarkdownText { height: auto; }
    MarkdownText > .md-chunk, MarkdownText > .md-tail { height: auto; }
    MarkdownText > .follows { margin-top: 1; }
    """

    def __init__(self, source: str = "", *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self._initial = source

    def compose(self) -> ComposeResult:
        if self._initial:
            yield MarkdownChunk(self._initial, follows=False)
        yield MarkdownTail()

    @property
    def source(self) -> str:
        """The Markdown drawn as Markdown (the tail's text is not in it)."""
        if not self.is_mounted:
            return self._initial
        return "".join(chunk.source for chunk in self.query_children(MarkdownChunk))

    @property
    def tail(self) -> MarkdownTail:
        return self.query_one(MarkdownTail)

    def set_tail(self, text: str) -> None:
        """Show ``text`` (the block still being written) below the chunks."""
        self.tail.show(text, follows=self._drawn_above())

    def append(self, source: str) -> AwaitComplete:
        """Draw ``source`` (whole blocks) as Markdown after what is there, above the tail."""
        return AwaitComplete(self.mount(MarkdownChunk(source, follows=self._drawn_above()), before=self.tail))

    def _drawn_above(self) -> bool:
        """Whether a chunk with text is drawn already (what comes next is spaced from it)."""
        return any(chunk.source.strip() for chunk in self.query_children(MarkdownChunk))

    def update(self, source: str) -> AwaitComplete:
        """Draw ``source`` as the whole message, in one chunk (no tail)."""
        return AwaitComplete(self._replace(source))

    async def _replace(self, source: str) -> None:
        self.tail.show("", follows=False)
        await self.query_children(MarkdownChunk).remove()
        if source:
            await self.mount(MarkdownChunk(source, follows=False), before=self.tail)
