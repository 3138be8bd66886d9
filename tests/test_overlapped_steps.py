"""Overlapped decode steps (core.py): a step launched before the previous one's tokens are read.

On a GPU this hides the host's per-step work behind the device's; here, on the CPU, the same path
runs with ``overlap_steps=True`` so its bookkeeping (held token places, tokens taken from the
previous step, stops read one step late, aborts and preemption in between) is checked against the
plain step-by-step engine: every request must get exactly the same tokens and finish the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from chatapp.engine.config import EngineConfig
from chatapp.engine.core import EngineCore
from chatapp.engine.cuda_graphs import take_previous_tokens
from chatapp.engine.outputs import EngineCoreOutput
from chatapp.engine.request import PENDING_TOKEN
from chatapp.engine.sampling_params import SamplingParams

PREFIX = list(range(1000, 1040))  # 40 shared tokens: prefix-cache hits across requests


def make_core(model: Path, overlap: bool, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(device="cpu", block_size=16, overlap_steps=overlap, max_num_seqs=8)
    settings.update(overrides)
    return EngineCore(EngineConfig(model=str(model), **settings))  # type: ignore[arg-type]


def run(core: EngineCore, script: dict[int, list[tuple[str, list[int], SamplingParams]]], abort_at: dict[int, str]):
    """Drive the core step by step, adding requests and aborting where the script says; returns each
    request's tokens and finish reason."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}

    def take(outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out.finish_reason.value

    step = 0
    while core.has_work() or step <= max(script):
        for request_id, prompt, params in script.get(step, []):
            core.add_request(request_id, prompt, params)
        if step in abort_at:
            core.abort([abort_at[step]])
        take(core.step())
        step += 1
        assert step < 2000, "the engine did not finish"
    assert core.kv.num_free_blocks == core.kv.num_blocks  # every block back
    assert not core.scheduler.requests and core._in_flight is None
    return tokens, finished


def workload(stop_token: int) -> tuple[dict[int, list[tuple[str, list[int], SamplingParams]]], dict[int, str]]:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    script = {
        0: [
            ("a", [*PREFIX, 5, 6, 7], greedy),
            ("b", [*PREFIX, 8, 9], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
            ("stop", [*PREFIX, 11], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token])),
            ("seeded", [*PREFIX, 12, 13], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=30)),
        ],
        # joins mid-decode: its prompt forces a step that is not overlapped
        5: [("late", [*PREFIX, 20, 21, 22, 23], greedy)],
        # wants logprobs: the steps it is in sample on the host, the others still overlap
        12: [("logprobs", [*PREFIX, 30], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))],
        14: [("aborted", [*PREFIX, 40, 41], greedy)],
    }
    return script, {20: "aborted"}


