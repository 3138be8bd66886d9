"""A scheduled batch flattened into the arrays both runners hand their model (step_inputs.flatten_batch)."""

from __future__ import annotations

import numpy as np

from chatapp.engine.request import Request
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.scheduler import ScheduledBatch
from chatapp.engine.step_inputs import flatten_batch

BS = 4


def request(rid: str, prompt: list[int], computed: int, outputs: list[int] = (), **params: object) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=100, **params), frozenset(), BS, 1000)
    req.all_token_ids += outputs
    req.num_computed_tokens = computed
    return req


def test_a_mixed_batch_flattens_decodes_first_with_each_tokens_slot() -> None:
    prefill = request("prefill", list(range(100, 110)), computed=4, prompt_logprobs=2)  # its last 6: sampled
    decode = request("decode", list(range(20, 25)), computed=6, outputs=[7, 8])  # token 8 at position 6
    chunk = request("chunk", list(range(50, 62)), computed=0)  # 5 of 12: stops short, samples nothing
    batch = ScheduledBatch([prefill, decode, chunk], [6, 1, 5])
    blocks = {"prefill": [5, 6, 11], "decode": [9, 3], "chunk": [2, 8]}

    flat = flatten_batch(batch, blocks, BS)

    assert flat.requests == [decode, prefill, chunk]
    assert flat.token_ids.dtype == np.int64 and flat.token_ids.tolist() == [8, *range(104, 110), *range(50, 55)]
    assert flat.positions.dtype == np.int64 and flat.positions.tolist() == [6, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    # slot = block id x block size + position within the block
    assert flat.slots.dtype == np.int64 and flat.slots.tolist() == [14, 24, 25, 26, 27, 44, 45, 8, 9, 10, 11, 32]
    assert flat.query_start.dtype == np.int64 and flat.query_start.tolist() == [0, 1, 7, 12]
    assert flat.seq_lens == [7, 10, 5] and flat.query_lens == [1, 6, 5]
    assert flat.block_tables.dtype == np.int32 and flat.block_tables.tolist() == [[9, 3, 0], [5, 6, 11], [2, 8, 0]]
    assert flat.num_decodes == 1
    assert flat.sample_rows == [0, 1] and flat.logits_rows.tolist() == [0, 6]
    assert flat.prompt_rows == [(prefill, 1, 5, list(range(105, 110)))]

    hidden = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    assert np.array_equal(flat.sampled_hidden(hidden), hidden[[0, 6]])


def test_sampled_rows_are_the_hidden_states_themselves_or_a_view_where_they_can_be() -> None:
    a = request("a", [1, 2, 3], computed=3, outputs=[4])
    b = request("b", [5, 6], computed=2, outputs=[7])
    decodes = flatten_batch(ScheduledBatch([a, b], [1, 1]), {"a": [0], "b": [1]}, BS)
    hidden = np.ones((2, 3), dtype=np.float32)
    assert decodes.sampled_hidden(hidden) is hidden  # every row, in order: nothing to copy

    prompt = request("p", [1, 2, 3, 4, 5], computed=0)
    one = flatten_batch(ScheduledBatch([prompt], [5]), {"p": [3, 4]}, BS)
    hidden = np.arange(15, dtype=np.float32).reshape(5, 3)
    last = one.sampled_hidden(hidden)
    assert last.tolist() == [[12.0, 13.0, 14.0]] and np.shares_memory(last, hidden)
