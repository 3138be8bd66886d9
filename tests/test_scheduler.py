"""The scheduler on its own: budgets, chunked prefill, FCFS order and preemption."""

from __future__ import annotations

from chatapp.engine.config import EngineConfig
from chatapp.engine.kv_manager import KVCacheManager
from chatapp.engine.request import Request, RequestStatus
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.scheduler import Scheduler

BS = 4


def make(num_blocks: int = 64, **cfg) -> Scheduler:
    config = EngineConfig(
        device="cpu",
        block_size=BS,
        max_num_seqs=cfg.get("max_num_seqs", 8),
        max_num_batched_tokens=cfg.get("budget", 32),
        long_prefill_token_threshold=cfg.get("threshold", 32),
    ).finalize(checkpoint_dtype=None, model_max_len=1000)
    return Scheduler(config, KVCacheManager(num_blocks, BS))


def request(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), frozenset(), BS, 1000)


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model computed everything and sampled 7 where a request caught up,
    and apply that through the scheduler's own update (as EngineCore.step does)."""
    batch = s.schedule()
    sampled = batch.requests_to_sample()
    s.update_from_output(batch, sampled, [7] * len(sampled))
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}


def test_long_prompt_is_chunked_and_decodes_share_the_step() -> None:
    s = make(budget=10, threshold=8)
    s.add(request("a", 3))
    assert run_step(s) == {"a": 3}
    s.add(request("b", 20, start=100))
    assert run_step(s) == {"a": 1, "b": 8}  # a decodes while b's prompt is cut into chunks
    assert run_step(s) == {"a": 1, "b": 8}
    assert run_step(s) == {"a": 1, "b": 4}
    assert run_step(s) == {"a": 1, "b": 1}


def test_first_come_first_served_under_max_num_seqs() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(request(rid, 2, start=ord(rid) * 10))
    assert list(run_step(s)) == ["a", "b"]
    s.finish(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    assert list(run_step(s)) == ["b", "c"]


def test_most_recently_admitted_is_preempted_and_resumes_first() -> None:
    s = make(num_blocks=5, budget=64, threshold=64)
    s.add(request("old", 8))  # 2 blocks + room to grow
    s.add(request("new", 8, start=50))
    run_step(s)  # both prefilled: 4 blocks used, each with a token known beyond
    run_step(s)  # both need a third block: only one is left -> the newer one is preempted
    assert s.num_preemptions == 1
    preempted = s.requests["new"]
    assert preempted.status is RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0
    assert s.waiting[0] is preempted and [r.request_id for r in s.running] == ["old"]
    s.add(request("later", 2, start=90))
    s.finish(s.requests["old"], RequestStatus.FINISHED_STOPPED)
    assert list(run_step(s))[0] == "new"  # the preempted request goes before later arrivals
    # Recomputed in one go with the token it had sampled before, then it sampled the next one.
    assert preempted.num_computed_tokens == 9 and preempted.output_token_ids == [7, 7]


def test_preempted_request_gets_its_surviving_blocks_back_from_the_cache() -> None:
    s = make(num_blocks=5, budget=64, threshold=64)
    s.add(request("a", 8))
    s.add(request("b", 8, start=40))
    run_step(s)
    for _ in range(4):
        run_step(s)
    assert s.num_preemptions >= 1
    s.finish(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    hits_before = s.kv.stats.hits
    run_step(s)
    assert s.kv.stats.hits > hits_before  # b's full blocks were still cached when it came back


def test_everything_freed_after_finish() -> None:
    s = make(num_blocks=16)
    for i in range(4):
        s.add(request(f"r{i}", 5, start=i * 10))
    for _ in range(3):
        run_step(s)
    for req in list(s.requests.values()):
        s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16 and not s.running and not s.waiting


def test_update_from_output_advances_samples_and_finishes_in_one_place() -> None:
    """A prompt chunk samples nothing; the chunk that ends the prompt samples; a stop finishes."""
    s = make(budget=6, threshold=6)
    req = Request("a", list(range(10)), SamplingParams(max_tokens=2), frozenset({99}), BS, 1000)
    s.add(req)
    batch = s.schedule()
    assert batch.num_new_tokens == [6] and batch.requests_to_sample() == []
    update = s.update_from_output(batch, [], [])
    assert req.num_computed_tokens == 6 and update.outputs == [] and update.num_prompt_tokens == 6
    assert len(s.kv.find_cached_prefix(request("probe", 10))) == 6 // BS  # its full block is findable at once
    batch = s.schedule()
    assert batch.num_new_tokens == [4] and batch.requests_to_sample() == [req]
    update = s.update_from_output(batch, [req], [5])
    assert [o.new_token_ids for o in update.outputs] == [[5]] and update.num_prompt_tokens == 4
    assert req.output_token_ids == [5] and not update.outputs[0].finished
    batch = s.schedule()
    update = s.update_from_output(batch, batch.requests_to_sample(), [99])  # the stop token
    assert update.outputs[0].finish_reason == "stop" and update.num_prompt_tokens == 0
    assert s.num_unfinished == 0 and s.kv.num_free_blocks == s.kv.num_blocks
