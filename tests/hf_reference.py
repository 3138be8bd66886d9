"""Hugging Face generate() as the reference our engine must match token for token."""

from __future__ import annotations

import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch


def bundled_hf_dir() -> Path:
    """The bundled GGUF as transformers loads it, saved once as a Hugging Face directory.

    This is the test reference only: transformers' own GGUF reading (de-quantise, undo the q/k
    permutation) in float32. Loading it from GGUF takes ~20 s, so the export is cached beside the
    other rebuildable files. The engine never reads it: it runs the GGUF file itself.
    """
    from chatapp import paths
    from chatapp.store import bundled_gguf_path

    gguf = bundled_gguf_path()
    dest = paths.cache_dir() / "test-reference" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (dest / "config.json").exists():
        return dest
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:
        if not (dest / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF generate(); stops at EOS like our engine does."""
    model = hf_model(str(path))
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()
