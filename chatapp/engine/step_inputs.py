"""What both model runners share, torch-free: a scheduled batch flattened into arrays, the KV pool's
size and memory checks, and the CPU thread choice.

The torch runner (model_runner.py) turns these arrays into tensors on its device; the torch-free CPU
runner (array_runner.py) hands them to the C++ layer loop as they are.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

from chatapp.engine.config import ResolvedConfig
from chatapp.engine.cpu_load import CpuLoadMonitor
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.request import Request
from chatapp.engine.sampling_rules import SamplerOutput
from chatapp.engine.scheduler import ScheduledBatch

# Small steps run on one thread while another process holds a core (cpu_load.py says why): a
# thread waiting for the scheduler stalls every parallel region of the step. On a quiet machine
# every step uses every thread (2 cores: 200 vs 166 tok/s alone, 549 vs 370 at 16 requests), as
# do big steps always (prompts of 512 tokens went 1.5x faster on two cores, as did a few new
# tokens attending to a long cached conversation).
SINGLE_THREAD_BELOW_TOKENS = 256
SINGLE_THREAD_BELOW_ATTENTION = 32_768  # sum over requests of new tokens x context length

# Beyond weights and KV cache: the interpreter, torch, activations of a step and the allocator's slack.
WORKING_MEMORY_BYTES = 512 * 2**20

# Prompt logprobs are scored this many prompt positions at a time (bounds the logits held at once).
PROMPT_LOGPROB_ROWS = 256

# The default KV pool (CPU): this many full contexts (several chats, or one chat and the server)...
KV_CONTEXTS = 4
# ...held to this share of the memory left once the weights and working memory are counted.
KV_SHARE_OF_FREE = 0.5

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelTooLargeError(ValueError):
    """The model would not fit in the memory this machine has free; the message gives the figures."""


def check_fits(weight_bytes: int, kv_bytes: int, mc: ModelConfig) -> None:
    """Refuse to load what cannot fit, with the figures, rather than be killed half-way by the kernel."""
    import psutil

    needed = weight_bytes + kv_bytes + WORKING_MEMORY_BYTES
    available = psutil.virtual_memory().available
    if needed > available:
        gib = 2**30
        raise ModelTooLargeError(
            f"this {mc.architecture} model needs about {needed / gib:.2f} GiB of memory (weights "
            f"{weight_bytes / gib:.2f} GiB + KV cache {kv_bytes / gib:.2f} GiB + {WORKING_MEMORY_BYTES / gib:.2f} "
            f"GiB working memory) but only {available / gib:.2f} GiB is available; close other programs, "
            f"lower the KV cache (kv_cache_memory_gib), or pick a smaller or more quantised model"
        )


def kv_bytes_per_block(config: ResolvedConfig, mc: ModelConfig) -> int:
    """Keys and values of every layer for one block of tokens, in the cache's dtype."""
    elem = _ELEMENT_BYTES[config.kv_cache_dtype]
    return 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim * elem


