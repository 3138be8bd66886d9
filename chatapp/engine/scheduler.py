"""First come, first served scheduling under a token budget, with preemption.

Every request is "tokens computed vs tokens known". Each step hands each
scheduled request a number of new tokens to compute: 1 for a decode, a chunk
for a prompt. Fresh prompts, prefix hits, chunked prefill and resumption after
preemption are all that one path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from chatapp.engine.config import ResolvedConfig
from chatapp.engine.kv_manager import KVCacheManager
from chatapp.engine.outputs import EngineCoreOutput, TokenLogprobs
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

    def unfinished(self) -> ScheduledBatch:
        """This batch without the requests that finished since it was scheduled."""
        keep = [i for i, r in enumerate(self.requests) if not r.status.finished]
        return ScheduledBatch([self.requests[i] for i in keep], [self.num_new_tokens[i] for i in keep])

    def requests_to_sample(self) -> list[Request]:
        """Those whose new tokens reach the end of what they know: the model samples their next token.

        A prompt chunk that stops short of the prompt's end samples nothing.
        """
        return [r for r, n in zip(self.requests, self.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]


@dataclass
class StepUpdate:
    """What applying one executed step produced: the outputs to send and the prompt tokens it computed."""

    outputs: list[EngineCoreOutput]
    num_prompt_tokens: int


class Scheduler:
    def __init__(self, config: ResolvedConfig, kv: KVCacheManager) -> None:
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
        threshold = cfg.long_prefill_token_threshold
        max_num_seqs = cfg.max_num_seqs
        batch = ScheduledBatch()
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.awaits_last_token:  # its last token is being sampled: nothing follows it
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, threshold)
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
        while self.waiting and budget > 0 and not preempted and len(self.running) < max_num_seqs:
            req = self.waiting[0]
            # A request that wants prompt logprobs computes every position: no prefix-cache hit.
            lookup = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None
            cached = self.kv.find_cached_prefix(req) if lookup else []
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = min(
                req.num_tokens - req.num_computed_tokens - num_cached_tokens,
                budget,
                threshold,
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

    def update_from_output(
        self,
        batch: ScheduledBatch,
        sampled: Sequence[Request],
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> StepUpdate:
        """Apply an executed step to its requests: what it computed, then what it sampled."""
        num_prompt_tokens = self.apply_computed(batch, prompt_logprobs)
        return StepUpdate(self.apply_sampled(sampled, token_ids, logprobs), num_prompt_tokens)

    def apply_computed(
        self,
        batch: ScheduledBatch,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> int:
        """Each scheduled request has computed its new tokens: advance it (its newly full blocks become
        findable by the prefix cache). Returns how many of those tokens were prompt tokens.

        Requests that finished meanwhile (an overlapped step read back a stop) are left alone.
        """
        num_prompt_tokens = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.status.finished:
                continue
            if prompt_logprobs and req.request_id in prompt_logprobs:
                req.add_prompt_logprobs(*prompt_logprobs[req.request_id])
            if req.num_computed_tokens < req.num_prompt_tokens:
                num_prompt_tokens += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
        return num_prompt_tokens

    def apply_sampled(
        self,
        sampled: Sequence[Request],
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> list[EngineCoreOutput]:
        """Each sampled request takes its token (``token_ids[i]`` for ``sampled[i]``, in the order the
        model runner returns them; in its held place if the step ran overlapped) and is checked for
        a stop; the ones that stopped are finished (their blocks freed). The one place a request
        gains a token. Requests that finished before their token was read back (aborted) drop it.
        """
        outputs = []
        for i, req in enumerate(sampled):
            if req.status.finished:
                continue
            token = token_ids[i]
            if req.token_pending:
                req.set_pending_token(token)
            else:
                req.append_token(token)
            status = req.check_stop(token)
            out = EngineCoreOutput(
                req.request_id,
                [token],
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
            token_logprobs = logprobs[i] if logprobs is not None else None
            if token_logprobs is not None:
                out.new_logprobs = [token_logprobs]
            if req.prompt_logprobs is not None and req.num_output_tokens == 1:
                out.prompt_logprobs = req.prompt_logprobs
            if status is not None:
                self.finish(req, status)
                out.finish_reason = status.finish_reason
                out.error = req.error if status is RequestStatus.FINISHED_ERROR else None
            outputs.append(out)
        return outputs

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it first in line to be recomputed."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
