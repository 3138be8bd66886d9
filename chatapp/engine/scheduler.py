"""First come, first served scheduling under a token budget, with preemption.

Every request is "tokens computed vs tokens known". Each step hands each
scheduled request a number of new tokens to compute: 1 for a decode, a chunk
for a prompt. Fresh prompts, prefix hits, chunked prefill and resumption after
preemption are all that one path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from chatapp.engine.config import EngineConfig
from chatapp.engine.kv_manager import KVCacheManager
from chatapp.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What one step computes: requests in batch order and their new token counts."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks (safe to call twice)."""
        if request.request_id not in self.requests:
            return
        request.status = status
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step -----------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        batch = ScheduledBatch()
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, cfg.long_prefill_token_threshold)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # Admit waiting requests in order; none after a preemption, which means memory is short.
        while self.waiting and budget > 0 and not preempted and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = min(
                req.num_tokens - req.num_computed_tokens - num_cached_tokens,
                budget,
                cfg.long_prefill_token_threshold,
            )
            if not self.kv.allocate_slots(req, num_new, cached):
                break
            self.waiting.popleft()
            if req.num_computed_tokens == 0:
                self.kv.record_lookup(req.num_tokens, num_cached_tokens)
                if req.status is RequestStatus.WAITING:
                    req.num_cached_tokens = num_cached_tokens
            req.num_computed_tokens += num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it first in line to be recomputed."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
