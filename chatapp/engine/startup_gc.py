"""Python's cyclic garbage collector, held off while a process starts.

Why: a start allocates a few hundred thousand objects that live as long as the process (modules,
classes, pydantic's and FastAPI's models, the engine's tables), and every time that heap grows by a
quarter the collector walks all of it again: ~0.05 of the ~0.45 CPU-seconds `chatapp serve` spends
importing, on the two cores the engine's load needs at the same moment (a start to /health: 2-3%
sooner). Reference counting still frees everything that is not in a cycle meanwhile. Once the process
has started, collection resumes.

Nothing is frozen here (gc.freeze): a frozen cycle is never collected, and the engine's first model,
once frozen, would stay in memory after a switch to another one (process.py collects the old one).
"""

from __future__ import annotations

import gc

_held = False


def hold() -> None:
    """Stop cyclic collection until release() (a no-op if something else turned it off)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """Collect again; a no-op unless hold() stopped collection."""
    global _held
    if _held:
        _held = False
        gc.enable()


def held() -> bool:
    """Whether hold() has stopped collection and release() has not resumed it yet."""
    return _held
