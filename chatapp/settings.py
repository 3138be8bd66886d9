"""User settings: one TOML file, ``settings.toml`` under ``paths.config_dir()``.

Why it is built this way:

* :func:`load` returns the defaults when there is no file, and raises
  :class:`SettingsError` -- naming the file, line and field -- when the file is
  broken, so the app can show the message and run on :class:`Settings`
  defaults.
* :func:`save` never destroys the user's work: it writes a temporary file and
  swaps it in with ``os.replace`` (a crash leaves the old file or the new one,
  never half of each), and it refuses to replace a file that does not load
  (a user mid-edit) unless told to, keeping a ``.broken`` copy then.
* Keys this version does not know are kept and written back, so a newer
  chatapp's settings survive an older one. (Comments are not kept: the
  TOML writer cannot.)
* Values are checked strictly (``port = "80"`` is an error, not a guess).

Layout of the file (every key optional)::

    default_model = "SmolLM2-135M-Instruct"
    theme = "textual-dark"

    [engine]
    kv_cache_memory_gib = 4.0
    max_model_len = 8192

    [server]
    host = "127.0.0.1"
    port = 8000
    api_key = "secret"

    [[endpoints]]
    name = "openai"
    base_url = "https://api.openai.com/v1"
    api_key = "sk-..."

    [keys]
    new_session = "ctrl+g"
    quit = "ctrl+q,ctrl+c"   # alternatives are separated by commas; "" unbinds
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import tomllib
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any, Final

import tomli_w
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "DEFAULT_KEYS",
    "SETTINGS_FILENAME",
    "EngineSettings",
    "RemoteEndpoint",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "load",
    "load_or_default",
    "save",
    "settings_path",
]

SETTINGS_FILENAME: Final = "settings.toml"

DEFAULT_KEYS: Final[Mapping[str, str]] = {
    "quit": "ctrl+q",
    "new_session": "ctrl+t",
    "close_session": "f8",
    "next_session": "ctrl+pagedown",
    "previous_session": "ctrl+pageup",
    "stop": "escape",
    "regenerate": "alt+r",
    "edit_message": "alt+e",
    "previous_branch": "alt+left",
    "next_branch": "alt+right",
    "search": "f7",
    "export": "ctrl+s",
    "settings": "f2",
}
"""The remappable actions (action name -> key) and their default keys. The TUI owns these names.
None is a key the prompt box edits with (Ctrl+W, Ctrl+E, Ctrl+B, Ctrl+F, ... as in a shell)."""

FORMER_DEFAULT_KEYS: Final[Mapping[str, str]] = {
    "new_session": "ctrl+n",
    "close_session": "ctrl+w",
    "regenerate": "ctrl+r",
    "edit_message": "ctrl+e",
    "search": "ctrl+f",
}
"""Defaults before the prompt got the shell's editing keys. Saved settings hold every key, so a value
equal to its former default is read as today's default, not as the user's choice."""


class SettingsError(Exception):
    """The settings file cannot be read, parsed or saved; the message says where and why."""

    def __init__(
        self, message: str, *, path: Path | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field


# -- the model ----------------------------------------------------------------


class _Section(BaseModel):
    # strict: no silent conversions; extra="allow": unknown keys are kept and saved again;
    # validate_assignment: the TUI's changes are checked when made, not when saved.
    model_config = ConfigDict(strict=True, extra="allow", validate_assignment=True)


class RemoteEndpoint(_Section):
    """An OpenAI-compatible server a session can use instead of the local engine."""

    name: str = Field(min_length=1)
    base_url: str
    api_key: str | None = None

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"https?://[^\s/]+", value):
            raise ValueError("must be an http:// or https:// URL, like https://api.openai.com/v1")
        return value


class EngineSettings(_Section):
    kv_cache_memory_gib: float | None = Field(default=None, gt=0)
    """The most memory the local engine's KV cache may take, in GiB; unset: sized to the context
    (a few full contexts, held to half the memory left beside the weights)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length in tokens (prompt + answer); unset: the model's own, held to what memory allows."""
    memory_gib: float | None = Field(default=None, gt=0)
    """The memory all the engine's models together may take (weights, KV caches); a model that needs
    room unloads the least recently used idle one. Unset: the memory the machine has available."""
    max_loaded_models: int = Field(default=3, ge=1)
    """At most this many models loaded at once (panes and API clients may each use their own)."""
    keep_alive_s: float | None = Field(default=300.0, ge=0)
    """A model loaded on demand (not the default one) is unloaded after this many idle seconds;
    unset: kept until its room is needed."""

    def options(self, **overrides: Any) -> dict[str, Any]:
        """EngineConfig fields from these settings, with command-line values (not None) on top."""
        chosen = {
            "kv_cache_memory_gib": self.kv_cache_memory_gib,
            "max_model_len": self.max_model_len,
            "memory_gib": self.memory_gib,
            "max_loaded_models": self.max_loaded_models,
            "keep_alive_s": self.keep_alive_s,
        }
        chosen.update({k: v for k, v in overrides.items() if v is not None})
        return {k: v for k, v in chosen.items() if v is not None}


