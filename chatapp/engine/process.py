"""The background engine process: one EngineCore shared by every attached client.

Started by a client as ``python -m chatapp.engine.process`` (a fresh
interpreter in its own session: see client.py for why not multiprocessing).
It binds a ROUTER socket in the private runtime directory, writes the
discovery record, loads the model in a helper thread while it already answers
clients (so they can show progress), then runs the busy loop:

    take client messages (requests, aborts, calls) -> core.step() -> send outputs

It blocks in the socket poll when there is no work, so an idle engine costs no
CPU. It exits when its last client detaches or disappears (client pid gone, or
no heartbeat for CLIENT_TIMEOUT_S), and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from chatapp.engine import ipc
from chatapp.engine.api import EngineBusyError, EngineStats, ErrorKind, ModelInfo
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import EngineCore
from chatapp.engine.outputs import EngineCoreOutput, FinishReason
from chatapp.engine.stream_buffer import StreamBuffer
from chatapp.engine.tokenizer import prepare_tokenizer_files

log = logging.getLogger("chatapp.engine.process")

STARTUP_GRACE_S = 60.0
"""Exit if no client has attached this long after start (the spawning client died early)."""
_CLIENT_CHECK_INTERVAL_S = 0.25


@dataclass
class _Client:
    identity: bytes
    tag: int  # prefixes this client's request ids in the core, so two clients may reuse an id
    proc: psutil.Process | None
    last_seen: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)  # core-side request ids


class _Loader(threading.Thread):
    """Builds an EngineCore off the loop thread, so clients are answered (and see progress) meanwhile."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(name="engine-loader", daemon=True)
        self.config = config
        self.core: EngineCore | None = None
        self.error: BaseException | None = None
        self.detail = f"loading {config.model or 'the bundled model'}"
        self._handler = _ProgressHandler(self)

    def run(self) -> None:
        logging.getLogger("chatapp").addHandler(self._handler)
        try:
            core = EngineCore(self.config)
            # Built once per GGUF file (transformers, here where torch is loaded anyway), so the
            # clients that attach load only tokenizer.json and the template.
            prepare_tokenizer_files(core.model.path)
            self.core = core
        except BaseException as exc:  # reported to the clients by the loop, never lost
            log.exception("loading the model failed")
            self.error = exc
        finally:
            logging.getLogger("chatapp").removeHandler(self._handler)


class _ProgressHandler(logging.Handler):
    """Turns the loader's own log lines into the progress text clients show."""

    def __init__(self, loader: _Loader) -> None:
        super().__init__(logging.INFO)
        self.loader = loader

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.loader.ident:
            self.loader.detail = record.getMessage()


def model_info(core: EngineCore) -> ModelInfo:
    cfg, mc = core.config, core.model_config
    return ModelInfo(
        name=core.model.name,
        path=str(core.model.path),
        architecture=mc.architecture,
        max_model_len=core.max_model_len,
        vocab_size=mc.vocab_size,
        device=cfg.device,
        dtype=cfg.dtype,
        attention_backend=cfg.attention_backend,
        quantization=cfg.quantization,
        block_size=cfg.block_size,
        num_kv_blocks=core.kv.num_blocks,
        load_seconds=round(core.load_seconds, 3),
    )


