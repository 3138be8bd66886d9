"""AsyncEngineClient: the asyncio side of the shared background engine (implements api.EngineClient).

Usage::

    client = await AsyncEngineClient.connect(EngineConfig(model=...))   # attach, or spawn and wait
    async for delta in client.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")
    await client.close()

To show start-up progress, build the client first, subscribe, then start::

    client = AsyncEngineClient(config)
    client.add_state_listener(lambda state, detail: ...)   # or: async for state, detail in client.state_changes()
    await client.start()

States: "starting" (finding or spawning the engine), "loading" (the engine loads
a model; ``state_detail`` has its progress line), "ready", "dead" (the engine
process died: every stream and call raised EngineDeadError; ``restart()``
recovers) and "closed".

Tokenization and detokenization happen here, not in the engine: each client
holds the model's Tokenizer and an OutputProcessor, so the engine loop only
moves token ids, and stop strings are found here (then aborted in the engine).

Why not multiprocessing: the engine is shared and must outlive the client that
started it, but multiprocessing's exit handler joins (or, for daemons, kills)
its children when the parent exits. The engine is started instead with
``subprocess.Popen([sys.executable, "-m", "chatapp.engine.launch", ...])``:
a fresh interpreter like the ``spawn`` method, in its own session (a Ctrl-C in
the terminal does not reach it), which no exit handler owns. It exits by
itself when its last client leaves.

Engine death is detected by watching its pid (the spawning client also reaps
it, since a dead child stays a zombie until reaped), not by heartbeats: a CPU
forward step can be slower than any sensible heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import psutil
import zmq
import zmq.asyncio

from chatapp import paths
from chatapp.engine import ipc, prestart
from chatapp.engine.api import (
    EngineBusyError,
    EngineDeadError,
    EngineError,
    EngineState,
    EngineStats,
    ErrorKind,
    InvalidRequestError,
    ModelInfo,
    ModelStatus,
    context_length_error,
)
from chatapp.engine.config import EngineConfig
from chatapp.engine.model_view import ModelView
from chatapp.engine.output_processor import OutputDelta, OutputProcessor
from chatapp.engine.outputs import FinishReason
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import ChatFormatError, Tokenizer

log = logging.getLogger(__name__)

State = EngineState  # the client lifecycle (api.py)
StateListener = Callable[[str, str], None]

HELLO_TIMEOUT_S = 15.0
"""A live engine answers a hello within milliseconds (it loads models on a helper thread)."""
WATCH_INTERVAL_S = 0.1
"""How often the engine's pid is checked: bounds how late a death is noticed."""
DEATH_GRACE_S = 0.25
"""After the pid is gone, how long the engine's last messages may still be read before "dead"."""
BYE_TIMEOUT_S = 2.0
ENGINE_EXIT_WAIT_S = 10.0


class EngineModelMismatchError(EngineError):
    """A running engine serves another model and the client asked to refuse rather than attach."""


@dataclass
class _ModelHandle:
    """What this client needs to run requests on one model: its facts, tokenizer and detokenizer."""

    info: ModelInfo
    tokenizer: Tokenizer
    processor: OutputProcessor


@dataclass
class _Stream:
    """One generate() call's inbox: deltas, or the exception that ends it."""

    processor: OutputProcessor
    queue: asyncio.Queue[OutputDelta | BaseException] = field(default_factory=asyncio.Queue)


ModelListener = Callable[[str, str, str], None]
"""Called with (model spec, state, detail) when a model beside the default one changes state."""