def cpu_kv_blocks(config: ResolvedConfig, per_block: int, weight_bytes: int) -> int:
    """The CPU pool's size: forced, the user's cap, or sized to the work.

    Sized to the work: KV_CONTEXTS contexts of max_model_len tokens, held to KV_SHARE_OF_FREE of
    the memory left beside the weights (a 128k-token model gets the context that fits, which
    EngineCore then takes as its max_model_len), and never below one block.
    """
    import psutil

    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gib is not None:
        return max(1, int(config.kv_cache_memory_gib * 2**30) // per_block)
    wanted = KV_CONTEXTS * -(-config.max_model_len // config.block_size)
    spare = psutil.virtual_memory().available - weight_bytes - WORKING_MEMORY_BYTES
    return max(1, min(wanted, int(spare * KV_SHARE_OF_FREE) // per_block))


def untouched_zeros(nbytes: int) -> mmap.mmap:
    """Zeroed memory committed only where it is first written.

    Anonymous mappings read as zero and take no memory until a page is written, so a KV pool sized
    for several long chats costs what the chats so far have filled, growing to its size with use
    (writing zeros would commit every page at start-up). Private, not mmap's default shared mapping:
    shared anonymous memory is shmem, whose first touches cost ~25% more (loading a 1B model's weights
    touches ~800 MB of it), and a forked child would share the pages instead of copying on write.
    """
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@dataclass
class StepResult:
    sampled_requests: list[Request]
    sampled: SamplerOutput
    forward_seconds: float
    # request id -> (first prompt position, logprobs of the prompt tokens from there), where asked
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class FlatBatch:
    """One step's inputs as host arrays: every request's new tokens, decodes first."""

    requests: list[Request]  # in flattened-batch order (decodes first)
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]: the KV cache slot each token's key and value go to
    query_start: np.ndarray  # int64 [R + 1]
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: np.ndarray  # int32 [R, max blocks]
    num_decodes: int
    sample_rows: list[int]  # requests (in this order) whose last row is sampled
    logits_row_list: list[int]  # each sampled request's last row, increasing
    # (request, its first row, the first prompt position scored, the prompt tokens scored)
    prompt_rows: list[tuple[Request, int, int, list[int]]] = field(default_factory=list)

    @property
    def logits_rows(self) -> np.ndarray:
        """The rows whose logits are sampled: each sampled request's last."""
        return np.array(self.logits_row_list, dtype=np.int64)

    def sampled_hidden(self, hidden: np.ndarray) -> np.ndarray:
        """hidden's logits rows: hidden itself where they are all its rows (a decode step's), else a view of one
        row or a copy of several (numpy's index arrays cost ~90 us a decode step cold, a view nothing)."""
        rows = self.logits_row_list
        if len(rows) == len(hidden):  # increasing and distinct: every row, in order
            return hidden
        if len(rows) == 1:
            return hidden[rows[0] : rows[0] + 1]
        picked: np.ndarray = hidden[self.logits_rows]
        return picked

    def attention_work(self) -> int:
        return sum(q * s for q, s in zip(self.query_lens, self.seq_lens))


def flatten_batch(batch: ScheduledBatch, block_ids: dict[str, list[int]], block_size: int) -> FlatBatch:
    """Flatten the batch: token ids, positions, cache slots and block tables.

    Built in Python lists, one array each at the end. Why not numpy throughout: at a decode step's sizes its
    calls cost more than their work, each 10-47 us with the caches cold after the weights have streamed through
    them (measured in the engine on a 1B model: 167 us a step in eight such calls, ~0.7% of the step)."""
    bs = block_size
    order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)  # decodes first, stable
    reqs = [batch.requests[i] for i in order]
    q_lens = [batch.num_new_tokens[i] for i in order]
    starts = [r.num_computed_tokens for r in reqs]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    tables = [block_ids[r.request_id] for r in reqs]
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    for r, s, q, table in zip(reqs, starts, q_lens, tables):
        tokens += r.all_token_ids[s : s + q]
        positions += range(s, s + q)
        slots += [table[p // bs] * bs + p % bs for p in range(s, s + q)]
        query_start.append(query_start[-1] + q)
    width = max(len(t) for t in tables)
    to_sample = {id(r) for r in batch.requests_to_sample()}
    sample_rows = [i for i, r in enumerate(reqs) if id(r) in to_sample]
    # Prompt logprobs: row p of a chunk predicts prompt token p + 1 while that is still the prompt.
    prompt_rows = []
    for i, (r, s, q) in enumerate(zip(reqs, starts, q_lens)):
        end = min(s + q, r.num_prompt_tokens - 1)
        if r.params.prompt_logprobs is not None and end > s:
            prompt_rows.append((r, query_start[i], s + 1, r.all_token_ids[s + 1 : end + 1]))
    return FlatBatch(
        requests=reqs,
        token_ids=np.array(tokens, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slots=np.array(slots, dtype=np.int64),
        query_start=np.array(query_start, dtype=np.int64),
        seq_lens=seq_lens,
        query_lens=q_lens,
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32),
        num_decodes=sum(1 for q in q_lens if q == 1),
        sample_rows=sample_rows,
        logits_row_list=[query_start[i + 1] - 1 for i in sample_rows],
        prompt_rows=prompt_rows,
    )


def cpu_threads_for(flat: FlatBatch, monitor: CpuLoadMonitor, threads: int) -> int:
    """Every thread, except for a small step while another process holds a core (see above)."""
    small = len(flat.token_ids) < SINGLE_THREAD_BELOW_TOKENS and flat.attention_work() < SINGLE_THREAD_BELOW_ATTENTION
    return 1 if small and not monitor.all_threads_fit() else threads
