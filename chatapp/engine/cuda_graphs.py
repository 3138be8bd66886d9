"""Decode steps replayed from CUDA graphs captured once per batch size.

Why: a decode step runs each layer's dozen small kernels on a handful of tokens. On a GPU they
finish faster than Python can launch them, so an eager decode step of a 1-8B model is mostly
launch overhead (the interpreter, the dispatcher, the driver), not arithmetic or memory traffic.
A CUDA graph records the launches of one forward once; replaying it costs one launch.

What is captured: embedding, every layer (Triton store-KV and paged attention included) and the
final norm of a decode-only step. The LM head and sampling stay outside: they are one matmul
and per-request logic that changes from step to step.

Shapes are fixed in a graph, so a graph is captured for each of a few batch sizes
(:data:`CAPTURE_SIZES` up to the engine's ``max_num_seqs``). A step of ``b`` requests replays the
smallest captured size ``n >= b``; rows ``b..n`` are padding: they store nothing (slot -1), attend
to one cached key (any finite value) and their outputs are dropped. Every tensor a graph reads
lives in :class:`GraphInputs`, filled before each replay from pinned host buffers.

Overlapped steps (core.py): a step may be filled while the one before it still runs, with some of
its token ids not yet known on the host. Those rows name the previous step's row instead, and the
fill takes the token from that step's device output; the host buffers alternate between two sets, so
filling a step never overwrites what the previous step's copies have still to read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from chatapp.engine.attention import AttentionMetadata

if TYPE_CHECKING:  # Triton is there only where a GPU build is: the CPU engine imports this module too
    from chatapp.engine.attention_triton import TritonAttentionBackend

log = logging.getLogger(__name__)

# Batch sizes captured (those up to max_num_seqs): every size to 8, whose steps are the most
# common (one to a few chats), then steps of 16, so padding wastes at most 15 rows.
CAPTURE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, *range(16, 513, 16))


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured for an engine running at most ``max_batch`` requests at once."""
    return [n for n in CAPTURE_SIZES if n <= max_batch] or [1]


Forward = Callable[[torch.Tensor, torch.Tensor, "TritonAttentionBackend"], torch.Tensor]


@dataclass(frozen=True)
class DecodeLayout:
    """A decode-only step as host arrays, in batch order: what a replay copies to the GPU."""

    token_ids: np.ndarray  # [b] int64
    positions: np.ndarray  # [b] int64
    slots: np.ndarray  # [b] int64
    seq_lens: np.ndarray  # [b] int32
    block_tables: np.ndarray  # [b, w] int32
    # [b] int64: the row of the previous step's sampled tokens that is this row's token id (whose
    # place token_ids only holds), or -1; None when every token id is known
    previous_rows: np.ndarray | None = None


class GraphInputs:
    """The fixed device tensors every captured graph reads, and their pinned host staging copy.

    One int64 and one int32 copy per step move everything: ids, positions, slots and previous rows
    side by side; seq lens and the block tables' used columns side by side. The host side is two
    sets of buffers used in turn (see the module's docstring).
    """

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        # ids, positions, slots (what the graphs read) and previous rows (what fill reads)
        self.longs = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.tile_req = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.tile_q0 = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.longs[2].fill_(-1)  # no slot: the warm-up and capture runs write nothing to the cache
        self._host_longs = [torch.zeros(4, max_batch, dtype=torch.long).pin_memory() for _ in range(2)]
        self._host_ints = [torch.zeros(max_batch * (max_blocks + 1), dtype=torch.int32).pin_memory() for _ in range(2)]
        self._turn = 0
        self._staged_ints = torch.zeros(max_batch * (max_blocks + 1), dtype=torch.int32, device=device)

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a ``size``-row step: views of the fixed tensors."""
        return AttentionMetadata(
            slot_mapping=self.longs[2, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,  # read by nothing on this path (Triton decodes read seq_lens)
            num_decodes=size,
            max_query_len=1,
            max_seq_len=1,
        )

    def fill(self, layout: DecodeLayout, size: int, previous_tokens: torch.Tensor | None = None) -> None:
        """Copy a step into rows ``0..b``; rows ``b..size`` become padding. Rows with a previous row
        take their token id from ``previous_tokens``, the previous step's sampled tokens on the device."""
        b, w = layout.block_tables.shape
        host_longs, host_ints = self._host_longs[self._turn], self._host_ints[self._turn]
        self._turn ^= 1
        longs = host_longs.numpy()
        longs[0, :b], longs[1, :b], longs[2, :b] = layout.token_ids, layout.positions, layout.slots
        longs[:2, b:size] = 0
        longs[2, b:size] = -1
        ints = host_ints.numpy()
        ints[:size] = 1  # padding rows see one key...
        ints[:b] = layout.seq_lens
        table = ints[size : size + size * w].reshape(size, w)
        table[:b] = layout.block_tables
        table[b:] = 0  # ...in block 0, whatever it holds (the pool starts zeroed; it is never NaN)
        taking = layout.previous_rows is not None and previous_tokens is not None
        if taking:
            longs[3, :b] = layout.previous_rows
        rows = 4 if taking else 3
        self.longs[:rows, :size].copy_(host_longs[:rows, :size], non_blocking=True)
        n = size + size * w
        self._staged_ints[:n].copy_(host_ints[:n], non_blocking=True)
        self.seq_lens[:size].copy_(self._staged_ints[:size])
        self.block_tables[:size, :w].copy_(self._staged_ints[size:n].view(size, w))
        if taking:
            assert previous_tokens is not None
            take_previous_tokens(self.longs[0, :b], self.longs[3, :b], previous_tokens)


def take_previous_tokens(token_ids: torch.Tensor, previous_rows: torch.Tensor, previous_tokens: torch.Tensor) -> None:
    """token_ids[i] = previous_tokens[previous_rows[i]] where that row is >= 0, on the device."""
    taken = previous_tokens[previous_rows.clamp(min=0)]
    token_ids.copy_(torch.where(previous_rows >= 0, taken, token_ids))


class DecodeGraphs:
    """Captured decode forwards, one per batch size, sharing one memory pool and one set of inputs."""

    def __init__(
        self,
        forward: Forward,
        attn: TritonAttentionBackend,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.inputs = GraphInputs(self.max_batch, max_blocks, device)
        self._attn = attn
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps served (tests check the graphs really ran)
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then reuse the pool's blocks instead of growing it.
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(forward, size)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (1..%d) in %.2f s", len(self.sizes), self.max_batch, seconds)

    def _capture(self, forward: Forward, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions = self.inputs.longs[0, :size], self.inputs.longs[1, :size]
        self._begin(size)
        forward(ids, positions, self._attn)  # warm-up: compiles kernels, creates library handles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._begin(size)
            out = forward(ids, positions, self._attn)
        return graph, out

    def _begin(self, size: int) -> None:
        inputs = self.inputs
        self._attn.begin_decode_step(inputs.metadata(size), inputs.tile_req[:size], inputs.tile_q0[:size])

    def fits(self, num_requests: int, num_blocks: int) -> bool:
        return num_requests <= self.max_batch and num_blocks <= self.inputs.max_blocks

    def run(self, layout: DecodeLayout, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [b, hidden] of a decode-only step (valid until the next replay)."""
        b = len(layout.token_ids)
        size = next(n for n in self.sizes if n >= b)
        self.inputs.fill(layout, size, previous_tokens)
        graph, out = self._graphs[size]
        graph.replay()
        self.replays += 1
        return out[:b]
