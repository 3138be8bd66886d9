"""Which model the engine runs: a name to show and a resolved path (a GGUF file or a model directory).

Why a registry: the engine is a leaf package. It never imports the app's model store (names,
the bundled model, the Hugging Face cache); the app registers the store's resolver when the
`chatapp` package loads (chatapp/__init__.py), and without it the engine takes paths only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatapp.engine.models.gguf_split import metadata_part


@dataclass(frozen=True)
class ModelRef:
    name: str  # what to show the user and report as the model id
    path: Path  # a .gguf file, or a directory with config.json and safetensors weights
    source: str = "path"  # where the resolver found it (the store says "bundled", "hf-cache", ...)


Resolver = Callable[[str | None], ModelRef]
_resolver: Resolver | None = None
_default_name = "default"


def register_resolver(resolver: Resolver, default_name: str) -> None:
    """Let the engine turn model names into paths (the app's model store does); ``default_name`` is
    the name of the model that ``None`` resolves to."""
    global _resolver, _default_name
    _resolver, _default_name = resolver, default_name


def default_model_name() -> str:
    return _default_name


def is_gguf_path(path: Path | str) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and not path.is_dir()


def resolve_path(spec: str | None) -> ModelRef:
    """A model given by its path alone (the engine's own resolver)."""
    if spec is None:
        raise ValueError("no model given, and no model store is registered to pick the default one")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        path = metadata_part(path)  # a split model by any of its parts: the first holds the metadata
        return ModelRef(path.stem, path.absolute())
    if path.is_dir():
        return ModelRef(path.name, path.absolute())
    raise ValueError(f"{spec} is neither a model directory nor a .gguf file")


def resolve_model_spec(spec: str | None) -> ModelRef:
    return (_resolver or resolve_path)(spec)
