"""Which files hold a safetensors checkpoint's weights: the shards its index names, else every
``*.safetensors`` file in the directory.

Torch-free on purpose: the app's model listing (model_facts.py, store.py) and the engine's loader share
it, and the listing must not import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint's files do not match what its config describes, or are damaged."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files, which may not all exist yet (a download cut short); empty where there are none.
    CheckpointError for an index that is not one."""
    index = model_dir / INDEX_NAME
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        names = sorted({str(n) for n in json.loads(index.read_bytes())["weight_map"].values()})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
    return [model_dir / n for n in names]