class ServerSettings(_Section):
    """The OpenAI-compatible API server (``chatapp serve``)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=0, le=65535)
    """0: any free port (the status bar and `chatapp serve` say which)."""
    api_key: str | None = None
    """If set, clients must send it as a bearer token."""


def _check_keys(keys: str) -> str:
    """A key string: Textual key names ('ctrl+n', 'f1', 'escape'), comma-separated; '' unbinds."""
    if keys == "":
        return keys
    for key in keys.split(","):
        if not key or any(ch.isspace() for ch in key) or key.startswith("+") or key.endswith("+"):
            raise ValueError(
                f"{keys!r} is not a key; use names like 'ctrl+n', 'f1' or 'escape', "
                "and separate alternatives with commas"
            )
    return keys


KeyString = Annotated[str, AfterValidator(_check_keys)]


class Settings(_Section):
    """Everything in settings.toml, with defaults for what the file leaves out."""

    default_model: str | None = None
    """A model name, directory or GGUF file; unset: the bundled model."""
    theme: str = Field(default="textual-dark", min_length=1)
    """A Textual theme name."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    endpoints: list[RemoteEndpoint] = Field(default_factory=list)
    keys: dict[str, KeyString] = Field(default_factory=lambda: dict(DEFAULT_KEYS))
    """Action name -> key string. Actions the file leaves out keep their default key."""

    @field_validator("endpoints")
    @classmethod
    def _unique_endpoint_names(cls, endpoints: list[RemoteEndpoint]) -> list[RemoteEndpoint]:
        seen: set[str] = set()
        for endpoint in endpoints:
            if endpoint.name in seen:
                raise ValueError(f"two endpoints are named {endpoint.name!r}; names must be unique")
            seen.add(endpoint.name)
        return endpoints

    @field_validator("keys")
    @classmethod
    def _no_key_twice(cls, keys: dict[str, str]) -> dict[str, str]:
        owner: dict[str, str] = {}
        for action, binding in keys.items():
            for key in filter(None, binding.split(",")):
                if key in owner:
                    raise ValueError(f"{key!r} is bound to both {owner[key]!r} and {action!r}")
                owner[key] = action
        return keys

    def endpoint(self, name: str) -> RemoteEndpoint | None:
        """The endpoint with this name (what a session's ``Backend.endpoint`` refers to)."""
        return next((e for e in self.endpoints if e.name == name), None)

    def unknown_actions(self) -> list[str]:
        """Actions in [keys] that this chatapp does not have (typos, or from a newer version)."""
        return sorted(set(self.keys) - set(DEFAULT_KEYS))

    def to_toml(self) -> str:
        """The settings as TOML text (unset values are left out: TOML has no null)."""
        data = self.model_dump(exclude_none=True)
        _validate(data, "", None)  # catches in-place changes (settings.keys[...] = ...) that skipped validation
        try:
            return tomli_w.dumps(data)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"cannot write these settings as TOML: {exc}") from None


# -- reading --------------------------------------------------------------------


def settings_path() -> Path:
    """Where the settings file lives."""
    from chatapp import paths

    return paths.config_dir() / SETTINGS_FILENAME


def load(path: Path | str | None = None) -> Settings:
    """Read the settings file; the defaults if there is none. Raises :class:`SettingsError`."""
    path = Path(path) if path is not None else settings_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read the settings file: {exc}", path=path) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = int(found.group(1)) if found else max(1, text.count("\n") + (not text.endswith("\n")))
        raise SettingsError(f"{path}, line {line}: this is not valid TOML: {exc}", path=path, line=line) from None
    return _validate(data, text, path)


