"""Overlapped decode steps on the GPU, where they are on by default: CUDA-graph replays whose token ids
come from the previous step's device output, pinned read-backs and staging buffers used in turn.

The same workload as tests/test_overlapped_steps.py (joins, a stop read one step late, logprobs,
an abort, preemption, prefix hits), in float32 with CUDA graphs: overlapped and step-by-step runs
must give the same tokens.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_overlapped_steps import check_overlapped_against_plain, make_core


def test_overlapped_graph_steps_give_the_tokens_of_steps_in_turn(tiny_llama: Path) -> None:
    core = check_overlapped_against_plain(tiny_llama, device="cuda", dtype="float32")
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.replays > 20  # the overlapped steps replayed graphs


def test_overlap_is_on_by_default_on_a_gpu(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, overlap=None, device="cuda")  # type: ignore[arg-type]
    assert core.config.overlap_steps is True
