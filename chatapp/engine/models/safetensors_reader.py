"""Safetensors files read tensor by tensor with plain reads, straight into the tensor that keeps them.

Why not the safetensors library's ``safe_open``: it memory-maps the file, and a tensor it returns
is a view of that map. Copying it out held the file's pages and the copy at once (a 128k-row LM
head twice over, at the load's peak), and keeping the view tied the weights to a file that may be
rewritten while the engine serves. The format is small and fixed (an 8-byte little-endian header
length, a JSON header of name -> dtype, shape and byte range, then the data), so reading it with
``readinto`` is a few lines.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from chatapp.engine.models.checkpoint_files import CheckpointError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    name: str
    dtype: str  # the file's name for it: BF16, F16, F32, ...
    shape: tuple[int, ...]
    start: int  # byte range in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise CheckpointError(f"tensor {self.name} in {self.path.name} is {self.dtype}, not a float type") from None


def read_index(path: Path) -> dict[str, StoredTensor]:
    """The file's tensors by name (its header only)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            size = path.stat().st_size
            if len(raw) < 8:
                raise CheckpointError(f"{path.name} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path.name} is not a safetensors file (bad header length)")
            header = json.loads(f.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {path.name}: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            offsets, shape = info["data_offsets"], info["shape"]
            if not (_sizes(offsets) and len(offsets) == 2 and _sizes(shape)):
                raise ValueError("sizes that are not whole numbers")
            begin, end = offsets
            tensor = StoredTensor(path, name, str(info["dtype"]), tuple(shape), base + begin, base + end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: the header entry of {name} is malformed") from None
        if tensor.end > size or tensor.start > tensor.end:
            raise CheckpointError(f"{path.name} is truncated: tensor {name} lies past its end")
        tensors[name] = tensor
    return tensors


def _sizes(values: object) -> bool:
    """A JSON list of whole numbers of at least 0 (a header's shape or byte range)."""
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


def read_into(tensor: StoredTensor, dest: torch.Tensor) -> None:
    """Fill ``dest`` (contiguous, on the CPU, the stored dtype and size) with the tensor's bytes."""
    view = dest.view(torch.uint8).reshape(-1).numpy()
    if view.nbytes != tensor.end - tensor.start:
        raise CheckpointError(
            f"tensor {tensor.name} holds {tensor.end - tensor.start} bytes, expected {view.nbytes} for its shape"
        )
    with open(tensor.path, "rb") as f:
        f.seek(tensor.start)
        # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
        if f.readinto(memoryview(view)) != view.nbytes:  # type: ignore[arg-type]
            raise CheckpointError(f"{tensor.path.name} is truncated: tensor {tensor.name} is cut short")


def read_tensor(tensor: StoredTensor) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.torch_dtype)
    read_into(tensor, out)
    return out
