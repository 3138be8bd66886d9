"""Where a model's weights come from: a Hugging Face directory (safetensors) or one GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatapp.engine.model_ref import is_gguf_path
from chatapp.engine.models.config import ModelConfig, load_model_config
from chatapp.engine.models.gguf_file import GGUFModelFile


@dataclass(frozen=True)
class ModelSource:
    path: Path
    config: ModelConfig
    gguf: GGUFModelFile | None  # set for a GGUF file, opened once and shared by config and loader

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None


def open_model(path: Path | str) -> ModelSource:
    """Read a model's config (a GGUF file's header, or config.json) without loading weights."""
    path = Path(path)
    if is_gguf_path(path):
        gguf = GGUFModelFile(path)
        return ModelSource(path, gguf.model_config(), gguf)
    return ModelSource(path, load_model_config(path), None)
