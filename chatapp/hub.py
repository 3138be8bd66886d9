"""Talking to the Hugging Face Hub: pull a model into the shared HF cache, and search.

A pull is planned first (`plan_pull`): the repo's file list and config.json are
read from the Hub and a model the engine cannot run, or one that will not fit
in memory, is refused before a single weight byte is fetched. Then only what
the engine needs is downloaded (config, generation config, tokenizer and chat
template, safetensors weights; or one GGUF file) into the standard Hugging
Face cache, where other tools find it too.

Weights are downloaded so that an interrupted pull resumes: huggingface_hub
2.x retries a dropped connection within one call with a Range request, but it
deletes its partial file when the call fails (huggingface_hub PR #4228), so a
Ctrl-C or a long outage would restart a multi-GB file from zero. We keep the
partial file as ``blobs/<etag>.incomplete`` (the name the cache scanner
reports as an interrupted download) and continue it with huggingface_hub's own
``http_get(resume_size=...)``; then ``hf_hub_download`` links the finished blob
into the snapshot as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import urlsplit

from chatapp.engine.models.gguf_file import GGUF_ARCHITECTURES
from chatapp.engine.models.gguf_split import gguf_models, model_files
from chatapp.model_facts import (
    FLOAT32_BYTES_PER_PARAMETER,
    GGUF_BYTES_PER_PARAMETER_GUESS,
    WONT_FIT,
    MemoryEstimate,
    ModelFacts,
    cpu_bytes_per_file_byte,
    estimate_for,
    estimate_memory,
    facts_from_config,
    facts_from_gguf_summary,
    format_bytes,
)

log = logging.getLogger(__name__)

# Everything but the weights that the engine and its tokenizer read from a model directory.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
LOGIN_HINT = "log in with `hf auth login` (or set HF_TOKEN)"
# Keep this much disk free beyond the download itself.
DISK_MARGIN_BYTES = 100 << 20

T = TypeVar("T")


class HubError(Exception):
    """Anything that stops a pull or a search; the message is one line for the user."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None  # LFS files: the content hash, which is also their ETag and blob name


@dataclass(frozen=True)
class PullPlan:
    """What a pull will fetch and what we know about the model before fetching it."""

    repo_id: str
    revision: str  # what the user asked for ("main" by default)
    commit: str  # what it pointed to when planned
    files: tuple[RemoteFile, ...]
    gguf_file: str | None  # set for a REPO:FILE pull
    facts: ModelFacts | None
    estimate: MemoryEstimate | None  # None when the size cannot be known before downloading

    @property
    def name(self) -> str:
        """The name the store will list it under (and `--model` accepts)."""
        return f"{self.repo_id}:{self.gguf_file}" if self.gguf_file else self.repo_id

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass(frozen=True)
class HubModel:
    """One search result, as the TUI's Hub search shows it."""

    repo_id: str
    downloads: int | None
    likes: int | None
    format: str  # "safetensors", "gguf" or "unknown"
    architecture: str | None
    parameters: int | None
    gated: bool
    estimate: MemoryEstimate | None  # weights only: the listing does not give the KV size

    @property
    def label(self) -> str:
        """ "fits" / "will be slow" / "will not fit", or "size unknown"."""
        return self.estimate.label if self.estimate else "size unknown"


def parse_spec(spec: str) -> tuple[str, str | None]:
    """ "owner/name" or "owner/name:file.gguf" -> (repo_id, file or None)."""
    repo_id, sep, filename = spec.strip().partition(":")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or ".." in repo_id:
        raise HubError(f"{spec!r} is not a Hugging Face repo id; expected owner/name or owner/name:file.gguf")
    if sep and not filename.endswith(".gguf"):
        raise HubError(f"{spec!r}: only a .gguf file can be pulled on its own (owner/name:file.gguf)")
    return repo_id, filename or None


# --- errors -----------------------------------------------------------------------------------


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _require_online() -> None:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise HubError(
            "offline mode is on (HF_HUB_OFFLINE=1), so the Hub cannot be reached; models already "
            "downloaded still work: see `chatapp models list`"
        )


