"""Python's cyclic garbage collector, held off while a process starts.

Why: a start allocates a few hundred thousand objects that live as long as the process (modules,
classes, pydantic's models, the engine's tables), and every time that heap grows by a
quarter the collector walks all of it again: ~0.05 of the ~0.45 CPU-seconds `chatapp serve` spends
importing, on the two cores the engine's load needs at the same moment (a start to /health: 2-3%
sooner). Reference counting still frees everything that is not in a cycle meanwhile. Once the process
has started, collection resumes.

Resuming it would cost a collection walking every object the start made (~80 ms in the engine, between
its model loading and its "ready"); release(freeze=True) moves them out of the collector's reach instead
(gc.freeze), where the process keeps them anyway. Frozen objects are still freed when nothing refers to
them; only a frozen cycle waits, for collect_everything(), which the engine calls when it drops a model.
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


def release(*, freeze: bool = False) -> None:
    """Collect again; a no-op unless hold() stopped collection.

    freeze: first put every object made so far out of the collector's reach, for a process that keeps
    what its start made (its modules, its app, its model), so the first collection does not walk it.
    """
    global _held
    if _held:
        _held = False
        if freeze:
            gc.freeze()
        gc.enable()


def collect_everything() -> None:
    """A full collection that reaches frozen objects too: for dropping a model, whose cycles may have been
    frozen with the start's objects."""
    gc.unfreeze()
    gc.collect()


def held() -> bool:
    """Whether hold() has stopped collection and release() has not resumed it yet."""
    return _held
