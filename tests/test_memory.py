"""The engine's memory housekeeping: when an idle engine gives its activation memory back."""

from __future__ import annotations

from chatapp.engine.memory import IdleMemoryRelease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_spell_gives_the_memory_back_once_and_only_after_work() -> None:
    clock, released = Clock(), []
    idle = IdleMemoryRelease(lambda: released.append(clock.now) or 1 << 20, idle_seconds=5, clock=clock)
    for _ in range(3):  # nothing has run since the start: nothing to give back, however long it waits
        clock.now += 10
        idle.note(busy=False)
    assert released == []
    idle.note(busy=True)  # a prompt ran at 130
    clock.now += 4.9
    idle.note(busy=False)
    assert released == []  # not idle long enough
    clock.now += 0.1
    idle.note(busy=False)
    assert released == [135.0]
    clock.now += 60
    idle.note(busy=False)
    assert released == [135.0]  # once per idle spell
    idle.note(busy=True)  # the next chat
    clock.now += 3
    idle.note(busy=True)  # still running: the spell is counted from the last busy pass
    clock.now += 4
    idle.note(busy=False)
    assert released == [135.0]
    clock.now += 1
    idle.note(busy=False)
    assert released == [135.0, 203.0]
