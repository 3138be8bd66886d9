"""The engine holds streamed tokens a few milliseconds so one message carries several (stream_buffer.py)."""

from __future__ import annotations

from chatapp.engine.outputs import EngineCoreOutput, TokenLogprobs
from chatapp.engine.stream_buffer import StreamBuffer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(rid: str, ids: list[int], finish: str | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, ids, finish, **kw)


def test_first_token_goes_at_once_then_tokens_gather_until_the_interval() -> None:
    clock = Clock()
    buf = StreamBuffer(0.025, clock)
    buf.add(b"A", out("r", [1], num_prompt_tokens=5, num_cached_tokens=2))
    assert buf.due() == [(b"A", [out("r", [1], num_prompt_tokens=5, num_cached_tokens=2)])]  # time to first token
    for token in (2, 3, 4):
        clock.now += 0.005
        buf.add(b"A", out("r", [token]))
        assert buf.due() == [] and buf
    clock.now += 0.011  # 26 ms after the last message
    assert buf.due() == [(b"A", [out("r", [2, 3, 4])])]
    assert not buf


def test_the_last_output_flushes_what_was_held_and_keeps_order() -> None:
    clock = Clock()
    buf = StreamBuffer(0.025, clock)
    lp = [TokenLogprobs(-0.5, [(7, -0.5)])]
    buf.add(b"A", out("r", [1]))
    buf.due()
    buf.add(b"A", out("r", [2], new_logprobs=lp))
    buf.add(b"A", out("r", [3], "length", new_logprobs=lp))
    [(identity, [merged])] = buf.due()
    assert identity == b"A" and merged.new_token_ids == [2, 3] and merged.finish_reason == "length"
    assert merged.new_logprobs == lp + lp
    buf.add(b"A", out("r", [9]))  # the id reused by a new request: its first token is not held
    assert buf.due() == [(b"A", [out("r", [9])])]


def test_clients_are_paced_apart_and_a_new_request_flushes_its_client() -> None:
    clock = Clock()
    buf = StreamBuffer(0.025, clock)
    buf.add(b"A", out("a", [1]))
    buf.add(b"B", out("b", [1]))
    assert len(buf.due()) == 2
    clock.now += 0.01
    buf.add(b"A", out("a", [2]))
    buf.add(b"B", out("b", [2]))
    buf.add(b"B", out("b2", [5]))  # B's second request starts: B's message goes now, A's waits
    assert buf.due() == [(b"B", [out("b", [2]), out("b2", [5])])]
    assert buf.due(force=True) == [(b"A", [out("a", [2])])]


def test_a_departed_client_is_forgotten_and_zero_interval_sends_every_step() -> None:
    clock = Clock()
    buf = StreamBuffer(0.025, clock)
    buf.add(b"A", out("r", [1]))
    buf.due()
    buf.add(b"A", out("r", [2]))
    buf.forget(b"A")
    assert not buf and buf.due(force=True) == []
    buf.add(b"A", out("r", [3]))  # a new client under the same identity starts afresh
    assert buf.due() == [(b"A", [out("r", [3])])]
    every = StreamBuffer(0.0, clock)
    for token in range(3):
        every.add(b"A", out("r", [token]))
        assert every.due() == [(b"A", [out("r", [token])])]