PROBE_TIMEOUT_S = 5.0
"""How long one try to reach the Hub may take before a search says it cannot."""


def _reach_once() -> None:
    """One short request to the Hub before a search: huggingface_hub's listing retries a refused or
    timed-out connection five times with back-off (about 25 s of "Retrying in 8s" for an offline
    user); a search screen should say "cannot reach" after one try instead."""
    import httpx2

    try:
        httpx2.get(f"{_endpoint()}/api/models", params={"limit": 1}, timeout=PROBE_TIMEOUT_S)
    except httpx2.TransportError as exc:
        message = explain(exc)
        assert message is not None  # a transport error always has its explanation
        raise HubError(message) from None


def explain(exc: BaseException, repo_id: str | None = None) -> str | None:
    """One line for the user about a huggingface_hub or network error; None if it is neither."""
    import httpx2
    from huggingface_hub import errors

    what = repo_id or "the repo"
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE=1); models already downloaded still work: see `chatapp models list`"
    if isinstance(exc, errors.GatedRepoError):
        return f"{what} is gated: ask for access on {_endpoint()}/{repo_id or ''}, then {LOGIN_HINT}"
    if isinstance(exc, errors.RepositoryNotFoundError):
        status = exc.response.status_code if exc.response is not None else None
        refused = f" (HTTP {status}: not found, or not readable without a login)" if status in (401, 403) else ""
        return f"{what} was not found on the Hub{refused}; if it is private or gated, {LOGIN_HINT}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"that revision of {what} does not exist on the Hub"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"a file of {what} is missing on the Hub ({exc.response.url})"
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return f"access to {what} was refused (HTTP {status}); {LOGIN_HINT} with a token that can read it"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"the Hub answered an error for {what}: {first}"
    if isinstance(exc, (httpx2.TransportError, errors.LocalEntryNotFoundError)):
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"cannot reach the Hugging Face Hub at {_endpoint()} ({detail}); check the network, "
            "or use a model already downloaded (`chatapp models list`)"
        )
    return None


