"""The engine core: a step() loop of schedule -> execute -> update, on token ids.

Text never enters the core: prompts arrive tokenized and outputs leave as
token ids (clients detokenize), so the core's loop does only engine work. The
background engine process drives this same object.

Overlapped steps (``overlap_steps``, on by default on a GPU): a decode step whose requests sample
without their token history is launched before the previous step's tokens are read back. Its
inputs take those tokens on the device, and each request holds a place for its unread token, so
the scheduler can already plan the step after. One step's host work (scheduling, inputs, applying
the previous step's tokens, stops and outputs) then runs while the device computes, instead of the
device waiting for it. The cost: a request that stopped (end of text) is computed one step too
many, and that row is dropped. Any other step first reads back the step in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent import futures
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from chatapp.engine.api import EngineBusyError, EngineStats, context_length_error  # noqa: F401  (re-exported)
from chatapp.engine.config import EngineConfig, ResolvedConfig
from chatapp.engine.guided import GrammarWorker, GuidedDecodingError
from chatapp.engine.huge_pages import ENGINE_STEPS
from chatapp.engine.kv_manager import KVCacheManager
from chatapp.engine.model_ref import ModelRef, resolve_model_spec
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.source import ModelSource, open_model
from chatapp.engine.outputs import EngineCoreOutput, FinishReason
from chatapp.engine.request import Request, RequestStatus
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.sampling_rules import samples_without_history
from chatapp.engine.scheduler import ScheduledBatch, Scheduler

if TYPE_CHECKING:
    from chatapp.engine.array_runner import ArrayRunner
    from chatapp.engine.model_runner import LaunchedStep, ModelRunner

log = logging.getLogger(__name__)

_RECENT_STEPS = 64
# A step finding the weights still being packed (weight_packer.py) waits this long for them, then lets the loop
# answer its clients: the loop neither blocks for the whole packing nor spins beside it.
WEIGHTS_POLL_S = 0.005


class EngineCore:
    def __init__(self, config: EngineConfig, model: ModelRef | None = None) -> None:
        start = time.perf_counter()
        self.model = model or resolve_model_spec(config.model)
        source = open_model(self.model.path)
        self.model_config: ModelConfig = source.config
        mc = self.model_config
        resolved = config.finalize(checkpoint_dtype=mc.checkpoint_dtype, model_max_len=mc.max_position_embeddings)
        self.runner = runner_for(resolved, source)
        # The runner's decisions, folded in once: the quantization it applied (for "auto"), the pool it
        # sized, and the context capped at the pool (a request must always fit the pool on its own).
        self.config: ResolvedConfig = dataclasses.replace(
            resolved,
            quantization=self.runner.quantization,
            num_kv_blocks=self.runner.num_blocks,
            max_model_len=min(resolved.max_model_len, self.runner.num_blocks * resolved.block_size),
        )
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv)
        self._pending: list[EngineCoreOutput] = []
        self._in_flight: LaunchedStep | None = None  # an overlapped step whose tokens are still unread
        self._grammars = GrammarWorker(self.model.path, mc.vocab_size, mc.eos_token_ids)
        self._compiling: dict[str, tuple[Request, futures.Future[Any]]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Where step time goes: the model's forward (and LM head) against the whole step.
        self.forward_seconds_total = 0.0
        self.step_seconds_total = 0.0
        self._recent: deque[tuple[float, int, float]] = deque(maxlen=_RECENT_STEPS)  # (end time, tokens, seconds)
        self.load_seconds = time.perf_counter() - start
        log.info(
            "engine ready: %s on %s (%s, %s attention), KV cache %d blocks x %d tokens = %.2f GiB, "
            "max_model_len %d, loaded in %.1f s",
            self.model.name,
            self.config.device,
            self.config.dtype,
            self.config.attention_backend,
            self.kv.num_blocks,
            self.config.block_size,
            self.kv.num_blocks * self.runner.bytes_per_block() / 2**30,
            self.config.max_model_len,
            self.load_seconds,
        )

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach: the resolved config's."""
        return self.config.max_model_len

    # -- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; one that can never run finishes at the next step with an error."""
        error = self._validate(request_id, prompt_token_ids, params)
        if error is not None:
            self._pending.append(
                EngineCoreOutput(
                    request_id, [], FinishReason.ERROR, num_prompt_tokens=len(prompt_token_ids), error=error
                )
            )
            return
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            self.model_config.eos_token_ids,
            self.config.block_size,
            self.max_model_len,
        )
        if params.guided is None:
            self.scheduler.add(req)
        else:  # its grammar compiles on a worker thread; step() admits it once compiled
            assert not isinstance(params.guided, dict)  # SamplingParams.__post_init__ made it a GuidedDecoding
            self._compiling[request_id] = (req, self._grammars.submit(params.guided))

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> str | None:
        if request_id in self.scheduler.requests or request_id in self._compiling:
            return f"request id {request_id!r} is already running"
        if not prompt:
            return "the prompt is empty"
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            return f"prompt token ids must be in [0, {vocab})"
        if len(prompt) >= self.max_model_len:
            return context_length_error(self.max_model_len, len(prompt), params.max_tokens)
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests now and free their blocks; each reports finish_reason "abort" at the next step."""
        for request_id in request_ids:
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            elif request_id in self._compiling:  # not scheduled yet: no blocks to free
                req, future = self._compiling.pop(request_id)
                future.cancel()  # if it has not started: the worker skips it
            else:
                continue
            self._pending.append(
                EngineCoreOutput(
                    request_id,
                    [],
                    FinishReason.ABORT,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )

    def has_work(self) -> bool:
        return bool(self.scheduler.num_unfinished or self._pending or self._compiling or self._in_flight)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler (in arrival order); a bad one fails."""
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                req.matcher = future.result()
            except Exception as exc:  # noqa: BLE001  a bad spec, or llguidance failing on this model
                if not isinstance(exc, GuidedDecodingError):
                    log.exception("guided decoding failed to start for %s", request_id)
                    exc = GuidedDecodingError(f"guided decoding is unavailable for this model: {exc}")
                self._pending.append(
                    EngineCoreOutput(
                        request_id, [], FinishReason.ERROR, num_prompt_tokens=req.num_prompt_tokens, error=str(exc)
                    )
                )
                continue
            self.scheduler.add(req)

    # -- the loop -----------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        step_start = time.perf_counter()
        if self._compiling:
            self._admit_compiled()
        outputs, self._pending = self._pending, []
        if not self.runner.weights_ready(WEIGHTS_POLL_S):
            return outputs  # the weights are still being packed: the loop answers clients meanwhile
        batch = self.scheduler.schedule()
        if batch and self._can_overlap(batch):
            return outputs + self._overlapped_step(batch, step_start)
        if self._in_flight is not None:
            outputs += self._read_in_flight()
            batch = batch.unfinished()  # a request it stopped was scheduled already
        if not batch:
            if self._compiling:  # nothing to run until a grammar compiles: wait for one, briefly
                futures.wait([f for _r, f in self._compiling.values()], 0.005, futures.FIRST_COMPLETED)
            return outputs
        with ENGINE_STEPS.step():  # a huge-page collapse waits while any model computes (huge_pages.py)
            result = self.runner.execute(batch, self._block_ids(batch))
        update = self.scheduler.update_from_output(
            batch, result.sampled_requests, result.sampled.token_ids, result.sampled.logprobs, result.prompt_logprobs
        )
        outputs += update.outputs
        self.prompt_tokens_total += update.num_prompt_tokens
        self.generation_tokens_total += len(result.sampled_requests)
        self._count_step(step_start, result.forward_seconds, len(result.sampled_requests))
        return outputs

    def _block_ids(self, batch: ScheduledBatch) -> dict[str, list[int]]:
        return {r.request_id: self.kv.block_ids(r.request_id) for r in batch.requests}

    def _can_overlap(self, batch: ScheduledBatch) -> bool:
        """A decode-only step whose every request samples without its token history (the host's
        copy of a request's tokens lacks the one in flight)."""
        return (
            self.config.overlap_steps
            and all(n == 1 for n in batch.num_new_tokens)
            and len(batch.requests_to_sample()) == len(batch)
            and all(samples_without_history(r) for r in batch.requests)
        )

    def _overlapped_step(self, batch: ScheduledBatch, step_start: float) -> list[EngineCoreOutput]:
        """Launch this step, then apply the one in flight while the device computes this one."""
        runner = cast("ModelRunner", self.runner)  # overlap_steps rules out the array runner (array_extension)
        launched = runner.launch_decode(batch, self._block_ids(batch), self._in_flight)
        outputs = self._read_in_flight() if self._in_flight is not None else []
        self.scheduler.apply_computed(batch)  # leaves alone the requests the read-back just stopped
        for req in launched.requests:
            if not req.status.finished:
                req.append_pending_token()
        self._in_flight = launched
        self._count_step(step_start, launched.forward_seconds, len(batch))
        return outputs

    def _read_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and apply its tokens (requests aborted meanwhile drop theirs)."""
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        outputs = self.scheduler.apply_sampled(launched.requests, launched.token_ids())
        self.generation_tokens_total += len(outputs)
        return outputs

    def _count_step(self, step_start: float, forward_seconds: float, tokens: int) -> None:
        step_seconds = time.perf_counter() - step_start
        self.forward_seconds_total += forward_seconds
        self.step_seconds_total += step_seconds
        self._recent.append((time.monotonic(), tokens, step_seconds))

    # -- embeddings -----------------------------------------------------------

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Mean-pooled, L2-normalised final hidden states of each prompt.

        Runs between generation steps on borrowed KV blocks that are freed
        (and never cached) right after. Raises EngineBusyError when the pool
        cannot lend enough blocks now, ValueError for an invalid prompt.
        """
        vectors = []
        for i, ids in enumerate(prompts):
            error = self._validate(f"embedding-{i}", ids, SamplingParams(max_tokens=1))
            if error is not None:
                raise ValueError(error)
            req = Request(
                f"\0embed-{i}",
                ids,
                SamplingParams(max_tokens=1),
                frozenset(),
                self.config.block_size,
                self.max_model_len,
            )
            if not self.kv.allocate_slots(req, len(ids)):
                raise EngineBusyError("the KV cache is full right now; retry the embedding request shortly")
            try:
                batch = ScheduledBatch([req], [len(ids)])
                with ENGINE_STEPS.step():
                    hidden = self.runner.hidden_states(batch, {req.request_id: self.kv.block_ids(req.request_id)})[0]
            finally:
                self.kv.free(req.request_id)
            vectors.append(_unit_mean(hidden if isinstance(hidden, np.ndarray) else hidden.float().cpu().numpy()))
        return vectors

    # -- introspection ------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv
        recent = [r for r in self._recent if time.monotonic() - r[0] < 10.0]
        busy = sum(r[2] for r in recent)
        return EngineStats(
            model=self.model.name,
            device=self.config.device,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            generation_tokens_per_second=sum(r[1] for r in recent) / busy if busy else 0.0,
            forward_seconds_total=self.forward_seconds_total,
            step_seconds_total=self.step_seconds_total,
        )


def runner_for(config: ResolvedConfig, source: ModelSource) -> ModelRunner | ArrayRunner:
    """The torch-free CPU runner where it applies (config.runner says), else the torch one."""
    from chatapp.engine.array_runner import ArrayRunner, array_extension

    ext = array_extension(config, source)
    if ext is not None:
        return ArrayRunner(config, source, ext)
    from chatapp.engine.model_runner import ModelRunner

    return ModelRunner(config, source)


def _unit_mean(hidden: np.ndarray) -> list[float]:
    """An embedding: the mean over tokens scaled to unit length (torch's normalize, eps 1e-12)."""
    mean = hidden.astype(np.float32, copy=False).mean(axis=0)
    unit: list[float] = (mean / max(float(np.linalg.norm(mean)), 1e-12)).tolist()
    return unit
