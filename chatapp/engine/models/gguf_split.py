"""GGUF models split over several files: which files are the parts of one model.

Why: the Hub holds many models as parts of at most a few GB each, named as llama.cpp's
`gguf-split` names them (`NAME-00001-of-00003.gguf`).
The first part holds the metadata and some tensors, the others more tensors. Users name any
part, or the first, as llama.cpp takes them; everything that reads a model (the engine's
reader, the tokenizer build, the store, a pull) sees the whole set through this module.

Standard library only: the store and the Hub client use it without the engine's imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path, PurePath, PurePosixPath
from typing import TypeVar

PathT = TypeVar("PathT", bound=PurePath)

_PART_NAME = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")

SPLIT_COUNT_KEY = "split.count"
SPLIT_NUMBER_KEY = "split.no"  # 0 for the first part
SPLIT_TENSORS_KEY = "split.tensors.count"


def part_names(path: PathT) -> list[PathT] | None:
    """Every part of the split model that ``path`` names a part of, first part first; None when its
    name is not a part's (``NAME-00002-of-00003.gguf``)."""
    match = _PART_NAME.match(path.name)
    if match is None:
        return None
    number, count = int(match["number"]), int(match["count"])
    if not 1 <= number <= count:
        return None
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def first_part(path: PathT) -> PathT:
    """The file that holds a split model's metadata (the first part); ``path`` itself otherwise."""
    parts = part_names(path)
    return parts[0] if parts else path


def metadata_part(path: Path) -> Path:
    """The file to read a model named by ``path`` from: a split model's first part, when it is there
    (when it is not, the reader of ``path`` names the part that is missing); ``path`` otherwise."""
    first = first_part(path)
    return first if first.exists() else path


def gguf_models(names: Iterable[str]) -> list[str]:
    """The GGUF models among a repo's file names (posix, relative), sorted: each file, but a split model
    once, by its first part's name (even while only later parts are there)."""
    return sorted({first_part(PurePosixPath(name)).as_posix() for name in names if name.endswith(".gguf")})


def model_files(path: PathT) -> list[PathT]:
    """The files that hold the model ``path`` names: all its parts, or the file itself."""
    return part_names(path) or [path]


def files_size(path: Path) -> int:
    """Bytes on disk of the model ``path`` names: all its parts that are there, or the file itself."""
    return sum(part.stat().st_size for part in model_files(path) if part.is_file())