def _hub_call(repo_id: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call huggingface_hub, turning its errors into a one-line HubError."""
    try:
        return fn(*args, **kwargs)
    except HubError:
        raise
    except Exception as e:
        message = explain(e, repo_id)
        if message is None:
            raise
        raise HubError(message) from e


# --- planning ---------------------------------------------------------------------------------


def plan_pull(
    spec: str, *, revision: str | None = None, token: str | bool | None = None, available_bytes: int | None = None
) -> PullPlan:
    """Read the repo's file list and config from the Hub; refuse what the engine cannot run.

    Raises HubError (unsupported architecture, no usable weights, not found,
    no access, offline) before any weight file is downloaded.
    """
    from huggingface_hub import HfApi

    _require_online()
    repo_id, gguf_file = parse_spec(spec)
    revision = revision or "main"
    info = _hub_call(repo_id, HfApi().model_info, repo_id, revision=revision, files_metadata=True, token=token)
    siblings = {s.rfilename: s for s in info.siblings or []}
    commit = info.sha or revision
    if gguf_file:
        return _plan_gguf(repo_id, revision, commit, gguf_file, siblings, info.gguf, available_bytes)
    if "config.json" not in siblings:
        ggufs = gguf_models(siblings)
        hint = (
            (
                f"; it has GGUF files, pull one with `chatapp models pull {repo_id}:{ggufs[0]}`"
                f"{f' (or one of {len(ggufs) - 1} others)' if len(ggufs) > 1 else ''}"
            )
            if ggufs
            else ""
        )
        raise HubError(f"{repo_id} has no config.json, so it is not a Hugging Face transformers model{hint}")
    config = _hub_call(repo_id, _fetch_json, repo_id, "config.json", commit, token)
    generation = (
        _hub_call(repo_id, _fetch_json, repo_id, "generation_config.json", commit, token)
        if "generation_config.json" in siblings
        else None
    )
    params = info.safetensors.total if info.safetensors else None
    facts = facts_from_config(config, generation, parameters=params)
    if not facts.supported:
        raise HubError(f"{repo_id} cannot run in chatapp: {facts.reason}")
    weights = _weight_files(repo_id, commit, siblings, token)
    files = [_remote_file(siblings[name]) for name in SMALL_FILES if name in siblings]
    files += [_remote_file(siblings[name]) for name in weights]
    estimate = estimate_for(facts, available_bytes=available_bytes)
    return PullPlan(repo_id, revision, commit, tuple(files), None, facts, estimate)


def _plan_gguf(
    repo_id: str,
    revision: str,
    commit: str,
    filename: str,
    siblings: dict[str, Any],
    gguf_info: dict[str, Any] | None,
    available_bytes: int | None,
) -> PullPlan:
    if filename not in siblings:
        ggufs = gguf_models(siblings)
        have = (
            f"; it has: {', '.join(ggufs[:8])}{' ...' if len(ggufs) > 8 else ''}"
            if ggufs
            else "; it has no .gguf files"
        )
        raise HubError(f"{repo_id} has no file {filename}{have}")
    names = [part.as_posix() for part in model_files(PurePosixPath(filename))]  # a split model: every part
    missing = [name for name in names if name not in siblings]
    if missing:
        raise HubError(
            f"{repo_id}:{filename} is one of the {len(names)} parts of a split model, and the repo lacks "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    files = tuple(_remote_file(siblings[name]) for name in names)
    filename = names[0]  # listed and run under its first part's name, which holds the metadata
    facts = None
    estimate = None
    if gguf_info:  # the Hub's summary of the repo's GGUF header: architecture, total parameters, context
        facts = facts_from_gguf_summary(gguf_info)
        if not facts.supported:
            raise HubError(f"{repo_id}:{filename} cannot run in chatapp: {facts.reason}")
        # The engine runs most types' own blocks (the download's size is what the weights take); others wider.
        known = all(f.size for f in files)
        weights = int(sum(f.size or 0 for f in files) * cpu_bytes_per_file_byte(filename))
        facts = replace(facts, weights_bytes=weights if known else None)
        estimate = estimate_for(facts, available_bytes=available_bytes)
    return PullPlan(repo_id, revision, commit, files, filename, facts, estimate)


def _remote_file(sibling: Any) -> RemoteFile:
    lfs = sibling.lfs
    size = lfs.size if lfs else sibling.size
    return RemoteFile(sibling.rfilename, size, lfs.sha256 if lfs else None)


def _weight_files(repo_id: str, commit: str, siblings: dict[str, Any], token: str | bool | None) -> list[str]:
    """The safetensors files to fetch: the index and the shards it names, else the root *.safetensors."""
    if SAFETENSORS_INDEX in siblings:
        index = _hub_call(repo_id, _fetch_json, repo_id, SAFETENSORS_INDEX, commit, token)
        shards = sorted(set(index.get("weight_map", {}).values()))
        missing = [s for s in shards if s not in siblings]
        if not shards or missing:
            raise HubError(
                f"{repo_id}: {SAFETENSORS_INDEX} names shards the repo does not have "
                f"({', '.join(missing[:3]) or 'none'})"
            )
        return [SAFETENSORS_INDEX, *shards]
    shards = sorted(name for name in siblings if name.endswith(".safetensors") and "/" not in name)
    if not shards:
        ggufs = gguf_models(siblings)
        hint = f"; pull a GGUF file instead, e.g. `chatapp models pull {repo_id}:{ggufs[0]}`" if ggufs else ""
        raise HubError(f"{repo_id} has no .safetensors weights (chatapp loads safetensors or GGUF only){hint}")
    return shards


def _fetch_json(repo_id: str, filename: str, revision: str, token: str | bool | None) -> Any:
    """Read a small JSON file from the Hub without putting it in the cache (a refused model leaves no trace)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    response = get_session().get(
        hf_hub_url(repo_id, filename, revision=revision),
        headers=build_hf_headers(token=token),
        follow_redirects=True,
        timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
    )
    hf_raise_for_status(response)
    try:
        return response.json()
    except ValueError as e:
        raise HubError(f"{repo_id}: {filename} on the Hub is not valid JSON ({e})") from e


# --- checks and download ----------------------------------------------------------------------


def check_plan(plan: PullPlan, *, force: bool = False) -> None:
    """Refuse a model that will not fit in memory (unless ``force``) or on the disk."""
    if plan.estimate and plan.estimate.label == WONT_FIT and not force:
        raise HubError(
            f"{plan.name} will not fit in memory here ({plan.estimate.describe()}); pass --force to download it anyway"
        )
    need = bytes_to_download(plan)
    cache = _hf_cache_dir()
    free = shutil.disk_usage(_existing_parent(cache)).free
    if need + DISK_MARGIN_BYTES > free:
        raise HubError(
            f"not enough disk space for {plan.name} in {cache}: {format_bytes(need)} to download, "
            f"{format_bytes(free)} free"
        )


def bytes_to_download(plan: PullPlan) -> int:
    """What is still missing from the cache for this plan (partial downloads count as done so far)."""
    from huggingface_hub import try_to_load_from_cache

    storage = _repo_storage(plan.repo_id)
    need = 0
    for f in plan.files:
        cached = try_to_load_from_cache(plan.repo_id, f.name, revision=plan.commit)
        if isinstance(cached, str) or not f.size:
            continue
        partial = storage / "blobs" / f"{f.sha256}.incomplete" if f.sha256 else None
        done = partial.stat().st_size if partial is not None and partial.exists() else 0
        need += max(f.size - done, 0)
    return need


def download_plan(
    plan: PullPlan, *, token: str | bool | None = None, progress: Callable[[int], None] | None = None
) -> Path:
    """Fetch the plan's files into the HF cache; returns the model directory (or the GGUF file).

    Files already in the cache are not fetched again; weight files resume
    where an earlier, interrupted pull stopped. ``progress`` is called with
    each number of bytes received (a progress bar's ``update``).
    """
    from huggingface_hub import hf_hub_download

    _require_online()
    bars = _forwarding_tqdm(progress) if progress else None
    local: dict[str, Path] = {}
    for f in plan.files:
        if f.sha256:  # LFS: the big files
            path = _hub_call(
                plan.repo_id, _download_resumable, plan.repo_id, f.name, plan.revision, token=token, tqdm_class=bars
            )
        else:
            path = _hub_call(
                plan.repo_id,
                hf_hub_download,
                plan.repo_id,
                f.name,
                revision=plan.revision,
                token=token,
                tqdm_class=bars,
            )
        local[f.name] = Path(path)
    return local[plan.gguf_file] if plan.gguf_file else local["config.json"].parent


def _forwarding_tqdm(progress: Callable[[int], None]) -> type:
    """A silent tqdm class for huggingface_hub's per-file bars that reports their bytes to ``progress``.

    One bar (or TUI widget) for the whole pull reads better than a bar per file.
    """
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Forwarding(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            progress(int(n or 0))
            return super().update(n)

    return _Forwarding


def pull(
    spec: str,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Plan, check and download in one call; returns the model directory (or GGUF file)."""
    plan = plan_pull(spec, revision=revision, token=token)
    check_plan(plan, force=force)
    return download_plan(plan, token=token, progress=progress)


def _hf_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_storage(repo_id: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return _hf_cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _download_resumable(
    repo_id: str, filename: str, revision: str, *, token: str | bool | None, tqdm_class: Any
) -> str:
    """Download one LFS file into the cache, continuing a partial ``<etag>.incomplete`` blob if present."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import WeakFileLock

    url = hf_hub_url(repo_id, filename, revision=revision)
    meta = get_hf_file_metadata(url, token=token)
    if not meta.etag or not re.fullmatch(r"[\w.-]+", meta.etag):
        raise HubError(f"{repo_id}: the Hub sent no usable ETag for {filename}")
    blob = _repo_storage(repo_id) / "blobs" / meta.etag
    if not blob.exists():
        lock = _hf_cache_dir() / ".locks" / repo_folder_name(repo_id=repo_id, repo_type="model") / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):  # the lock huggingface_hub takes for this blob, so the two never collide
            if not blob.exists():
                _fetch_blob(url, meta, blob, filename, token=token, tqdm_class=tqdm_class)
    # The blob is in place: huggingface_hub links it into the snapshot and records the ref.
    return hf_hub_download(repo_id, filename, revision=revision, token=token)


def _fetch_blob(url: str, meta: Any, blob: Path, filename: str, *, token: str | bool | None, tqdm_class: Any) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    partial = blob.with_name(blob.name + ".incomplete")
    if partial.exists() and meta.size is not None and partial.stat().st_size > meta.size:
        partial.unlink()  # not a prefix of this file: start over
    resumed = partial.exists() and partial.stat().st_size > 0
    # Send the token only to the Hub itself, never to the CDN it redirects weights to.
    same_origin = urlsplit(url)[:2] == urlsplit(meta.location)[:2]
    headers = build_hf_headers(token=token if same_origin else False)
    with open(partial, "ab") as f:
        if resumed:
            log.info("resuming %s at byte %d", filename, f.tell())
        http_get(
            meta.location,
            f,
            resume_size=f.tell(),
            headers=headers,
            expected_size=meta.size,
            displayed_filename=filename,
            tqdm_class=tqdm_class,
        )
    if resumed and re.fullmatch(r"[0-9a-f]{64}", meta.etag) and _sha256(partial) != meta.etag:
        partial.unlink()
        raise HubError(f"{filename} did not match its checksum after resuming, so the partial download was deleted")
    os.replace(partial, blob)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# --- search -----------------------------------------------------------------------------------


def search_models(
    query: str = "", *, limit: int = 20, token: str | bool | None = None, available_bytes: int | None = None
) -> list[HubModel]:
    """Text-generation models on the Hub, most downloaded first, without those we know we cannot run.

    A result is left out when the listing names an architecture the engine
    does not run; when it does not say, the result is kept (a pull checks).
    """
    from huggingface_hub import HfApi

    _require_online()
    _reach_once()
    listing = HfApi().list_models(
        search=query or None,
        pipeline_tag="text-generation",
        sort="downloads",
        limit=limit * 3,
        expand=["downloads", "likes", "config", "safetensors", "gguf", "gated", "tags"],
        token=token,
    )
    results: list[HubModel] = []

    def collect() -> None:
        for item in listing:
            model = _search_result(item, available_bytes)
            if model is not None:
                results.append(model)
                if len(results) >= limit:
                    return

    _hub_call(None, collect)
    return results


def _search_result(item: Any, available_bytes: int | None) -> HubModel | None:
    from chatapp.engine.models.config import SUPPORTED_ARCHITECTURES

    archs = (item.config or {}).get("architectures") or []
    gguf = item.gguf or {}
    if item.safetensors:
        fmt, params, arch = "safetensors", item.safetensors.total, archs[0] if archs else None
        if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
            return None
    elif gguf or "gguf" in (item.tags or []):
        fmt, params = "gguf", gguf.get("total")
        family = gguf.get("architecture")
        if family is not None and family not in GGUF_ARCHITECTURES:
            return None
        arch = GGUF_ARCHITECTURES.get(family or "", family)
    else:
        fmt, params, arch = "unknown", None, archs[0] if archs else None
        if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
            return None
    per_parameter = GGUF_BYTES_PER_PARAMETER_GUESS if fmt == "gguf" else FLOAT32_BYTES_PER_PARAMETER
    estimate = estimate_memory(int(params * per_parameter), available_bytes=available_bytes) if params else None
    return HubModel(item.id, item.downloads, item.likes, fmt, arch, params, bool(item.gated), estimate)
