"""The background engine process: one EngineCore shared by every attached client.

Started by a client as ``python -m chatapp.engine.launch`` (a fresh
interpreter in its own session: see client.py for why not multiprocessing;
launch.py starts what can run beside this module's imports, then calls main).
It binds a ROUTER socket in the private runtime directory, writes the
discovery record, loads the model in a helper thread while it already answers
clients (so they can show progress), then runs the busy loop:

    take client messages (requests, aborts, calls) -> core.step() -> send outputs

It holds several models at once (model_pool.py says how and why): the default
model, which requests that name none run on, and others loaded on demand when a
request or a LoadModelCall names them, within one memory budget; every model
with work gets one step per turn of the loop.

It blocks in the socket poll when there is no work, so an idle engine costs no
CPU. It exits when its last client detaches or disappears (client pid gone, or
no heartbeat for CLIENT_TIMEOUT_S), and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from chatapp.engine import cpu_kernels, ipc, startup_gc
from chatapp.engine.api import EngineBusyError, EngineStats, ErrorKind, ModelInfo, ModelStatus
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import EngineCore
from chatapp.engine.memory import IdleMemoryRelease, return_freed_memory
from chatapp.engine.model_loader import ModelLoader, model_info, precheck_model
from chatapp.engine.model_pool import (
    GIB,
    MemoryBudget,
    ModelSlot,
    estimate_weight_bytes,
    loaded_footprint,
)
from chatapp.engine.outputs import EngineCoreOutput, FinishReason
from chatapp.engine.stream_buffer import StreamBuffer

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


class EngineServer:
    """Owns the socket, the clients and the models; ``run()`` is the busy loop."""

    def __init__(self, config: EngineConfig, runtime: Path) -> None:
        self.config = config
        self.runtime = runtime
        self.encoder, self.decoder = ipc.engine_codec()
        self.busy_loop_seconds = 0.0  # loop iterations that had work: steps plus IPC and housekeeping
        self.idle_memory = IdleMemoryRelease(cpu_kernels.release_idle_activations)
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
        # core request id -> (client identity, client's id, the model it runs on)
        self.owner: dict[str, tuple[bytes, str, ModelSlot]] = {}
        self.streams = StreamBuffer(config.stream_interval_ms / 1000)
        self.budget = MemoryBudget(config.memory_gib, config.max_loaded_models)
        self.slots: dict[str, ModelSlot] = {}  # normalised spec -> slot, the default model's included
        self.default: ModelSlot = self._new_slot(self.record.model, pinned=True)
        self.loader: ModelLoader | None = None  # one model loads at a time
        self.state = "loading"  # of the default model: then "ready", or "failed" when it could not load
        self.detail = "starting"
        self.failed_kind: ErrorKind | None = None
        self._sent_detail = ""
        self._previous_config: EngineConfig | None = None  # to fall back to when a switch fails
        self._switch_reply: tuple[bytes, int] | None = None
        self._next_tag = 0
        self._had_client = False
        self._started = time.monotonic()
        self._last_client_check = 0.0
        self._turn = 0  # which model steps first this turn (round robin)
        self.stop_reason: str | None = None

    @property
    def core(self) -> EngineCore | None:
        """The default model's core (requests that name no model run on it)."""
        return self.default.core

    @property
    def info(self) -> ModelInfo | None:
        return self.default.info

    # -- lifetime -------------------------------------------------------------

    def run(self) -> int:
        old_umask = os.umask(0o077)  # the socket file is created 0600 from the start
        try:
            self.sock.bind(self.record.socket)
        finally:
            os.umask(old_umask)
        os.chmod(self.record.socket.removeprefix("ipc://"), 0o600)
        ipc.write_record(self.runtime, self.record)
        log.info(
            "engine pid %d listening on %s; memory budget: %s", os.getpid(), self.record.socket, self.budget.describe()
        )
        self._start_loading(self.config)
        for spec in self.config.preload:
            normalised = ipc.normalize_model_spec(spec)
            if normalised not in self.slots:
                self._new_slot(normalised, pinned=True)
        try:
            return self._loop()
        except Exception:
            self._broadcast(ipc.ShuttingDown("the engine loop crashed; see the engine log"))
            raise
        finally:
            self._shutdown()

    def _loop(self) -> int:
        while self.stop_reason is None:
            busy = self._has_work()
            started = time.perf_counter()
            # A finished load is noticed within 5 ms (it is on every start's path to "ready").
            waiting = any(s.state == "queued" for s in self.slots.values())
            timeout_ms = 0 if busy else (5 if self.loader is not None else 50 if waiting else 500)
            if self.sock.poll(timeout_ms):
                self._drain()
            if self.loader is not None and not self.loader.is_alive():
                self._finish_loading()
            if self.state == "failed" and self._had_client:
                return 1  # every client that came has been told why (the spawner at least)
            self._report_progress()
            self._check_clients()
            self._manage_models()
            if self._idle_exit_due() and self._leave_discovery():
                log.info("no clients left; exiting")
                return 0
            stepped = self._step_models()
            self.idle_memory.note(busy or stepped)
            if not stepped and self.streams:
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
                mine = {f"{client.tag}/{rid}" for rid in msg.request_ids}  # a client aborts its own only
                self._abort(list(mine & client.requests))
                self._abort_queued(client.identity, set(msg.request_ids))
            case ipc.StatsCall():
                self._call(identity, msg.call_id, self._stats)
            case ipc.EmbedCall():
                self._call(identity, msg.call_id, lambda: self._embed(msg))
            case ipc.SwitchModelCall():
                self._switch_model(identity, msg)
            case ipc.LoadModelCall():
                self._load_model_call(identity, msg)
            case ipc.ModelsCall():
                self._call(identity, msg.call_id, self._model_statuses)

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
        self._abort(list(client.requests))
        for rid in client.requests:
            self._forget_owner(rid)
        for slot in self.slots.values():
            slot.queued_requests = [q for q in slot.queued_requests if q[0] != client.identity]
            slot.load_waiters = [w for w in slot.load_waiters if w[0] != client.identity]
        log.info(
            "client %r %s; aborted %d request(s); %d attached",
            client.identity,
            why,
            len(client.requests),
            len(self.clients),
        )
        client.requests.clear()

    def _abort(self, request_ids: list[str]) -> None:
        """Abort core-side request ids on whichever model each runs."""
        by_slot: dict[str, list[str]] = {}
        for rid in request_ids:
            owner = self.owner.get(rid)
            if owner is not None:
                by_slot.setdefault(owner[2].spec, []).append(rid)
        for spec, rids in by_slot.items():
            core = self.slots[spec].core if spec in self.slots else None
            if core is not None:
                core.abort(rids)

    def _abort_queued(self, identity: bytes, client_ids: set[str]) -> None:
        """Requests still waiting for their model to load end with "abort" at once."""
        for slot in self.slots.values():
            kept = []
            for queued in slot.queued_requests:
                if queued[0] == identity and queued[1].request_id in client_ids:
                    out = EngineCoreOutput(queued[1].request_id, [], FinishReason.ABORT)
                    self._send(identity, ipc.Outputs([out]))
                else:
                    kept.append(queued)
            slot.queued_requests = kept

    def _forget_owner(self, rid: str) -> None:
        owner = self.owner.pop(rid, None)
        if owner is not None:
            owner[2].num_requests -= 1

    def _add_request(self, client: _Client, msg: ipc.AddRequest) -> None:
        rid = f"{client.tag}/{msg.request_id}"
        error = None
        slot = self._slot_for(msg.model)
        if slot is None:  # a model not held: load it on demand; the request waits for it
            assert msg.model is not None
            try:
                slot = self._queue_model(msg.model)
            except ValueError as exc:
                error = str(exc)
        if error is None and slot is not None and slot.state in ("queued", "loading"):
            slot.queued_requests.append((client.identity, msg))
            return
        core = slot.core if slot is not None else None
        if error is not None:
            pass
        elif slot is None or core is None:
            error = f"the engine is {self.state} ({self.detail}); retry when it is ready"
        elif rid in self.owner:
            error = f"request id {msg.request_id!r} is already running"
        else:
            try:
                params = ipc.params_from_wire(msg.params)
                self.owner[rid] = (client.identity, msg.request_id, slot)
                slot.num_requests += 1
                slot.touch()
                client.requests.add(rid)
                core.add_request(rid, msg.prompt_token_ids, params)
                return
            except Exception as exc:
                self._forget_owner(rid)
                client.requests.discard(rid)
                log.warning("rejected request %s: %s", rid, exc)
                error = f"invalid request: {exc}"
        out = EngineCoreOutput(
            msg.request_id, [], FinishReason.ERROR, num_prompt_tokens=len(msg.prompt_token_ids), error=error
        )
        self._send(client.identity, ipc.Outputs([out]))

    def _slot_for(self, model: str | None) -> ModelSlot | None:
        """The slot a request names (None: the default model's), or None when that model is not held."""
        if model is None or model == self.default.spec:
            return self.default
        return self.slots.get(model)

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

    def _embed(self, msg: ipc.EmbedCall) -> list[list[float]]:
        if msg.model is None:
            return self._ready_core().embed(msg.prompts)
        slot = self._slot_for(msg.model)
        if slot is None or slot.core is None:
            raise EngineBusyError(f"the model {msg.model} is not loaded; load it first (load_model)")
        slot.touch()
        return slot.core.embed(msg.prompts)

    def _stats(self) -> EngineStats:
        """The default model's counters, with the KV pools, queues and token counts of every model summed."""
        base = self._ready_core().stats()
        others = [s.core.stats() for s in self.slots.values() if s is not self.default and s.core is not None]
        if others:
            base = dataclasses.replace(
                base,
                kv_blocks_total=base.kv_blocks_total + sum(o.kv_blocks_total for o in others),
                kv_blocks_free=base.kv_blocks_free + sum(o.kv_blocks_free for o in others),
                kv_blocks_used=base.kv_blocks_used + sum(o.kv_blocks_used for o in others),
                num_running=base.num_running + sum(o.num_running for o in others),
                num_waiting=base.num_waiting + sum(o.num_waiting for o in others),
                prompt_tokens_total=base.prompt_tokens_total + sum(o.prompt_tokens_total for o in others),
                generation_tokens_total=base.generation_tokens_total + sum(o.generation_tokens_total for o in others),
                generation_tokens_per_second=base.generation_tokens_per_second
                + sum(o.generation_tokens_per_second for o in others),
                forward_seconds_total=base.forward_seconds_total + sum(o.forward_seconds_total for o in others),
                step_seconds_total=base.step_seconds_total + sum(o.step_seconds_total for o in others),
            )
        return dataclasses.replace(
            base,
            num_clients=len(self.clients),
            busy_loop_seconds_total=self.busy_loop_seconds,
            engine_pid=os.getpid(),
        )

    def _model_statuses(self) -> list[ModelStatus]:
        now = time.monotonic()
        return [
            ModelStatus(
                spec=slot.spec,
                state=slot.state,
                detail=slot.detail,
                default=slot is self.default,
                pinned=slot.pinned,
                footprint_bytes=slot.footprint_bytes,
                idle_seconds=round(now - slot.last_used, 3) if slot.is_idle() else 0.0,
                num_requests=slot.num_requests + len(slot.queued_requests),
                info=slot.info,
            )
            for slot in self.slots.values()
        ]

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([identity, self.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a peer that vanished: its heartbeat/pid check removes it
            log.debug("send to %r failed: %s", identity, exc)

    def _broadcast(self, msg: Any) -> None:
        for identity in list(self.clients):
            self._send(identity, msg)

    # -- the step -------------------------------------------------------------

    def _has_work(self) -> bool:
        return any(s.core is not None and s.core.has_work() for s in self.slots.values())

    def _step_models(self) -> bool:
        """One step of every model that has work, starting with a different one each turn (fairness)."""
        working = [s for s in self.slots.values() if s.core is not None and s.core.has_work()]
        if not working:
            return False
        self._turn += 1
        start = self._turn % len(working)
        for slot in working[start:] + working[:start]:
            self._step(slot)
        return True

    def _step(self, slot: ModelSlot) -> None:
        assert slot.core is not None
        try:
            outputs = slot.core.step()
        except Exception as exc:
            log.exception("engine step of %s failed; failing its requests in flight", slot.spec)
            outputs = self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}", slot)
        self._route(outputs)

    def _fail_all(self, error: str, slot: ModelSlot) -> list[EngineCoreOutput]:
        """End every request on ``slot`` with an error, whatever state its core was left in."""
        rids = [rid for rid, owner in self.owner.items() if owner[2] is slot]
        outputs = [EngineCoreOutput(rid, [], FinishReason.ERROR, error=error) for rid in rids]
        if slot.core is not None:
            try:
                slot.core.abort(rids)
            except Exception:
                log.exception("aborting after a failure failed too")
        return outputs

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue  # a dropped client's request, or one already failed
            identity, client_rid, slot = owner
            if out.finish_reason is not None:
                self._forget_owner(out.request_id)
                slot.touch()
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

    # -- models beside the default one ------------------------------------------

    def _new_slot(self, spec: str, pinned: bool) -> ModelSlot:
        slot = ModelSlot(spec, pinned)
        self.slots[spec] = slot
        return slot

    def _queue_model(self, spec: str) -> ModelSlot:
        """A slot for a model to load on demand (ValueError for one that does not exist or cannot fit)."""
        precheck_model(spec)
        slot = self._new_slot(spec, pinned=False)
        slot.detail = "waiting to load"
        self._broadcast(ipc.ModelState(spec, "queued", slot.detail))
        return slot

    def _load_model_call(self, identity: bytes, msg: ipc.LoadModelCall) -> None:
        slot = self._slot_for(msg.model)
        if slot is None:
            try:
                slot = self._queue_model(msg.model)
            except ValueError as exc:
                self._send(identity, ipc.Reply(msg.call_id, error=str(exc), error_kind=ErrorKind.INVALID))
                return
        slot.touch()
        if slot.state == "ready" and slot.info is not None:
            self._send(identity, ipc.Reply(msg.call_id, result=slot.info))
        else:
            slot.load_waiters.append((identity, msg.call_id))

    def _manage_models(self) -> None:
        """Unload models idle past keep_alive, then start the next queued load if there is room."""
        keep_alive = self.config.keep_alive_s
        if keep_alive is not None:
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if (
                    not slot.pinned
                    and slot is not self.default
                    and slot.is_idle()
                    and now - slot.last_used > keep_alive
                ):
                    self._unload(slot, f"idle for {keep_alive:g} s")
        if self.loader is not None or self.default.state != "ready" or self._packing_weights():
            return  # one load at a time, its weights' packing included; the default model first
        for slot in list(self.slots.values()):
            if slot.state == "queued":
                self._try_start(slot)
                return

    def _packing_weights(self) -> bool:
        """Whether a loaded model still packs its weights (weight_packer.py). Its tiles' memory is not all
        committed yet, so the free memory a plan for the next model reads would count it as room."""
        return any(s.core is not None and not s.core.runner.weights_ready(0) for s in self.slots.values())

    def _try_start(self, slot: ModelSlot) -> None:
        """Plan room for a queued model; load it, wait for room, or fail it with the figures."""
        config = dataclasses.replace(self.config, model=slot.spec, preload=())
        try:
            if not slot.weight_estimate:
                from chatapp.engine.model_ref import resolve_model_spec

                slot.weight_estimate = estimate_weight_bytes(resolve_model_spec(slot.spec).path)
            loaded = [s for s in self.slots.values() if s.state == "ready"]
            user_cap = int(config.kv_cache_memory_gib * GIB) if config.kv_cache_memory_gib is not None else None
            plan = self.budget.plan(slot.weight_estimate, loaded, user_cap, keep=self.default)
        except (ValueError, OSError) as exc:
            self._model_failed(slot, str(exc), ErrorKind.INVALID)
            return
        if plan is None:
            busy = sum(1 for s in self.slots.values() if s.state == "ready" and not s.is_idle())
            detail = f"waiting for room: {busy} busy model(s) fill the memory budget ({self.budget.describe()})"
            if detail != slot.detail:
                slot.detail = detail
                self._broadcast(ipc.ModelState(slot.spec, "queued", detail))
            return
        for victim in plan.evict:
            self._unload(victim, f"making room for {slot.spec}")
        if plan.kv_cap_bytes is not None and config.num_kv_blocks is None:
            config = dataclasses.replace(config, kv_cache_memory_gib=plan.kv_cap_bytes / GIB)
        self._start_loader(slot, config)

    def _unload(self, slot: ModelSlot, why: str) -> None:
        """Drop an idle model (its core, weights and KV pool); a later request loads it again."""
        log.info("unloading %s: %s", slot.spec, why)
        if slot is self.default:
            raise AssertionError("the default model is never unloaded this way")
        self.slots.pop(slot.spec, None)
        slot.core = None
        startup_gc.collect_everything()
        return_freed_memory()
        self._broadcast(ipc.ModelState(slot.spec, "unloaded", why))

    def _model_failed(self, slot: ModelSlot, error: str, kind: ErrorKind) -> None:
        """A model beside the default one could not load: only its own waiters and requests hear it."""
        log.warning("could not load %s: %s", slot.spec, error)
        message = f"could not load the model {slot.spec}: {error}"
        for identity, call_id in slot.load_waiters:
            self._send(identity, ipc.Reply(call_id, error=message, error_kind=kind))
        for identity, msg in slot.queued_requests:
            out = EngineCoreOutput(
                msg.request_id, [], FinishReason.ERROR, num_prompt_tokens=len(msg.prompt_token_ids), error=message
            )
            self._send(identity, ipc.Outputs([out]))
        slot.load_waiters, slot.queued_requests = [], []
        self.slots.pop(slot.spec, None)
        self._broadcast(ipc.ModelState(slot.spec, "failed", message))

    def _model_ready(self, slot: ModelSlot, core: EngineCore) -> None:
        slot.core, slot.info, slot.state = core, model_info(core), "ready"
        slot.footprint_bytes = loaded_footprint(core)
        slot.detail = f"{slot.info.name} ready"
        slot.touch()
        log.info("%s holds %.2f GiB", slot.spec, slot.footprint_bytes / GIB)
        if slot is not self.default:
            self._broadcast(ipc.ModelState(slot.spec, "ready", slot.detail, slot.info))
        for identity, call_id in slot.load_waiters:
            self._send(identity, ipc.Reply(call_id, result=slot.info))
        queued, slot.load_waiters, slot.queued_requests = slot.queued_requests, [], []
        for identity, msg in queued:
            client = self.clients.get(identity)
            if client is not None:
                self._add_request(client, msg)

    # -- loading and switching the default model ---------------------------------

    def _start_loading(self, config: EngineConfig) -> None:
        """(Re)load the default model."""
        self.state = "loading"
        self.default.state = "loading"
        others = [s for s in self.slots.values() if s is not self.default and s.core is not None]
        self._start_loader(self.default, config, self.budget if not others else None)
        self.detail = self.loader.detail if self.loader is not None else self.detail
        self._broadcast(ipc.StateUpdate("loading", self.detail))

    def _start_loader(self, slot: ModelSlot, config: EngineConfig, budget: MemoryBudget | None = None) -> None:
        slot.state = "loading"
        self.loader = ModelLoader(config, slot, budget)
        slot.detail = self.loader.detail
        if slot is not self.default:
            self._broadcast(ipc.ModelState(slot.spec, "loading", slot.detail))
        self.loader.start()

    def _report_progress(self) -> None:
        loader = self.loader
        if loader is None or loader.detail == self._sent_detail:
            return
        self._sent_detail = loader.detail
        loader.slot.detail = loader.detail
        if loader.slot is self.default:
            self.detail = loader.detail
            self._broadcast(ipc.StateUpdate("loading", self.detail))
        else:
            self._broadcast(ipc.ModelState(loader.slot.spec, "loading", loader.detail))

    def _finish_loading(self) -> None:
        loader, self.loader = self.loader, None
        assert loader is not None
        # The start is over (launch.py held the collector off for it); what it made stays (startup_gc.py).
        startup_gc.release(freeze=True)
        if loader.slot is not self.default:
            if loader.core is not None:
                self._model_ready(loader.slot, loader.core)
            else:
                error = f"{type(loader.error).__name__}: {loader.error}"
                kind = ErrorKind.INVALID if isinstance(loader.error, ValueError) else ErrorKind.INTERNAL
                self._model_failed(loader.slot, error, kind)
            return
        self._finish_default(loader)

    def _finish_default(self, loader: ModelLoader) -> None:
        """Install the loaded default model, or fall back to the previous one, or go to "failed".

        A failed engine stays until a client has heard why (the spawner may not have said hello yet).
        """
        if loader.core is not None:
            self._model_ready(self.default, loader.core)
            self.state = "ready"
            self.config = loader.config
            self.detail = self.default.detail
            self.record.model = self.default.spec
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
            self._rekey_default(ipc.normalize_model_spec(config.model))
            self._start_loading(config)
            return
        self.default.state = "failed"
        self.state, self.detail, self.failed_kind = "failed", f"could not load the model: {error}", kind
        self._broadcast(ipc.StateUpdate("failed", self.detail, error_kind=kind))

    def _rekey_default(self, spec: str) -> None:
        """The default model becomes ``spec``: a fresh slot (its requests and waiters end with the old one)."""
        self.slots.pop(self.default.spec, None)
        existing = self.slots.get(spec)
        if existing is not None and existing.core is None:
            self.slots.pop(spec)  # queued for loading on demand: the default load takes its place
            self.default = self._new_slot(spec, pinned=True)
            self.default.load_waiters, self.default.queued_requests = existing.load_waiters, existing.queued_requests
        else:
            self.default = existing if existing is not None else self._new_slot(spec, pinned=True)
        self.default.pinned = True

    def _switch_model(self, identity: bytes, msg: ipc.SwitchModelCall) -> None:
        """Make another model the default. The old default's requests end with "error" and it is unloaded;
        a model already loaded beside it becomes the default at once."""
        if self.core is None or self.loader is not None:
            self._send(
                identity,
                ipc.Reply(
                    msg.call_id, error="the engine is loading a model already; retry later", error_kind=ErrorKind.BUSY
                ),
            )
            return
        try:
            precheck_model(msg.model)
        except ValueError as exc:
            self._send(identity, ipc.Reply(msg.call_id, error=str(exc), error_kind=ErrorKind.INVALID))
            return
        log.info("switching model to %s", msg.model or "the bundled model")
        old = self.default
        self._route(self._fail_all(f"the engine is switching to model {msg.model or 'default'}", old))
        self._previous_config = self.config
        new_config = dataclasses.replace(self.config, model=msg.model)  # the user's fields: finalize() runs again
        self._rekey_default(ipc.normalize_model_spec(msg.model))
        old.core, old.info = None, None
        startup_gc.collect_everything()  # free the old weights and KV pool before the new ones load
        if self.default.core is not None:  # already loaded beside the old default
            self.config = new_config
            self.record.model = self.default.spec
            ipc.write_record(self.runtime, self.record)
            self._previous_config = None
            self.detail = self.default.detail
            self._broadcast(ipc.StateUpdate("ready", self.detail, self.info))
            self._send(identity, ipc.Reply(msg.call_id, result=self.info))
            return
        self._switch_reply = (identity, msg.call_id)
        self._start_loading(new_config)


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