class EngineServer:
    """Owns the socket, the clients and the core; ``run()`` is the busy loop."""

    def __init__(self, config: EngineConfig, runtime: Path) -> None:
        self.config = config
        self.runtime = runtime
        self.encoder, self.decoder = ipc.engine_codec()
        self.busy_loop_seconds = 0.0  # loop iterations that had work: steps plus IPC and housekeeping
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a client's outputs; dead clients are removed instead
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 500)
        me = psutil.Process()
        self.record = ipc.EngineRecord(
            pid=os.getpid(),
            create_time=me.create_time(),
            socket=ipc.socket_endpoint(runtime, os.getpid()),
            model=ipc.normalize_model_spec(config.model),
            log_path=str(runtime / ipc.LOG_FILE),
        )
        self.clients: dict[bytes, _Client] = {}
        self.owner: dict[str, tuple[bytes, str]] = {}  # core request id -> (client identity, client's id)
        self.streams = StreamBuffer(config.stream_interval_ms / 1000)
        self.core: EngineCore | None = None
        self.info: ModelInfo | None = None
        self.loader: _Loader | None = None
        self.state = "loading"  # then "ready", or "failed" when no model could be loaded
        self.detail = "starting"
        self.failed_kind: ErrorKind | None = None
        self._sent_detail = ""
        self._previous_config: EngineConfig | None = None  # to fall back to when a switch fails
        self._switch_reply: tuple[bytes, int] | None = None
        self._next_tag = 0
        self._had_client = False
        self._started = time.monotonic()
        self._last_client_check = 0.0
        self.stop_reason: str | None = None

    # -- lifetime -------------------------------------------------------------

    def run(self) -> int:
        old_umask = os.umask(0o077)  # the socket file is created 0600 from the start
        try:
            self.sock.bind(self.record.socket)
        finally:
            os.umask(old_umask)
        os.chmod(self.record.socket.removeprefix("ipc://"), 0o600)
        ipc.write_record(self.runtime, self.record)
        log.info("engine pid %d listening on %s", os.getpid(), self.record.socket)
        self._start_loading(self.config)
        try:
            return self._loop()
        except Exception:
            self._broadcast(ipc.ShuttingDown("the engine loop crashed; see the engine log"))
            raise
        finally:
            self._shutdown()

    def _loop(self) -> int:
        while self.stop_reason is None:
            busy = self.core is not None and self.core.has_work()
            started = time.perf_counter()
            timeout_ms = 0 if busy else (50 if self.loader is not None else 500)
            if self.sock.poll(timeout_ms):
                self._drain()
            if self.loader is not None and not self.loader.is_alive():
                self._finish_loading()
            if self.state == "failed" and self._had_client:
                return 1  # every client that came has been told why (the spawner at least)
            self._report_progress()
            self._check_clients()
            if self._idle_exit_due() and self._leave_discovery():
                log.info("no clients left; exiting")
                return 0
            stepped = self.core is not None and self.core.has_work()
            if stepped:
                self._step()
            elif self.streams:
                self._flush_streams(force=True)  # nothing more is coming this step: hold nothing back
            if busy or stepped:  # engine overhead = busy loop time outside the model forward (see stats)
                self.busy_loop_seconds += time.perf_counter() - started
        log.info("stopping: %s", self.stop_reason)
        self._broadcast(ipc.ShuttingDown(self.stop_reason))
        return 0

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def _idle_exit_due(self) -> bool:
        if self.clients:
            return False
        return self._had_client or time.monotonic() - self._started > STARTUP_GRACE_S

    def _leave_discovery(self) -> bool:
        """Remove our record under the discovery lock, unless a client is attaching right now."""
        lock = ipc.DiscoveryLock(self.runtime)
        if not lock.try_acquire():
            return False
        try:
            if self.sock.poll(0):
                self._drain()  # a hello that arrived meanwhile keeps us alive
            if self.clients:
                return False
            ipc.remove_record(self.runtime, self.record)
            return True
        finally:
            lock.release()

    def _shutdown(self) -> None:
        ipc.remove_record(self.runtime, self.record)
        self.sock.close()
        self.ctx.term()

    # -- messages -------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropping a message with %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = self.decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable message from %r: %s", identity, exc)
                continue
            try:
                self._handle(identity, msg)
            except Exception:  # one bad message never takes the engine down for everyone
                log.exception("handling %s from %r failed", type(msg).__name__, identity)

    def _handle(self, identity: bytes, msg: Any) -> None:
        client = self.clients.get(identity)
        if client is None:
            if isinstance(msg, ipc.Bye):
                self._send(identity, ipc.ByeAck(len(self.clients)))
                return
            client = self._register(identity, msg.pid if isinstance(msg, ipc.Hello) else None)
        client.last_seen = time.monotonic()
        match msg:
            case ipc.Hello():
                if msg.model is not None and msg.model != self.record.model:
                    log.info("client %r asked for %s; it attaches to %s", identity, msg.model, self.record.model)
                self._send(identity, ipc.Welcome(os.getpid(), self.state, self.detail, self.info, self.failed_kind))
            case ipc.Heartbeat():
                pass
            case ipc.Bye():
                self._drop(client, "detached")
                self._send(identity, ipc.ByeAck(len(self.clients)))
            case ipc.AddRequest():
                self._add_request(client, msg)
            case ipc.AbortRequests():
                ids = [f"{client.tag}/{rid}" for rid in msg.request_ids]
                if self.core is not None:
                    self.core.abort([i for i in ids if i in client.requests])
            case ipc.StatsCall():
                self._call(identity, msg.call_id, self._stats)
            case ipc.EmbedCall():
                self._call(identity, msg.call_id, lambda: self._ready_core().embed(msg.prompts))
            case ipc.SwitchModelCall():
                self._switch_model(identity, msg)

    def _register(self, identity: bytes, pid: int | None) -> _Client:
        proc = None
        if pid is not None:
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                proc = None
        client = _Client(identity, self._next_tag, proc)
        self._next_tag += 1
        self.clients[identity] = client
        self._had_client = True
        log.info("client %r attached (pid %s); %d attached", identity, pid, len(self.clients))
        return client

    def _drop(self, client: _Client, why: str) -> None:
        """Forget a client and abort its requests now, so their blocks are freed at once."""
        self.clients.pop(client.identity, None)
        self.streams.forget(client.identity)
        if client.requests and self.core is not None:
            self.core.abort(list(client.requests))
        for rid in client.requests:
            self.owner.pop(rid, None)
        log.info(
            "client %r %s; aborted %d request(s); %d attached",
            client.identity,
            why,
            len(client.requests),
            len(self.clients),
        )
        client.requests.clear()

    def _add_request(self, client: _Client, msg: ipc.AddRequest) -> None:
        rid = f"{client.tag}/{msg.request_id}"
        error = None
        if self.core is None:
            error = f"the engine is {self.state} ({self.detail}); retry when it is ready"
        elif rid in self.owner:
            error = f"request id {msg.request_id!r} is already running"
        else:
            try:
                params = ipc.params_from_wire(msg.params)
                self.owner[rid] = (client.identity, msg.request_id)
                client.requests.add(rid)
                self.core.add_request(rid, msg.prompt_token_ids, params)
                return
            except Exception as exc:
                self.owner.pop(rid, None)
                client.requests.discard(rid)
                log.warning("rejected request %s: %s", rid, exc)
                error = f"invalid request: {exc}"
        out = EngineCoreOutput(
            msg.request_id, [], FinishReason.ERROR, num_prompt_tokens=len(msg.prompt_token_ids), error=error
        )
        self._send(client.identity, ipc.Outputs([out]))

    def _call(self, identity: bytes, call_id: int, fn: Any) -> None:
        try:
            self._send(identity, ipc.Reply(call_id, result=fn()))
        except EngineBusyError as exc:
            self._send(identity, ipc.Reply(call_id, error=str(exc), error_kind=ErrorKind.BUSY))
        except ValueError as exc:
            self._send(identity, ipc.Reply(call_id, error=str(exc), error_kind=ErrorKind.INVALID))
        except Exception as exc:
            log.exception("call %d failed", call_id)
            self._send(
                identity, ipc.Reply(call_id, error=f"{type(exc).__name__}: {exc}", error_kind=ErrorKind.INTERNAL)
            )

    def _ready_core(self) -> EngineCore:
        if self.core is None:
            raise EngineBusyError(f"the engine is {self.state} ({self.detail}); retry when it is ready")
        return self.core

    def _stats(self) -> EngineStats:
        return dataclasses.replace(
            self._ready_core().stats(),
            num_clients=len(self.clients),
            busy_loop_seconds_total=self.busy_loop_seconds,
            engine_pid=os.getpid(),
        )

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([identity, self.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a peer that vanished: its heartbeat/pid check removes it
            log.debug("send to %r failed: %s", identity, exc)

    def _broadcast(self, msg: Any) -> None:
        for identity in list(self.clients):
            self._send(identity, msg)

    # -- the step -------------------------------------------------------------

    def _step(self) -> None:
        assert self.core is not None
        try:
            outputs = self.core.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            outputs = self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        self._route(outputs)

    def _fail_all(self, error: str) -> list[EngineCoreOutput]:
        """End every known request with an error, whatever state the core was left in."""
        outputs = [EngineCoreOutput(rid, [], FinishReason.ERROR, error=error) for rid in self.owner]
        if self.core is not None:
            try:
                self.core.abort(list(self.owner))
            except Exception:
                log.exception("aborting after a failure failed too")
        return outputs

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue  # a dropped client's request, or one already failed
            identity, client_rid = owner
            if out.finish_reason is not None:
                del self.owner[out.request_id]
                client = self.clients.get(identity)
                if client is not None:
                    client.requests.discard(out.request_id)
            out.request_id = client_rid
            self.streams.add(identity, out)
        self._flush_streams()

    def _flush_streams(self, force: bool = False) -> None:
        """Send each client what is due (stream_buffer.py: a few tokens a message, never a first or last)."""
        for identity, outs in self.streams.due(force):
            self._send(identity, ipc.Outputs(outs))

    # -- clients' liveness ------------------------------------------------------

    def _check_clients(self) -> None:
        now = time.monotonic()
        if now - self._last_client_check < _CLIENT_CHECK_INTERVAL_S:
            return
        self._last_client_check = now
        for client in list(self.clients.values()):
            if now - client.last_seen > ipc.CLIENT_TIMEOUT_S:
                self._drop(client, f"sent nothing for {now - client.last_seen:.1f} s")
            elif client.proc is not None and not _alive(client.proc):
                self._drop(client, f"process {client.proc.pid} exited")

    # -- loading and switching models ------------------------------------------

    def _start_loading(self, config: EngineConfig) -> None:
        self.state = "loading"
        self.loader = _Loader(config)
        self.detail = self.loader.detail
        self._broadcast(ipc.StateUpdate("loading", self.detail))
        self.loader.start()

    def _report_progress(self) -> None:
        if self.loader is not None and self.loader.detail != self._sent_detail:
            self.detail = self._sent_detail = self.loader.detail
            self._broadcast(ipc.StateUpdate("loading", self.detail))

    def _finish_loading(self) -> None:
        """Install the loaded core, or fall back to the previous model, or go to "failed".

        A failed engine stays until a client has heard why (the spawner may not have said hello yet).
        """
        loader, self.loader = self.loader, None
        assert loader is not None
        if loader.core is not None:
            self.core, self.info, self.state = loader.core, model_info(loader.core), "ready"
            self.config = loader.config
            self.detail = f"{self.info.name} ready"
            self.record.model = ipc.normalize_model_spec(loader.config.model)
            ipc.write_record(self.runtime, self.record)
            self._broadcast(ipc.StateUpdate("ready", self.detail, self.info))
            if self._switch_reply is not None:
                identity, call_id = self._switch_reply
                self._send(identity, ipc.Reply(call_id, result=self.info))
                self._switch_reply = None
            self._previous_config = None
            return
        error = f"{type(loader.error).__name__}: {loader.error}"
        kind = ErrorKind.INVALID if isinstance(loader.error, ValueError) else ErrorKind.INTERNAL
        if self._switch_reply is not None:
            identity, call_id = self._switch_reply
            self._send(identity, ipc.Reply(call_id, error=f"could not load the model: {error}", error_kind=kind))
            self._switch_reply = None
        if self._previous_config is not None:
            log.info("going back to the previous model")
            config, self._previous_config = self._previous_config, None
            self._start_loading(config)
            return
        self.state, self.detail, self.failed_kind = "failed", f"could not load the model: {error}", kind
        self._broadcast(ipc.StateUpdate("failed", self.detail, error_kind=kind))

    def _switch_model(self, identity: bytes, msg: ipc.SwitchModelCall) -> None:
        if self.core is None:
            self._send(
                identity,
                ipc.Reply(
                    msg.call_id, error="the engine is loading a model already; retry later", error_kind=ErrorKind.BUSY
                ),
            )
            return
        try:
            _precheck_model(msg.model)
        except ValueError as exc:
            self._send(identity, ipc.Reply(msg.call_id, error=str(exc), error_kind=ErrorKind.INVALID))
            return
        log.info("switching model to %s", msg.model or "the bundled model")
        self._route(self._fail_all(f"the engine is switching to model {msg.model or 'default'}"))
        self._previous_config = self.config
        new_config = dataclasses.replace(self.config, model=msg.model)  # the user's fields: finalize() runs again
        self.core, self.info = None, None
        gc.collect()  # free the old weights and KV pool before the new ones load
        self._switch_reply = (identity, msg.call_id)
        self._start_loading(new_config)


def _precheck_model(spec: str | None) -> None:
    """Fail fast on a model that does not exist, before running requests are ended for it.

    GGUF files (the bundled model too) are left to the loader, which reports a bad file clearly.
    """
    from chatapp.engine.model_ref import resolve_model_spec

    if spec is None or spec in ("default",) or spec.endswith(".gguf"):
        return
    resolve_model_spec(spec)


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


# -- entry point -------------------------------------------------------------------


def _setup_logging(runtime: Path) -> None:
    handler = logging.FileHandler(runtime / ipc.LOG_FILE)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    faulthandler.enable(sys.stderr)  # the spawning client points stderr at the same log file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="chatapp's background engine process (started by clients)")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--runtime-dir", required=True, help="the private directory for the socket and log")
    args = parser.parse_args(argv)
    runtime = Path(args.runtime_dir)
    _setup_logging(runtime)
    server = EngineServer(ipc.config_from_json(args.config), runtime)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: server.request_stop(f"signal {signal.Signals(signum).name}"))
    try:
        return server.run()
    except Exception:
        log.exception("the engine loop crashed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
