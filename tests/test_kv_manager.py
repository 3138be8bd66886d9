"""The block pool and KV manager: property tests plus the known traps, without a model."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from chatapp.engine.block_pool import BlockPool
from chatapp.engine.config import EngineConfig
from chatapp.engine.kv_manager import KVCacheManager
from chatapp.engine.request import Request
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.scheduler import ScheduledBatch, Scheduler

BS = 4
_CONFIG = EngineConfig(device="cpu").finalize(checkpoint_dtype=None, model_max_len=4096)
"""A resolved config for the scheduler's update (which reads none of its budgets)."""


def make_request(rid: str, tokens: list[int], block_size: int = BS) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000), frozenset(), block_size, 10_000)


def compute(kv: KVCacheManager, req: Request, n: int, shadow: dict[int, list[int | None]] | None = None) -> bool:
    """Admit-or-extend ``req`` by ``n`` tokens as the scheduler would, writing a shadow cache."""
    cached = kv.find_cached_prefix(req) if req.num_computed_tokens == 0 and not kv.block_ids(req.request_id) else []
    n = min(n, req.num_tokens - req.num_computed_tokens - len(cached) * kv.block_size)
    if not kv.allocate_slots(req, n, cached):
        return False
    req.num_computed_tokens += len(cached) * kv.block_size
    if shadow is not None:
        table = kv.block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            shadow[table[pos // kv.block_size]][pos % kv.block_size] = req.all_token_ids[pos]
    # The step's update, as the scheduler applies it (nothing is sampled in this machine).
    Scheduler(_CONFIG, kv).update_from_output(ScheduledBatch([req], [n]), [], [])
    return True


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / share / abort / finish sequences never corrupt the pool."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BS, enable_caching=True)
        self.shadow: dict[int, list[int | None]] = {b: [None] * BS for b in range(24)}
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(target=requests, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=16))
    def new_request(self, tokens: list[int]) -> str:
        self.counter += 1
        rid = f"r{self.counter}"
        self.live[rid] = make_request(rid, tokens)
        return rid

    @rule(rid=requests, n=st.integers(1, 6))
    def step(self, rid: str, n: int) -> None:
        req = self.live.get(rid)
        if req is None or req.num_computed_tokens >= req.num_tokens:
            return
        before = {b: list(v) for b, v in self.shadow.items()}
        owned_before = set(self.kv.block_ids(rid))
        cached = self.kv.find_cached_prefix(req) if not owned_before and req.num_computed_tokens == 0 else []
        for i, block in enumerate(cached):  # a hit must hold exactly this request's tokens
            assert self.shadow[block.block_id] == req.all_token_ids[i * BS : (i + 1) * BS]
        if compute(self.kv, req, n, self.shadow):
            in_use_by_others = {b for r in self.live if r != rid for b in self.kv.block_ids(r)}
            for b in set(self.kv.block_ids(rid)) - owned_before:
                if self.shadow[b] != before[b]:  # written this step: must not belong to anyone else
                    assert b not in in_use_by_others

    @rule(rid=requests, token=st.integers(0, 1))
    def append(self, rid: str, token: int) -> None:
        req = self.live.get(rid)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            req.append_token(token)

    @rule(rid=consumes(requests))
    def finish(self, rid: str) -> None:
        if self.live.pop(rid, None) is not None:
            self.kv.free(rid)
            self.kv.free(rid)  # a second free must be a no-op

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.pool
        pool.check_invariants()
        refs: dict[int, int] = {}
        for rid in self.live:
            table = self.kv.block_ids(rid)
            assert len(table) == len(set(table)), "a request holds a block twice"
            for b in table:
                refs[b] = refs.get(b, 0) + 1
            req = self.live[rid]
            assert len(table) == self.kv.blocks_needed(req.num_computed_tokens), "not exactly one partial block"
        for block in pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"{block} refcount disagrees with tables"

    def teardown(self) -> None:
        for rid in list(self.live):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        self.kv.pool.check_invariants()


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


def test_cached_blocks_are_reused_physically() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    assert compute(kv, a, 10)
    first_blocks = kv.block_ids("a")
    kv.free("a")
    b = make_request("b", list(range(10)) + [99, 98])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == first_blocks[:2]
    assert compute(kv, b, 12)
    assert kv.block_ids("b")[:2] == first_blocks[:2]
    assert kv.stats.hits == 0  # record_lookup is the scheduler's job; compute() here does not count


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    """nano-vllm #114: a prompt whose every block is cached must leave a token to compute."""
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    assert compute(kv, a, 8)
    kv.free("a")
    b = make_request("b", list(range(8)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 1  # the second block is recomputed so the last token yields logits
    assert compute(kv, b, 8)
    assert b.num_computed_tokens == 8


def test_same_new_prefix_in_one_step_keeps_index_intact() -> None:
    """nano-vllm #219: two requests computing the same new prefix together."""
    kv = KVCacheManager(16, BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    # Both are scheduled before either is computed, so neither finds the other's blocks.
    assert kv.find_cached_prefix(a) == [] and kv.allocate_slots(a, 9)
    assert kv.find_cached_prefix(b) == [] and kv.allocate_slots(b, 9)
    for req in (a, b):
        req.num_computed_tokens = 9
        kv.cache_computed_blocks(req)
    kv.pool.check_invariants()
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))
    kv.free("b")  # freeing the duplicate must not unregister a's cached copy
    c = make_request("c", list(range(9)))
    assert [blk.block_id for blk in kv.find_cached_prefix(c)] == kv.block_ids("a")[:2]
    kv.free("a")
    kv.pool.check_invariants()


def test_free_evicts_tail_blocks_before_shared_prefix() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(16)))
    assert compute(kv, a, 16)  # all four blocks full and cached
    prefix_blocks = kv.block_ids("a")
    kv.free("a")
    # One fresh block is needed: the tail block goes first, the prefix stays findable.
    fresh = kv.pool.allocate(1)
    assert fresh[0].block_id == prefix_blocks[-1]
    probe = make_request("p", list(range(16)) + [7])
    assert [blk.block_id for blk in kv.find_cached_prefix(probe)] == prefix_blocks[:3]


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(6)))  # one full (cached) block, one partial
    assert compute(kv, a, 6)
    full, partial = kv.block_ids("a")
    kv.free("a")
    taken = [b.block_id for b in kv.pool.allocate(3)]
    assert full not in taken and partial in taken


def test_allocate_fails_without_side_effects_when_full() -> None:
    kv = KVCacheManager(2, BS)
    a = make_request("a", list(range(20)))
    assert not kv.allocate_slots(a, 20)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_double_free_of_a_block_is_detected() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)
