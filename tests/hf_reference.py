"""Hugging Face generate() as the reference our engine must match token for token."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF generate(); stops at EOS like our engine does."""
    model = hf_model(str(path))
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()
