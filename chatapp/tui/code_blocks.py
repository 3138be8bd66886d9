"""Finding the fenced code blocks of an answer, for the copy-code key."""

from __future__ import annotations

from markdown_it import MarkdownIt


def code_blocks(markdown: str) -> list[str]:
    """The contents of every fenced or indented code block, in order (an unclosed last fence counts)."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]