def first_greedy_tokens(model: Path, **overrides: object) -> list[int]:
    core = make_core(model, overlap=False, **overrides)
    tokens, _ = run(
        core, {0: [("x", [*PREFIX, 11], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]}, {}
    )
    return tokens["x"]


def test_overlapped_steps_give_the_tokens_of_steps_in_turn(tiny_llama: Path) -> None:
    check_overlapped_against_plain(tiny_llama)


def check_overlapped_against_plain(model: Path, **overrides: object) -> EngineCore:
    """Run the workload overlapped and not; the same tokens and finishes. Returns the overlapped core."""
    # A stop token the "stop" request really meets a few tokens in, so its stop is read one step late.
    stop_token = first_greedy_tokens(model, **overrides)[4]
    script, abort_at = workload(stop_token)
    # A pool of 10 blocks of 16 for six requests of up to ~85 tokens: some are preempted on the way.
    plain_core = make_core(model, overlap=False, num_kv_blocks=10, **overrides)
    overlapped_core = make_core(model, overlap=True, num_kv_blocks=10, **overrides)
    plain, plain_finish = run(plain_core, script, abort_at)
    overlapped, overlapped_finish = run(overlapped_core, script, abort_at)

    assert overlapped_core.runner.launched_steps > 20 and plain_core.runner.launched_steps == 0
    assert overlapped_core.scheduler.num_preemptions > 0 and plain_core.scheduler.num_preemptions > 0
    assert overlapped_core.kv.stats.hits > 0
    assert plain_finish == overlapped_finish
    assert plain_finish["stop"] == "stop" and plain["stop"][-1] == stop_token
    assert plain_finish["aborted"] == "abort"
    for request_id in plain:
        if request_id == "aborted":  # aborted at the same step, it may hold one token fewer: read later
            assert overlapped[request_id] == plain[request_id][: len(overlapped[request_id])]
            assert len(overlapped[request_id]) >= len(plain[request_id]) - 1
        else:
            assert overlapped[request_id] == plain[request_id], request_id
    assert PENDING_TOKEN not in [t for ts in overlapped.values() for t in ts]
    return overlapped_core


def test_an_overlapped_step_returns_the_tokens_of_the_step_before(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, overlap=True)
    core.add_request("r", [*PREFIX, 1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = core.step()  # the prompt: not overlapped, its token comes back at once
    assert [o.new_token_ids for o in first] == [[first[0].new_token_ids[0]]]
    assert core.step() == []  # the first decode is launched; nothing read back yet
    request = core.scheduler.requests["r"]
    assert request.token_pending and request.all_token_ids[-1] == PENDING_TOKEN
    second = core.step()  # launches the next, reads the one before
    assert len(second) == 1 and len(second[0].new_token_ids) == 1
    third = core.step()
    assert len(third) == 1
    # The fourth token is the last by length: nothing more is scheduled, the step reads it back.
    last = core.step()
    assert last[0].finish_reason is not None and last[0].finish_reason.value == "length"
    assert not core.has_work()


def test_requests_that_need_their_history_are_not_overlapped(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, overlap=True)
    core.add_request("p", [*PREFIX, 1], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3))
    while core.has_work():
        core.step()
    assert core.runner.launched_steps == 0


def test_overlap_is_off_on_the_cpu_unless_asked_for(tiny_llama: Path) -> None:
    assert make_core(tiny_llama, overlap=None).config.overlap_steps is False  # type: ignore[arg-type]


def test_take_previous_tokens_fills_only_the_rows_that_name_one() -> None:
    ids = torch.tensor([5, PENDING_TOKEN, 7, PENDING_TOKEN])
    take_previous_tokens(ids, torch.tensor([-1, 2, -1, 0]), torch.tensor([40, 41, 42]))
    assert ids.tolist() == [5, 42, 7, 40]


def test_a_stop_read_back_before_a_prompt_step_drops_the_stopped_request(tiny_llama: Path) -> None:
    stop = first_greedy_tokens(tiny_llama)[2]  # the prompt step samples token 0; decodes 1 and 2
    core = make_core(tiny_llama, overlap=True)
    core.add_request("r", [*PREFIX, 11], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))
    outputs = core.step() + core.step() + core.step()  # prompt; launch 1; launch 2, read 1
    assert core.scheduler.requests["r"].token_pending  # token 2, the stop, is in flight
    fresh = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    core.add_request("new", [*PREFIX, 50, 51], fresh)
    # Scheduled with the new prompt, r's next decode is dropped once the read-back stops it.
    outputs += core.step()
    while core.has_work():
        outputs += core.step()
    r_tokens = [t for o in outputs if o.request_id == "r" for t in o.new_token_ids]
    assert r_tokens == first_greedy_tokens(tiny_llama)[:3]
    assert [o.finish_reason.value for o in outputs if o.request_id == "r" and o.finish_reason] == ["stop"]
    solo = make_core(tiny_llama, overlap=False)
    alone, _ = run(solo, {0: [("new", [*PREFIX, 50, 51], fresh)]}, {})
    assert [t for o in outputs if o.request_id == "new" for t in o.new_token_ids] == alone["new"]
    assert core.kv.num_free_blocks == core.kv.num_blocks
