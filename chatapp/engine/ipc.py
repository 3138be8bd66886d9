"""The wire protocol between the engine process and its clients, and how clients find the engine.

Transport: one ZeroMQ ROUTER socket in the engine, one DEALER socket per client,
bound on an ``ipc://`` path inside the private runtime directory. Every message
is a single msgpack frame holding one tagged msgspec struct (below), so both
sides decode into known types only: no pickle, nothing executable on the wire.

Discovery: the engine writes ``engine.json`` (pid, start time, model, socket)
next to its socket. A client takes ``engine.lock`` (flock) while it reads that
file and says hello, and the engine takes the same lock before it removes the
file to shut down, so a client never attaches to an engine that is leaving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import psutil

from chatapp.engine.api import ErrorKind, ModelInfo
from chatapp.engine.config import EngineConfig
from chatapp.engine.outputs import EngineCoreOutput
from chatapp.engine.sampling_params import SamplingParams

DISCOVERY_FILE = "engine.json"
LOCK_FILE = "engine.lock"
LOG_FILE = "engine.log"

HEARTBEAT_INTERVAL_S = 1.0
"""How often a client tells the engine it is still there."""
CLIENT_TIMEOUT_S = 5.0
"""A client silent this long is gone: its requests are aborted and its blocks freed."""

_MAX_IPC_PATH = 100  # Linux sun_path is 108 bytes including "ipc://" handling slack


# -- client -> engine ---------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    """First message of a client; the engine answers with Welcome."""

    pid: int
    model: str | None  # the normalised model spec the client asked for (informational)


class Heartbeat(msgspec.Struct, tag=True):
    pass


class Bye(msgspec.Struct, tag=True):
    """The client detaches; its requests are aborted. The engine answers with ByeAck."""


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' init fields (see params_to_wire)
    model: str | None = None  # a normalised model spec; None: the engine's default model


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class StatsCall(msgspec.Struct, tag=True):
    call_id: int


class EmbedCall(msgspec.Struct, tag=True):
    call_id: int
    prompts: list[list[int]]
    model: str | None = None


class LoadModelCall(msgspec.Struct, tag=True):
    """Load a model beside the others (if it is not loaded); the Reply, a ModelInfo, comes once it is ready."""

    call_id: int
    model: str  # normalised spec


class ModelsCall(msgspec.Struct, tag=True):
    """The models the engine holds or is loading; the Reply is a list of api.ModelStatus."""

    call_id: int


class SwitchModelCall(msgspec.Struct, tag=True):
    call_id: int
    model: str | None


ClientMessage = (
    Hello
    | Heartbeat
    | Bye
    | AddRequest
    | AbortRequests
    | StatsCall
    | EmbedCall
    | SwitchModelCall
    | LoadModelCall
    | ModelsCall
)


# -- engine -> client ---------------------------------------------------------


class Welcome(msgspec.Struct, tag=True):
    engine_pid: int
    state: str  # "loading", "ready" or "failed" (then the engine exits)
    detail: str
    info: ModelInfo | None
    error_kind: ErrorKind | None = None  # as in StateUpdate


class StateUpdate(msgspec.Struct, tag=True):
    """Broadcast to every client: loading progress, ready (with the model), or failed (then the engine exits)."""

    state: str  # "loading", "ready" or "failed"
    detail: str
    info: ModelInfo | None = None
    error_kind: ErrorKind | None = None  # for "failed": INVALID (a bad model spec) or INTERNAL


class ModelState(msgspec.Struct, tag=True):
    """Broadcast to every client when a model beside the default one changes state.

    state: "queued" (waiting for room), "loading", "ready" (with info), "failed" (detail says why;
    only the requests for this model fail) or "unloaded"."""

    model: str  # normalised spec
    state: str
    detail: str
    info: ModelInfo | None = None


class Outputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]


class Reply(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None
    error_kind: ErrorKind | None = None


class ByeAck(msgspec.Struct, tag=True):
    remaining_clients: int


class ShuttingDown(msgspec.Struct, tag=True):
    """The engine is exiting (signal or fatal error); clients go to "dead" without waiting for the pid."""

    reason: str


EngineMessage = Welcome | StateUpdate | ModelState | Outputs | Reply | ByeAck | ShuttingDown


def client_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder[EngineMessage]]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineMessage)


def engine_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder[ClientMessage]]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClientMessage)


# -- sampling params on the wire ----------------------------------------------


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The constructor arguments only: the engine rebuilds (and so re-validates) the params."""
    wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    if params.guided is not None:
        assert not isinstance(params.guided, dict)  # SamplingParams.__post_init__ made it a GuidedDecoding
        wire["guided"] = params.guided.to_wire()
    return wire


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """Raises ValueError/TypeError for fields a well-behaved client would never send."""
    bias = data.get("logit_bias")
    if isinstance(bias, dict):
        data = {**data, "logit_bias": {int(k): v for k, v in bias.items()}}
    return SamplingParams(**data)