def load_or_default(path: Path | str | None = None) -> tuple[Settings, SettingsError | None]:
    """Like :func:`load`, but a broken file gives the defaults plus the error to show.

    The broken file is left alone: :func:`save` will not overwrite it unless forced.
    """
    try:
        return load(path), None
    except SettingsError as exc:
        return Settings(), exc


def _validate(data: dict[str, Any], text: str, path: Path | None) -> Settings:
    """Build Settings from parsed TOML; errors name the file, line and field of every problem."""
    if isinstance(data.get("keys"), dict):
        kept = {k: v for k, v in data["keys"].items() if FORMER_DEFAULT_KEYS.get(k) != v}
        data = {**data, "keys": {**DEFAULT_KEYS, **kept}}
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems: list[tuple[int, str, str]] = []
        for error in exc.errors():
            loc = error["loc"]
            line = _find_line(text, loc)
            message = error["msg"].removeprefix("Value error, ")
            shown = error.get("input")
            if isinstance(shown, (str, int, float, bool)) and "api_key" not in loc and repr(shown) not in message:
                message += f" (found {shown!r})"
            where = "settings" if path is None else f"{path}, line {line}" if line else str(path)
            problems.append((line or 0, _dotted(loc), f"{where}: {_dotted(loc)}: {message}"))
        problems.sort(key=lambda p: (p[0] == 0, p[0]))  # by line; those without one last
        line, name, _ = problems[0]
        raise SettingsError("\n".join(p[2] for p in problems), path=path, line=line or None, field=name) from None


def _dotted(loc: tuple[int | str, ...]) -> str:
    """('endpoints', 0, 'base_url') -> 'endpoints[0].base_url'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "settings"


_TABLE_RE = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"""^\s*("[^"]*"|'[^']*'|[A-Za-z0-9_.\-\s"']+?)\s*=""")


def _find_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """Best effort: the line that sets the field at ``loc`` (or its table's header)."""
    table: tuple[int | str, ...] = ()
    arrays: dict[str, int] = {}
    header_line: int | None = None
    want_table = tuple(loc[:-1])
    for number, line in enumerate(text.splitlines(), start=1):
        header = _TABLE_RE.match(line)
        if header:
            name = header.group(2).strip().strip("\"'")
            if header.group(1) == "[[":
                arrays[name] = arrays.get(name, -1) + 1
                table = (name, arrays[name])
            else:
                table = tuple(part.strip().strip("\"'") for part in name.split("."))
            if table == want_table or table[: len(loc)] == tuple(loc):
                header_line = header_line or number
            continue
        key = _KEY_RE.match(line)
        if key:
            dotted = tuple(part.strip().strip("\"'") for part in key.group(1).split("."))
            if table + dotted == tuple(loc):
                return number
    return header_line


# -- writing -----------------------------------------------------------------------------


def save(settings: Settings, path: Path | str | None = None, *, force: bool = False) -> Path:
    """Write the settings atomically; returns the file written.

    An existing file that does not load (for example the user is editing it)
    is not replaced, unless ``force``: then it is first copied to
    ``settings.toml.broken``. The file is private (mode 0600): it may hold API keys.
    """
    path = Path(path) if path is not None else settings_path()
    if path.is_symlink():  # a dotfiles manager's link: write where it points
        path = path.resolve()
    text = settings.to_toml()
    if path.exists():
        try:
            load(path)
        except SettingsError as exc:
            if not force:
                raise SettingsError(
                    f"not saving over {path}: it has errors, and saving would lose your changes.\n{exc}\n"
                    "Fix the file, or save with force=True (the file is kept as "
                    f"{path.name}.broken).",
                    path=path,
                    line=exc.line,
                    field=exc.field,
                ) from None
            try:
                shutil.copy2(path, path.with_name(path.name + ".broken"))
            except OSError as copy_exc:
                raise SettingsError(f"cannot keep a copy of {path} before saving: {copy_exc}", path=path) from None
    _atomic_write(path, text)
    return path


def _atomic_write(path: Path, text: str) -> None:
    """Write a temporary file beside ``path``, flush it to disk, then swap it in."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as exc:
        raise SettingsError(f"could not save settings to {path}: {exc}", path=path) from None
    finally:
        if tmp is not None:
            with suppress(OSError):
                os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (a no-op where directories cannot be opened)."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