class AsyncEngineClient:
    """One connection to the shared engine; safe to share between the TUI and the HTTP server in one loop."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        runtime_dir: Path | str | None = None,
        on_model_mismatch: Literal["attach", "error"] = "attach",
    ) -> None:
        """No I/O here: subscribe to state changes, then ``await start()``.

        ``config`` is used to spawn an engine; attaching to a running one uses
        that engine's settings. When the running engine serves another model,
        "attach" uses it anyway (``model_mismatch`` says so) and "error" raises
        EngineModelMismatchError.
        """
        if on_model_mismatch not in ("attach", "error"):
            raise ValueError(f"on_model_mismatch must be 'attach' or 'error', got {on_model_mismatch!r}")
        self.config = config or EngineConfig()
        self.on_model_mismatch = on_model_mismatch
        self._runtime_arg = Path(runtime_dir) if runtime_dir is not None else None
        self.state: State = EngineState.STARTING
        self.state_detail = ""
        self._model_info: ModelInfo | None = None  # set once ready (and again after a model switch)
        self._tokenizer: Tokenizer | None = None  # the model's tokenizer, loaded here from model_info.path
        # The tokenizer of the model this client asked for, loading while the engine loads the weights.
        self._tokenizer_preload: tuple[str, asyncio.Task[Tokenizer]] | None = None
        self.engine_pid: int | None = None
        self.spawned_engine = False  # whether this client started the engine it is attached to
        self.model_mismatch: str | None = None  # set when attached to an engine serving another model
        self.log_path: Path | None = None
        self._listeners: list[StateListener] = []
        self._watchers: set[asyncio.Queue[tuple[str, str]]] = set()
        self._changed = asyncio.Event()
        self._death: EngineError | InvalidRequestError | None = None  # what streams and calls raise now
        self._processor: OutputProcessor | None = None
        self._handles: dict[str, _ModelHandle] = {}  # models beside the default one, by normalised spec
        self._model_listeners: list[ModelListener] = []
        self.model_states: dict[str, tuple[str, str]] = {}
        """(state, detail) of each model beside the default one, as the engine last broadcast it."""
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._detaching = False
        """Set from the moment a detach begins until the next hello: no call or stream may start then, since
        nothing would be left to answer it (the receiver is stopped, the socket closed)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._popen: subprocess.Popen[bytes] | None = None
        self._engine_proc: psutil.Process | None = None
        self._welcome: asyncio.Future[ipc.Welcome] | None = None
        self._bye: asyncio.Future[ipc.ByeAck] | None = None
        self._starting: asyncio.Future[None] | None = None  # the start or restart under way, if any
        self._encoder, self._decoder = ipc.client_codec()

    # -- start, restart, close ---------------------------------------------------

    @classmethod
    async def connect(cls, config: EngineConfig | None = None, **kwargs: Any) -> AsyncEngineClient:
        """Attach to the running engine (or spawn one) and return once it is ready."""
        client = cls(config, **kwargs)
        await client.start()
        return client

    async def start(self) -> None:
        """Attach or spawn, then wait until the model is loaded.

        Raises EngineDeadError when the engine cannot be started or dies while
        loading, InvalidRequestError(param="model") for a model that cannot be
        loaded, EngineModelMismatchError (see __init__). A call made while a
        start or restart is already under way waits for that one.
        """
        if self.state == EngineState.READY:
            return
        await self._only_once(self._start)

    async def restart(self) -> None:
        """Recover after a death (or reconnect): detach if attached, then attach to or spawn an engine.

        Several parts of a program may notice a death and restart at once (the
        TUI's restart key and its API server): a restart asked for while one is
        under way joins it instead of tearing down what it is building.
        """
        await self._only_once(self._restart)

    async def _only_once(self, work: Callable[[], Any]) -> None:
        """Run ``work`` (a start or restart) unless one runs already; either way, wait for it to end.

        The caller that began it owns it (cancelling that caller cancels the
        start, which then detaches cleanly); callers that joined only wait.
        """
        task = self._starting
        joined = task is not None and not task.done()
        if not joined:
            task = self._starting = asyncio.ensure_future(work())
        assert task is not None
        try:
            if joined:
                await asyncio.wait({task})
                task.result()
            else:
                await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # this caller was cancelled (its own start, if it began it, detached cleanly)
            raise EngineDeadError("the engine client was closed while starting") from None

    async def _start(self) -> None:
        if self.state == EngineState.READY:
            return
        self._death = None
        self._set_state(EngineState.STARTING, "looking for a running engine")
        self._start_tokenizer_preload()
        try:
            for attempt in range(2):
                try:
                    await self._attach()
                    break
                except _EngineLeft:
                    # It exited between our reading its record and its answer; the next try spawns anew.
                    await self._teardown()
                    self._set_state(EngineState.STARTING, "the engine left; trying again")
                    if attempt == 1:
                        raise EngineDeadError("the engine exited while this client was attaching; retry") from None
            while self.state not in (EngineState.READY, EngineState.DEAD, EngineState.CLOSED):
                await self._wait_state_change()
        except BaseException as exc:  # incl. cancellation: never stay half-attached
            await self._detach()
            if self.state not in (EngineState.DEAD, EngineState.CLOSED):
                self._death = exc if isinstance(exc, EngineError) else EngineDeadError(f"start failed: {exc}")
                self._set_state(EngineState.DEAD, str(exc))
            raise
        state: State = self.state  # widened: mypy keeps the narrowing from before the awaits that changed it
        if state != EngineState.READY:
            raise self._death or EngineDeadError("the engine client was closed while starting")

    async def _restart(self) -> None:
        await self._detach()
        self._set_state(EngineState.STARTING, "restarting")
        await self._start()

    async def close(self) -> None:
        """Detach; the engine exits by itself when no client is left (waited for if this client spawned it)."""
        if self.state == EngineState.CLOSED:
            return
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()  # a start under way detaches what it had built when cancelled
            await asyncio.wait({self._starting})
        await self._detach()
        await asyncio.to_thread(self._save_tokenizer_files)
        self._set_state(EngineState.CLOSED, "")

    def _save_tokenizer_files(self) -> None:
        """The tokenizers this client built in memory, written to the cache for the next start: as it closes,
        not as it starts (Tokenizer.save_files says why)."""
        held = [self._tokenizer, *(handle.tokenizer for handle in self._handles.values())]
        for tokenizer in {id(t): t for t in held if t is not None}.values():
            tokenizer.save_files()

    async def __aenter__(self) -> AsyncEngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- state ------------------------------------------------------------------------

    def add_state_listener(self, listener: StateListener) -> Callable[[], None]:
        """Call ``listener(state, detail)`` on every change (in the event loop); returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def state_changes(self) -> AsyncIterator[tuple[str, str]]:
        """Yield (state, detail) now and on every change; ends after "closed"."""
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        queue.put_nowait((self.state, self.state_detail))
        self._watchers.add(queue)
        try:
            while True:
                state, detail = await queue.get()
                yield state, detail
                if state == "closed":
                    return
        finally:
            self._watchers.discard(queue)

    def _set_state(self, state: State, detail: str) -> None:
        if (state, detail) == (self.state, self.state_detail):
            return
        self.state, self.state_detail = state, detail
        self._changed.set()
        self._changed = asyncio.Event()
        for queue in self._watchers:
            queue.put_nowait((state, detail))
        for listener in list(self._listeners):
            try:
                listener(state, detail)
            except Exception:
                log.exception("a state listener failed")

    async def _wait_state_change(self) -> None:
        await self._changed.wait()

    # -- the EngineClient API ---------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        model: str | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """Stream one request's deltas (see api.EngineClient.generate); closing early aborts it.

        ``model`` names a model beside the engine's default one (a store name, directory or GGUF
        file); it is loaded on demand first (load_model), so the first delta may be a while coming."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", "params")
        self._require_ready()
        spec = None if model is None else ipc.normalize_model_spec(model)
        handle = await self._handle(spec)
        text, token_ids = self._tokenize(prompt, messages, params, continue_final_message, handle)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        processor = handle.processor
        self._require_connection()  # (after the awaits above: the connection may have gone meanwhile)
        stream = _Stream(processor)
        self._streams[request_id] = stream
        processor.add_request(request_id, text, token_ids, params)
        try:
            self._send(ipc.AddRequest(request_id, token_ids, ipc.params_to_wire(params), spec))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # Runs on aclose(), cancellation and when a dropped iterator is finalised by the loop.
            self._streams.pop(request_id, None)
            if processor.has(request_id):
                processor.drop(request_id)
                if self.state in (EngineState.READY, EngineState.LOADING):
                    self._send(ipc.AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" (no-op when unknown or finished)."""
        if request_id in self._streams and self.state in (EngineState.READY, EngineState.LOADING):
            self._send(ipc.AbortRequests([request_id]))

    async def stats(self) -> EngineStats:
        """The engine's counters (EngineStats), num_clients and engine_pid included."""
        return msgspec.convert(await self._call(lambda cid: ipc.StatsCall(cid)), EngineStats)

    async def embed(self, inputs: list[str | list[int]], model: str | None = None) -> list[list[float]]:
        """Mean-pooled, L2-normalised final hidden states of each input (tokenized here)."""
        self._require_ready()
        if not isinstance(inputs, list) or not inputs:
            raise InvalidRequestError("input must be a non-empty list of strings or token-id lists", "input")
        spec = None if model is None else ipc.normalize_model_spec(model)
        handle = await self._handle(spec)
        prompts = [self._embedding_ids(item, i, handle) for i, item in enumerate(inputs)]
        if spec is not None:  # it may have been unloaded since: load it again (at once if it is loaded)
            await self.load_model(spec)
        vectors: list[list[float]] = await self._call(
            lambda cid: ipc.EmbedCall(cid, prompts, spec), invalid_param="input"
        )
        return vectors

    async def load_model(self, model: str) -> ModelInfo:
        """Have the engine hold ``model`` beside its default one (loaded on demand, within its memory
        budget); returns once it is ready and its tokenizer is loaded here. InvalidRequestError for a
        model that does not exist, cannot load or cannot fit the budget."""
        self._require_ready()
        spec = ipc.normalize_model_spec(model)
        result = await self._call(lambda cid: ipc.LoadModelCall(cid, spec), invalid_param="model")
        info = msgspec.convert(result, ModelInfo) if not isinstance(result, ModelInfo) else result
        known = self._handles.get(spec)
        if known is None or known.info.path != info.path:
            tokenizer = self._tokenizer
            if tokenizer is None or self._model_info is None or self._model_info.path != info.path:
                try:
                    tokenizer = await asyncio.to_thread(Tokenizer, info.path)
                except Exception as exc:
                    raise InvalidRequestError(f"could not load the tokenizer of {info.name}: {exc}", "model") from exc
            self._handles[spec] = _ModelHandle(info, tokenizer, OutputProcessor(tokenizer))
        else:
            self._handles[spec] = dataclasses.replace(known, info=info)
        return info

    async def models(self) -> list[ModelStatus]:
        """Every model the engine holds or is loading, the default one first."""
        result = await self._call(lambda cid: ipc.ModelsCall(cid))
        statuses = [msgspec.convert(r, ModelStatus) if not isinstance(r, ModelStatus) else r for r in result]
        return sorted(statuses, key=lambda m: not m.default)

    def add_model_listener(self, listener: ModelListener) -> Callable[[], None]:
        """Call ``listener(spec, state, detail)`` when a model beside the default one changes state."""
        self._model_listeners.append(listener)
        return lambda: self._model_listeners.remove(listener) if listener in self._model_listeners else None

    def bind(self, model: str | None) -> ModelView:
        """This client seen as serving ``model`` only (None: the default model): an EngineClient for the
        server's routes and a TUI pane. ``await view.ready()`` loads the model."""
        return ModelView(self, model)

    def model_handle_info(self, model: str) -> ModelInfo | None:
        """The facts of a model beside the default one, once load_model has run for it here."""
        handle = self._handles.get(ipc.normalize_model_spec(model))
        return handle.info if handle is not None else None

    def model_tokenizer(self, model: str) -> Tokenizer | None:
        handle = self._handles.get(ipc.normalize_model_spec(model))
        return handle.tokenizer if handle is not None else None

    async def _handle(self, spec: str | None) -> _ModelHandle:
        """The default model's handle, or the named model's (loaded on demand)."""
        if spec is None:
            assert self._tokenizer is not None and self._model_info is not None and self._processor is not None
            return _ModelHandle(self._model_info, self._tokenizer, self._processor)
        handle = self._handles.get(spec)
        state = self.model_states.get(spec, ("ready", ""))[0]
        if handle is None or state in ("unloaded", "failed"):
            await self.load_model(spec)
            handle = self._handles[spec]
        return handle

    async def switch_model(self, model: str | None) -> ModelInfo:
        """Have the engine load another model (for every attached client); running requests end with "error"."""
        self._require_ready()
        result = await self._call(lambda cid: ipc.SwitchModelCall(cid, model), invalid_param="model")
        return msgspec.convert(result, ModelInfo) if not isinstance(result, ModelInfo) else result

    # -- requests: validation and tokenization ------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        """The model the engine serves; EngineBusyError until it first is ready (kept after it dies, as
        the model it was serving). :func:`chatapp.engine.api.loaded_model_info` asks without raising."""
        if self._model_info is None:
            raise EngineBusyError(f"the engine has no model loaded yet ({self.state}); retry shortly")
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer, loaded in this process; EngineBusyError until the model is ready."""
        if self._tokenizer is None:
            raise EngineBusyError(f"the engine has no model loaded yet ({self.state}); retry shortly")
        return self._tokenizer

    def _require_ready(self) -> None:
        if self.state == EngineState.READY:
            return
        if self.state == EngineState.DEAD:
            raise self._death or EngineDeadError("the engine died; restart it")
        if self.state == EngineState.CLOSED:
            raise EngineDeadError("this engine client is closed")
        raise EngineBusyError(f"the engine is not ready ({self.state}: {self.state_detail}); retry shortly")

    def _require_connection(self) -> None:
        """A call or stream needs the receiver to answer it: refuse it once this client is detaching."""
        if self._detaching or self._sock is None:
            if self.state == EngineState.DEAD:
                raise self._death or EngineDeadError("the engine died; restart it")
            raise EngineDeadError("this engine client is closing or reconnecting; retry once it is ready")

    def _tokenize(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None,
        params: SamplingParams,
        continue_final_message: bool,
        handle: _ModelHandle,
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), or InvalidRequestError naming the bad field."""
        tokenizer = handle.tokenizer
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        text: str | None = None
        if messages is not None:
            param = "messages"
            try:
                token_ids = tokenizer.render_chat(messages, continue_final_message=continue_final_message)
            except ChatFormatError as exc:
                raise InvalidRequestError(str(exc), "messages") from exc
        else:
            param = "prompt"
            if isinstance(prompt, str):
                text = prompt
                token_ids = tokenizer.encode(prompt) if prompt else []
            else:
                token_ids = self._check_token_ids(prompt, "prompt", handle.info)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param)
        max_len = handle.info.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequestError(context_length_error(max_len, len(token_ids), params.max_tokens), param)
        return text, token_ids

    def _check_token_ids(self, ids: object, param: str, info: ModelInfo) -> list[int]:
        vocab = info.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(f"{param} must be a string or a list of token ids", param)
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{param} token ids must be in [0, {vocab})", param)
        return list(ids)

    def _embedding_ids(self, item: str | list[int], index: int, handle: _ModelHandle) -> list[int]:
        if isinstance(item, str):
            ids = handle.tokenizer.encode(item) if item else []
        else:
            ids = self._check_token_ids(item, "input", handle.info)
        if not ids:
            raise InvalidRequestError(f"input[{index}] is empty", "input")
        if len(ids) >= handle.info.max_model_len:
            raise InvalidRequestError(context_length_error(handle.info.max_model_len, len(ids), 0), "input")
        return ids

    # -- calls ---------------------------------------------------------------------------

    async def _call(self, make: Callable[[int], Any], invalid_param: str | None = None) -> Any:
        if self.state not in (EngineState.READY, EngineState.LOADING):
            self._require_ready()
        self._require_connection()
        call_id = self._next_call
        self._next_call += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(make(call_id))
            reply: ipc.Reply = await future
        finally:
            self._calls.pop(call_id, None)
        if reply.error is None:
            return reply.result
        if reply.error_kind == ErrorKind.BUSY:
            raise EngineBusyError(reply.error)
        if reply.error_kind == ErrorKind.INVALID:
            raise InvalidRequestError(reply.error, invalid_param)
        raise EngineError(reply.error)

    def _send(self, msg: Any) -> None:
        """Queue a message without awaiting: also usable from a generator's finally during finalisation."""
        if self._sock is None:
            return
        try:
            future = self._sock.send(self._encoder.encode(msg))
        except zmq.ZMQError as exc:
            log.warning("sending %s failed: %s", type(msg).__name__, exc)
            return
        if isinstance(future, asyncio.Future):
            future.add_done_callback(_log_send_failure)

    # -- attaching ----------------------------------------------------------------------

    def _runtime(self) -> Path:
        if self._runtime_arg is not None:
            self._runtime_arg.mkdir(parents=True, exist_ok=True)
            os.chmod(self._runtime_arg, 0o700)
            return self._runtime_arg
        return paths.runtime_dir()

    async def _attach(self) -> None:
        """Find or spawn the engine and say hello, holding the discovery lock (see ipc.py)."""
        runtime = self._runtime()
        lock = ipc.DiscoveryLock(runtime)
        while not lock.try_acquire():
            await asyncio.sleep(0.05)
        try:
            record = ipc.read_record(runtime)
            if record is not None and record.process() is None:
                log.info("removing the stale record of engine pid %d", record.pid)
                ipc.remove_record(runtime, record)
                record = None
            wanted = ipc.normalize_model_spec(self.config.model)
            if record is None:
                record = await self._spawn(runtime)
                self.spawned_engine = True
            else:
                prestart.dismiss()
                self.spawned_engine = False
                self._popen = None
                if record.model != wanted:
                    message = (
                        f"the running engine (pid {record.pid}) serves {record.model}, not {wanted}; "
                        "using it (switch_model changes it for every client)"
                    )
                    if self.on_model_mismatch == "error":
                        raise EngineModelMismatchError(message.split("; ")[0] + "; stop it or switch its model")
                    log.warning(message)
                    self.model_mismatch = message
            self.engine_pid, self.log_path = record.pid, Path(record.log_path)
            self._engine_proc = record.process()
            if self._engine_proc is None:
                raise _EngineLeft()
            await self._hello(record, wanted)  # the receiver applies the engine's state from here on
        finally:
            lock.release()

    async def _spawn(self, runtime: Path) -> ipc.EngineRecord:
        """Start the engine process and wait until it has bound its socket and written its record."""
        self._set_state(EngineState.STARTING, "starting the engine process")
        log_path = runtime / ipc.LOG_FILE
        config_json = ipc.config_to_json(self.config)
        self._popen = prestart.take(runtime, config_json)  # started by the CLI, its imports done or under way
        if self._popen is None:
            prestart.rotate_log(log_path)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", "chatapp.engine.launch"]
                    + ["--config", config_json, "--runtime-dir", str(runtime)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=log_fd,
                    start_new_session=True,
                    close_fds=True,
                )
            finally:
                os.close(log_fd)
        log.info("spawned engine pid %d", self._popen.pid)
        while True:
            record = ipc.read_record(runtime)
            if record is not None and record.pid == self._popen.pid:
                return record
            code = self._popen.poll()
            if code is not None:
                raise EngineDeadError(
                    f"the engine process exited with code {code} while starting; see {log_path}:\n{_tail(log_path)}"
                )
            await asyncio.sleep(0.05)

    async def _hello(self, record: ipc.EngineRecord, wanted: str) -> ipc.Welcome:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(record.socket)
        self._sock = sock
        self._detaching = False
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        self._tasks = [
            loop.create_task(self._receive(), name="engine-client-receive"),
            loop.create_task(self._watch(), name="engine-client-watch"),
            loop.create_task(self._heartbeat(), name="engine-client-heartbeat"),
        ]
        self._send(ipc.Hello(os.getpid(), wanted))
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):  # (not wait_for: it can drop a cancellation, see engine_link)
                return await asyncio.shield(self._welcome)
        except TimeoutError:
            raise EngineDeadError(f"the engine (pid {record.pid}) does not answer; see {record.log_path}") from None
        except EngineDeadError:
            if self._engine_proc is None or not _alive(self._engine_proc, self._popen):
                raise _EngineLeft() from None
            raise

    async def _apply_engine_state(self, state: str, detail: str, info: ModelInfo | None) -> None:
        """Follow the engine's state; on "ready" (re)load the tokenizer first, so requests can be tokenized."""
        if state == "ready" and info is not None:
            if self._tokenizer is None or self._model_info is None or self._model_info.path != info.path:
                self._set_state(EngineState.LOADING, f"loading the tokenizer of {info.name}")
                try:
                    tokenizer = await self._load_tokenizer(info.path)
                except Exception as exc:
                    log.exception("loading the tokenizer failed")
                    self._die(EngineError(f"could not load the tokenizer of {info.name}: {exc}"))
                    return
                self._tokenizer = tokenizer
                self._processor = OutputProcessor(tokenizer)
            self._model_info = info
            self._set_state(EngineState.READY, detail)
        elif state == "loading":
            self._start_tokenizer_preload()
            self._set_state(EngineState.LOADING, detail)

    def _start_tokenizer_preload(self) -> None:
        """Load the asked-for model's tokenizer from the start, beside the engine's loading and this process's
        own imports: once the engine was ready, a 1B file's first start waited ~0.14 s more for the build,
        begun only when the "loading" message was read (late, behind the HTTP server's imports). The
        engine may turn out to serve another model: then the preload goes unused."""
        if self._tokenizer is not None or self._tokenizer_preload is not None:
            return
        try:
            from chatapp.engine.model_ref import resolve_model_spec

            path = str(resolve_model_spec(self.config.model).path)
        except Exception:  # a model the engine will refuse, with its own message
            return
        task = asyncio.create_task(asyncio.to_thread(Tokenizer, path))
        # Retrieved here too: an engine that fails to load never asks for the preload, and asyncio would
        # print the task's unretrieved exception, traceback and all, as the client exits.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tokenizer_preload = (path, task)

    async def _load_tokenizer(self, path: str) -> Tokenizer:
        """The tokenizer of the model at ``path``: the preloaded one when it is that model's."""
        preload, self._tokenizer_preload = self._tokenizer_preload, None
        if preload is not None and preload[0] == str(path):
            with contextlib.suppress(Exception):  # a failed preload: load it again below, to report why
                return await preload[1]
        elif preload is not None:
            preload[1].cancel()
        return await asyncio.to_thread(Tokenizer, path)

    # -- background tasks -------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            await self._receive_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("the engine connection failed")
            self._die(EngineDeadError(f"lost the connection to the engine: {exc}"))

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = self._decoder.decode(frames[-1])
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable message from the engine: %s", exc)
                continue
            match msg:
                case ipc.Outputs():
                    self._on_outputs(msg)
                case ipc.Reply():
                    future = self._calls.get(msg.call_id)
                    if future is not None and not future.done():
                        future.set_result(msg)
                case ipc.ModelState():
                    self._on_model_state(msg)
                case ipc.StateUpdate(state="failed"):
                    self._die_failed(msg.detail, msg.error_kind)
                    return
                case ipc.StateUpdate():
                    await self._apply_engine_state(msg.state, msg.detail, msg.info)
                case ipc.Welcome():
                    if self._welcome is not None and not self._welcome.done():
                        self._welcome.set_result(msg)
                    if msg.state == "failed":
                        self._die_failed(msg.detail, msg.error_kind)
                        return
                    await self._apply_engine_state(msg.state, msg.detail, msg.info)
                case ipc.ByeAck():
                    if self._bye is not None and not self._bye.done():
                        self._bye.set_result(msg)
                case ipc.ShuttingDown():
                    self._die(EngineDeadError(f"the engine shut down: {msg.reason}"))
                    return

    def _die_failed(self, detail: str, error_kind: ErrorKind | None) -> None:
        """The engine could not load its model and exits: a bad model spec is the caller's error."""
        error = InvalidRequestError(detail, "model") if error_kind == ErrorKind.INVALID else EngineDeadError(detail)
        self._die(error)

    def _on_model_state(self, msg: ipc.ModelState) -> None:
        self.model_states[msg.model] = (msg.state, msg.detail)
        handle = self._handles.get(msg.model)
        if msg.info is not None and handle is not None:
            self._handles[msg.model] = dataclasses.replace(handle, info=msg.info)
        for listener in list(self._model_listeners):
            try:
                listener(msg.model, msg.state, msg.detail)
            except Exception:
                log.exception("a model listener failed")

    def _on_outputs(self, msg: ipc.Outputs) -> None:
        to_abort: list[str] = []
        for out in msg.outputs:
            known = self._streams.get(out.request_id)
            if known is None:
                continue  # a stream this client already closed
            processor = known.processor
            try:
                deltas, stop_ids = processor.process([out])
            except Exception as exc:  # one request's detokenizing bug must not stall the others
                log.exception("processing the output of %s failed", out.request_id)
                processor.drop(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(
                        OutputDelta(
                            out.request_id,
                            "",
                            [],
                            None,
                            True,
                            FinishReason.ERROR,
                            None,
                            0,
                            0,
                            0,
                            error=f"processing the output failed: {exc}",
                        )
                    )
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                continue
            to_abort += stop_ids
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.queue.put_nowait(delta)
        if to_abort:
            self._send(ipc.AbortRequests(to_abort))

    async def _watch(self) -> None:
        """Notice the engine's death by its pid (reaping it if it is our child)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self._engine_proc is not None and not _alive(self._engine_proc, self._popen):
                # Let the receiver read what the engine said last (why it failed to load, "shutting
                # down"): that explains the death better than the bare pid does.
                await asyncio.sleep(DEATH_GRACE_S)
                code = self._popen.returncode if self._popen is not None else None
                how = f" (exit code {code})" if code is not None else ""
                self._die(
                    EngineDeadError(
                        f"the engine process (pid {self._engine_proc.pid}) died{how}; restart it; see {self.log_path}"
                    )
                )
                return

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(ipc.HEARTBEAT_INTERVAL_S)
            self._send(ipc.Heartbeat())

    # -- death and teardown --------------------------------------------------------------

    def _die(self, error: EngineError | InvalidRequestError) -> None:
        """Fail every stream and call at once, drop the connection, and go to "dead"."""
        if self.state in (EngineState.DEAD, EngineState.CLOSED):
            return
        self._death = error
        self._fail_pending(error)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._close_socket()
        self._set_state(EngineState.DEAD, str(error))

    def _fail_pending(self, error: Exception) -> None:
        for request_id, stream in self._streams.items():
            stream.queue.put_nowait(error)
            stream.processor.drop(request_id)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for waiter in (self._welcome, self._bye):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved: nobody may be awaiting it any more

    async def _detach(self) -> None:
        """Say bye (when the engine is alive), fail what is pending, and reap an engine we spawned and left."""
        self._detaching = True  # from here on a new call or stream is refused: nothing would answer it
        remaining = None
        if self._sock is not None and self.state in (EngineState.READY, EngineState.LOADING, EngineState.STARTING):
            self._bye = asyncio.get_running_loop().create_future()
            self._send(ipc.Bye())
            with contextlib.suppress(TimeoutError, EngineError):
                async with asyncio.timeout(BYE_TIMEOUT_S):
                    remaining = (await asyncio.shield(self._bye)).remaining_clients
        try:
            await self._teardown()
        finally:
            # After the teardown, not before: a call sent while the bye was on its way has no receiver now.
            self._fail_pending(EngineDeadError("this engine client was closed"))
            self._streams.clear()
        if self._popen is not None and (remaining == 0 or self.state == EngineState.DEAD):
            await self._reap(self._popen)  # it is leaving (or gone): collect it so no zombie stays
        self._popen = None

    async def _teardown(self) -> None:
        """Stop the receiver, watcher and heartbeat, then close the socket (even if this is cancelled)."""
        tasks, self._tasks = self._tasks, []
        try:
            for task in tasks:
                task.cancel()
            if tasks:
                # asyncio.wait, not awaiting each: a cancellation of the caller itself must not be swallowed.
                await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved (the receiver reports its own failures)
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @staticmethod
    async def _reap(popen: subprocess.Popen[bytes]) -> None:
        """The engine exits by itself once its last client left; collect it so it leaves no zombie."""
        deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
        while popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if popen.poll() is None:
            log.warning("the engine (pid %d) did not exit after its last client left; terminating it", popen.pid)
            popen.terminate()


class _EngineLeft(Exception):
    """The engine we were attaching to exited under us (internal: start() retries once)."""


def _alive(proc: psutil.Process, popen: subprocess.Popen[bytes] | None) -> bool:
    """Is the engine running? A zombie is dead; our own child is reaped by poll()."""
    if popen is not None and popen.pid == proc.pid:
        return popen.poll() is None
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("sending to the engine failed: %s", future.exception())


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
