"""Where a streaming answer's finished Markdown blocks end and its block still being written begins.

Why: while an answer streams, the finished blocks go to the Markdown widget once each, and only
the block still being written is redrawn per tick (a cheap text widget), so the cost of a tick does
not grow with the answer. A block is finished at a blank line outside a code fence, or at the line
that closes a fence.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")


def settled_length(text: str) -> int:
    """Length of the longest prefix of ``text`` made of whole blocks (0 if none is finished yet)."""
    settled = 0
    fence: str | None = None  # the open fence's marker (its character repeated at least that often)
    position = 0
    for line in text.splitlines(keepends=True):
        end = position + len(line)
        if not line.endswith("\n"):
            break  # a line still being written ends nothing
        match = _FENCE.match(line)
        if fence is None:
            if match is not None:
                fence = match.group(1)
            elif not line.strip():
                settled = end
        elif match is not None and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
            if not line[match.end() :].strip():
                fence = None
                settled = end
        position = end
    return settled