# -- engine config on the command line ------------------------------------------


def config_to_json(config: EngineConfig) -> str:
    data = dataclasses.asdict(config)
    data.pop("resolved", None)
    return json.dumps(data)


def config_from_json(text: str) -> EngineConfig:
    data = json.loads(text)
    if "preload" in data:
        data["preload"] = tuple(data["preload"])
    return EngineConfig.from_overrides(**data)


# -- model specs ---------------------------------------------------------------


def normalize_model_spec(spec: str | None) -> str:
    """One spelling per model so two clients can tell whether they asked for the same one."""
    from chatapp.engine.model_ref import default_model_name

    if spec is None or spec in ("default", default_model_name()):
        return default_model_name()
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve())
    return spec


# -- discovery -------------------------------------------------------------------


@dataclasses.dataclass
class EngineRecord:
    """What engine.json says about the running engine."""

    pid: int
    create_time: float  # psutil's process start time: guards against a reused pid
    socket: str  # the zmq endpoint, "ipc://..."
    model: str  # normalised spec of the model it serves (or is loading)
    log_path: str

    def process(self) -> psutil.Process | None:
        """The engine process if it is still this engine and not a zombie."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.01:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None


def socket_endpoint(runtime: Path, pid: int) -> str:
    path = runtime / f"engine-{pid}.sock"
    endpoint = f"ipc://{path}"
    if len(str(path)) > _MAX_IPC_PATH:
        raise RuntimeError(
            f"the runtime directory path is too long for a Unix socket ({path}); "
            "set CHATAPP_RUNTIME_DIR to a shorter directory"
        )
    return endpoint


def read_record(runtime: Path) -> EngineRecord | None:
    """The discovery record, or None when there is none or it is unreadable."""
    try:
        data = json.loads((runtime / DISCOVERY_FILE).read_text())
        return EngineRecord(**{f.name: data[f.name] for f in dataclasses.fields(EngineRecord)})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(runtime: Path, record: EngineRecord) -> None:
    """Atomically (rename), 0600, so a reader never sees half a file."""
    tmp = runtime / f".{DISCOVERY_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(record), f)
    os.replace(tmp, runtime / DISCOVERY_FILE)


def remove_record(runtime: Path, record: EngineRecord) -> None:
    """Remove a (stale or own) record and its socket file, unless a newer engine replaced the record."""
    current = read_record(runtime)
    if current is not None and (current.pid, current.create_time) == (record.pid, record.create_time):
        with contextlib.suppress(OSError):
            (runtime / DISCOVERY_FILE).unlink()
    with contextlib.suppress(OSError):
        Path(record.socket.removeprefix("ipc://")).unlink()


class DiscoveryLock:
    """An exclusive flock on engine.lock; released automatically if the holder dies."""

    def __init__(self, runtime: Path) -> None:
        self._path = runtime / LOCK_FILE
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
