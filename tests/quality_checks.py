"""A shared check for the quantized engines: logits on one fixed chat, next to float32's."""

from __future__ import annotations

import torch

from benchmarks.quality import teacher_forced_logits
from chatapp.engine import LLM


def moon_landing_logits(reference: LLM, candidate: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Both engines' teacher-forced logits over a short user/assistant exchange."""
    prompt = reference.tokenizer.render_chat(
        [{"role": "user", "content": "Tell me about the moon landing."},
         {"role": "assistant", "content": "In 1969 Apollo 11 landed on the Moon."}],
        add_generation_prompt=False)
    return teacher_forced_logits(reference, prompt), teacher_forced_logits(candidate, prompt)
