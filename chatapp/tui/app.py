"""The chatapp TUI: several chat sessions side by side on one shared engine.

The App owns what is shared -- settings, the history store (through a
:class:`Recorder`), the local engine (:class:`LocalEngine`), remote clients,
the API server, model downloads -- and the panes ask it for these through
:class:`~chatapp.tui.services.ChatServices`. Each pane streams on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import re
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.worker import WorkerCancelled, WorkerFailed

from chatapp.engine import startup_gc
from chatapp.engine.api import EngineClient, EngineDeadError, EngineError, InvalidRequestError, loaded_model_info
from chatapp.engine.ipc import normalize_model_spec
from chatapp.history import Backend, HistoryError, HistoryOpenError, HistoryStore, Session
from chatapp.logs import tui_log_path
from chatapp.settings import SettingsError, load_or_default, save
from chatapp.tui import keymap, ui_state
from chatapp.tui.api_keys import move_key_to_settings
from chatapp.tui.conversation import Conversation
from chatapp.tui.downloads import PullCancelled, PullJob
from chatapp.tui.engine_link import EngineFactory, LocalEngine
from chatapp.tui.model_catalog import HubCatalog, ModelCatalog
from chatapp.tui.recorder import Recorder
from chatapp.tui.remote_client import RemoteClient
from chatapp.tui.screens.help import HelpScreen
from chatapp.tui.screens.main import MainScreen
from chatapp.tui.screens.models import ModelScreen
from chatapp.tui.screens.sessions import SessionsScreen
from chatapp.tui.screens.settings import SettingsScreen
from chatapp.tui.session_config import DEFAULT_SAMPLING, SessionConfig
from chatapp.tui.widgets.chat_pane import model_label
from chatapp.tui.widgets.status_bar import StatusBar

log = logging.getLogger(__name__)

STYLES = Path(__file__).parent / "styles"
POLL_S = 1.0
"""How often the status bar asks the engine for its counters."""


def default_engine_factory(model: str | None, options: dict[str, Any]) -> EngineFactory:
    """Attach to (or start) the shared background engine process; ``options`` are EngineConfig fields."""

    async def factory() -> EngineClient:
        from chatapp.engine.client import AsyncEngineClient
        from chatapp.engine.config import EngineConfig

        # Not started here: LocalEngine starts it, so the status bar sees it load.
        return AsyncEngineClient(EngineConfig(model=model, **options))

    return factory


class PullEnded(Message):
    """A download ended: done, failed or cancelled (posted from its thread; the job says which)."""

    def __init__(self, job: PullJob) -> None:
        super().__init__()
        self.job = job


class ChatApp(App[None]):
    """The terminal chat app. Everything outside the screen (files, engine) is given or defaulted here."""

    TITLE = "chatapp"
    CSS_PATH = [STYLES / "app.tcss", STYLES / "dialogs.tcss"]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-roomy")]
    """Screens get "-short" under 30 rows: dialogs.tcss tightens the tall dialogs there."""
    BINDINGS = keymap.bindings("app")

    def __init__(
        self,
        *,
        settings_path: Path | None = None,
        history_path: Path | None = None,
        engine_factory: EngineFactory | None = None,
        catalog: ModelCatalog | None = None,
        model: str | None = None,
        session_sampling: dict[str, Any] | None = None,
        use_default_engine: bool = True,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            settings_path / history_path: the files to use (default: the user's).
            engine_factory: makes the local engine client (default: the shared engine process).
            catalog: the model screen's source of local and Hub models.
            model: the model to start the engine with (overrides settings' default_model).
            session_sampling: sampling for new sessions (default: DEFAULT_SAMPLING).
            use_default_engine: False (with no factory) runs with no local engine: remote sessions only.
            engine_options: EngineConfig fields from the command line, over settings' [engine].
        """
        super().__init__()
        self.settings_path = settings_path
        self.settings, self._settings_error = load_or_default(settings_path)
        self.history_path = history_path
        self.catalog: ModelCatalog = catalog or HubCatalog()
        self.session_sampling = dict(session_sampling if session_sampling is not None else DEFAULT_SAMPLING)
        if engine_factory is None and use_default_engine:
            engine_factory = default_engine_factory(
                model or self.settings.default_model, self.settings.engine.options(**(engine_options or {}))
            )
        self.engine = LocalEngine(engine_factory)
        self.store: HistoryStore | None = None
        self.recorder = Recorder(None, self._history_failed)
        self.pulls: list[PullJob] = []
        self._remote: dict[tuple[str, str | None, str], RemoteClient] = {}
        self._server: Any = None
        self._api_elsewhere: str | None = None
        """The API port's URL when another chatapp window serves it (the same engine answers there)."""
        self._ui_state_path = history_path.parent / ui_state.FILENAME if history_path else ui_state.default_path()
        self._ui_state = ui_state.load(self._ui_state_path)
        self._keymap_warnings: list[str] = []
        self._session_counter = 0

    # -- start and stop ------------------------------------------------------------------------

    def on_mount(self) -> None:
        if self._settings_error is not None:
            self.notify(
                f"{self._settings_error}\nUsing the default settings.",
                title="Settings file has errors",
                severity="error",
                timeout=15,
            )
        try:
            self.theme = self.settings.theme
        except Exception:  # Textual's InvalidThemeError; any bad name falls back
            self.notify(f"Unknown theme {self.settings.theme!r}; using the default.", severity="warning")
        self._apply_keymap()
        self._open_history()
        self.push_screen(MainScreen(self, self._load_sessions()))
        self._start_engine()
        self.set_interval(POLL_S, self._poll_engine)
        self.call_after_refresh(self._poll_soon)
        if self._ui_state.api_port_on:  # it was on when the app last quit
            self.action_toggle_server()
        if not self.is_headless:
            # What exists once the first screen is up (modules, styles, widgets) lives as long as the
            # app: moved out of the collector's reach, a full collection no longer walks it, which was
            # a 50 ms stall of the UI every few seconds while answers stream. (Not in headless test
            # runs: many apps in one process would each stay in memory.)
            self.call_after_refresh(gc.freeze)
        # cli.main held the collector off for the start (startup_gc.py): it resumes with the first screen.
        self.call_after_refresh(startup_gc.release)

    def _apply_keymap(self) -> None:
        mapping, warnings = keymap.keymap(self.settings.keys)
        self.set_keymap(mapping)
        for warning in warnings:
            self.notify(warning, severity="warning", timeout=10)

    def _open_history(self) -> None:
        try:
            self.store = HistoryStore(self.history_path)
        except HistoryOpenError as exc:
            self.store = None
            self.notify(
                f"{exc}\nChats in this run are kept in memory only.",
                title="History unavailable",
                severity="error",
                timeout=20,
            )
        self.recorder.store = self.store

    def _load_sessions(self) -> list[tuple[SessionConfig, Conversation]]:
        """The open sessions from the history (one new session when there are none)."""
        loaded: list[tuple[SessionConfig, Conversation]] = []
        if self.store is not None:
            try:
                for session in self.store.list_sessions():
                    loaded.append(self._load_session(session))
            except HistoryError as exc:
                self.notify(f"Could not read the chat history: {exc}", severity="error", timeout=15)
        if not loaded:
            loaded.append((self.create_session_config(), Conversation()))
        return loaded

    def _load_session(self, session: Session) -> tuple[SessionConfig, Conversation]:
        assert self.store is not None
        data = self.store.export_dict(session.id, include_secrets=True)
        config = SessionConfig.from_session(session)
        if config.backend.api_key:  # saved by an earlier version: the key moves to the settings file
            config = self.file_api_key(config)
            if not config.backend.api_key:
                self.recorder.update_session(config.db_id, backend=config.backend)
        return config, Conversation.from_export(data)

    def file_api_key(self, config: SessionConfig) -> SessionConfig:
        """A remote session's key goes into the settings file (an endpoint there), out of the history."""
        moved = move_key_to_settings(self.settings, config.backend)
        if moved is None:
            return config
        settings, backend = moved
        if settings is not self.settings:
            try:
                save(settings, self.settings_path)
            except SettingsError as exc:
                self.notify(
                    f"{exc}\nThe API key is kept for this run only (never in the chat history).",
                    title="Could not save the API key",
                    severity="error",
                    timeout=15,
                )
                return config
            self.settings = settings
        return config.copy(backend=backend)

    @work(group="engine", exclusive=True, exit_on_error=False)
    async def _start_engine(self) -> None:
        await self.engine.start()
        listen = getattr(self.engine.raw_client, "add_model_listener", None)
        if listen is not None:  # (a restart keeps the same client, so this runs once)
            listen(self._model_changed)
        await self._poll_engine()
        if self.engine.state == "dead":
            self.notify(f"The engine did not start: {self.engine.last.detail}", severity="error", timeout=15)
        self._refresh_pane_titles()

    async def action_quit(self) -> None:
        """Stop the streams (their answers are saved as far as they got), then close everything."""
        main = self._main()
        if main is not None:
            for pane in main.panes:
                pane.save_draft()  # typed but not sent: back in the prompt next time
                pane.stop()
            for worker in self.workers:
                if worker.group == "titles":  # a title can wait for the next run (it writes only after its
                    worker.cancel()  # last await, so a cancelled one writes nothing; no need to wait)
            streams = [w for w in self.workers if w.group == "generate"]
            if streams:  # (Textual waits for every worker, cancelled ones included, when given none)
                try:
                    await self.workers.wait_for_complete(streams)
                except (WorkerCancelled, WorkerFailed):
                    # A stream cancelled before it could end itself: what it saved so far stays, and the
                    # next start marks it incomplete, as after a crash. Quitting goes on regardless.
                    log.warning("a stream did not end cleanly at quit", exc_info=True)
        if self._server is not None:
            try:
                await self._server.stop()
            except Exception:  # shutting down anyway
                log.exception("stopping the API server")
        for client in self._remote.values():
            await client.close()
        await self.engine.close()
        if self.store is not None:
            self.store.close()
        self.exit()

    # -- services for panes --------------------------------------------------------------------------

    async def client_for(self, config: SessionConfig) -> EngineClient:
        if not config.is_remote:
            client = await self.engine.client()
            bind = getattr(client, "bind", None)  # an engine client that holds several models
            if config.model and bind is not None:
                view: EngineClient = bind(config.model)
                return view
            return client
        backend = config.backend
        url, key = backend.base_url, backend.api_key
        if backend.endpoint:
            endpoint = self.settings.endpoint(backend.endpoint)
            if endpoint is None:
                raise EngineDeadError(f"there is no endpoint named {backend.endpoint!r} in the settings")
            url, key = url or endpoint.base_url, key or endpoint.api_key
        if not url or not config.model:
            raise EngineDeadError("this remote session needs a URL and a model name (session settings)")
        cache_key = (url, key, config.model)
        if cache_key not in self._remote:
            self._remote[cache_key] = RemoteClient(url, key, config.model)
        return self._remote[cache_key]  # type: ignore[return-value]

    def _model_changed(self, spec: str, state: str, detail: str) -> None:
        """The engine's progress loading a pane's own model, shown in the panes that wait for it."""
        main = self._main()
        if main is None:
            return
        for pane in main.panes:
            model = pane.config.model
            if pane.config.is_remote or not model or normalize_model_spec(model) != spec:
                continue
            if state in ("queued", "loading"):
                pane.notice(f"Loading {model_label(model)}: {detail}")
            elif state == "failed":
                pane.notice(detail)
            elif state == "ready":
                pane.notice("")
                pane.update_titles()

    def engine_died(self, reason: str) -> None:
        self.engine.mark_dead(reason)
        self._poll_soon()

    def local_model_name(self) -> str | None:
        info = loaded_model_info(self.engine.raw_client)
        return info.name if info is not None else None

    def local_context_length(self, model: str | None = None) -> int | None:
        client = self.engine.raw_client
        if model is not None:
            facts = getattr(client, "model_handle_info", None)
            other = facts(model) if facts is not None else None
            return other.max_model_len if other is not None else None
        info = loaded_model_info(client)
        return info.max_model_len if info is not None else None

    async def local_model_names(self) -> list[str]:
        try:
            entries = await asyncio.to_thread(self.catalog.list_local)
        except Exception:  # noqa: BLE001  a broken cache entry: the dialog still opens, the names typed
            log.exception("listing the local models failed")
            return []
        return [e.name for e in entries if e.runnable]

    def create_session_config(self) -> SessionConfig:
        """A new session, saved at once so it comes back after a restart."""
        self._session_counter += 1
        number = self._session_counter
        if self.store is not None:
            try:
                number = len(self.store.list_sessions(include_archived=True)) + 1
            except HistoryError:
                pass
        config = SessionConfig(title=f"Chat {number}", sampling=dict(self.session_sampling))
        session = self.recorder.create_session(
            config.title, model=config.model, system_prompt="", sampling=config.sampling, backend=config.backend
        )
        if session is not None:
            config.db_id = session.id
        return config

    def _history_failed(self, exc: HistoryError, first: bool) -> None:
        if first:
            self.notify(
                f"{exc}\nYour chats go on in memory and are saved once writing works again.",
                title="Could not save the chat history",
                severity="error",
                timeout=15,
            )
        self._poll_soon()

    # -- status ---------------------------------------------------------------------------------

    def _main(self) -> MainScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, MainScreen)), None)

    @work(group="status-poll", exclusive=True, exit_on_error=False)
    async def _poll_soon(self) -> None:
        """Poll now, in a worker: the app's own message loop never waits on the engine (a poll left
        waiting there once kept the app from ever exiting)."""
        await self._poll_engine()

    async def _poll_engine(self) -> None:
        snapshot = await self.engine.snapshot()
        main = self._main()
        if main is None:
            return
        try:
            bar = main.query_one(StatusBar)
        except NoMatches:  # the main screen is still being built
            return
        bar.engine = snapshot
        bar.history_failing = self.recorder.failing
        bar.server_url = getattr(self._server, "url", None) if self._server is not None else self._api_elsewhere
        bar.api_elsewhere = self._server is None and self._api_elsewhere is not None
        if self._server is not None:
            counts = self._server.state.requests
            bar.api_requests = (counts.running, counts.total)
        bar.restart_key = keymap.display_key(keymap.key_for("restart_engine", self.settings.keys))
        bar.help_key = keymap.display_key(keymap.key_for("help", self.settings.keys))

    def _refresh_pane_titles(self) -> None:
        main = self._main()
        if main is not None:
            for pane in main.panes:
                pane.update_titles()

    # -- app-wide actions ----------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            try:
                log_path: Path | None = tui_log_path()
            except OSError:  # no log directory to be had: the help still opens
                log_path = None
            self.push_screen(HelpScreen(self.settings.keys, log_path))

    @work(group="screens")
    async def action_settings(self) -> None:
        if isinstance(self.screen, SettingsScreen):
            return
        new = await self.push_screen_wait(SettingsScreen(self.settings, list(self.available_themes)))
        if new is None:
            return
        old = self.settings
        self.settings = new
        try:
            self.theme = new.theme
        except Exception:
            self.notify(f"Unknown theme {new.theme!r}.", severity="warning")
        try:
            path = save(new, self.settings_path)
        except SettingsError as exc:
            self.notify(
                f"{exc}\nThe new settings apply to this run only.",
                title="Settings not saved",
                severity="error",
                timeout=15,
            )
            return
        notes = []
        if old.engine != new.engine or old.default_model != new.default_model:
            notes.append("model and memory changes apply when the engine next starts")
        if self._server is not None and (old.server != new.server):
            notes.append("restart the API port (toggle it off and on) to use the new address")
        self.notify(f"Saved to {path}" + (f"; {'; '.join(notes)}." if notes else "."))

    @work(group="screens")
    async def action_sessions(self) -> None:
        if isinstance(self.screen, SessionsScreen):
            return
        session_id = await self.push_screen_wait(SessionsScreen(self))
        if session_id is not None:
            await self.show_session(session_id)

    async def show_session(self, session_id: int) -> None:
        """Focus the session's pane, reopening it (from the history) if it was closed."""
        main = self._main()
        if main is None:
            return
        pane = main.pane_for_session(session_id)
        if pane is not None:
            main.focus_pane(main.panes.index(pane))
            return
        if self.store is None:
            return
        try:
            session = self.store.get_session(session_id)
            if session.archived:
                session = self.store.update_session(session_id, archived=False)
            config, conversation = self._load_session(session)
        except HistoryError as exc:
            self.notify(f"Cannot open that session: {exc}", severity="error")
            return
        await main.add_pane(config, conversation)

    def action_models(self) -> None:
        if not isinstance(self.screen, ModelScreen):
            self.push_screen(ModelScreen(self))

    @work(group="server", exclusive=True, exit_on_error=False)
    async def action_toggle_server(self) -> None:
        if self._server is None and self._api_elsewhere is not None:
            self._api_elsewhere = None  # (another window's port: this one stops showing it)
            self._remember_api_port(False)
            self.notify("This window no longer uses the other window's API port (F9 there turns it off).")
            await self._poll_engine()
            return
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop()
            self._remember_api_port(False)
            self.notify("The API port is off.")
            await self._poll_engine()
            return
        try:
            from chatapp.server import start_server
        except ImportError:
            self.notify("The API server is not part of this build.", severity="error")
            return
        try:
            client = await self.engine.client()
        except EngineError as exc:
            self.notify(f"Cannot start the API port: {exc}", severity="error")
            return
        s = self.settings.server
        self._api_elsewhere = None
        try:
            self._server = await start_server(client, s.host, s.port, api_key=s.api_key)
        except OSError as exc:
            await self._port_taken(s.host, s.port, exc)
            await self._poll_engine()
            return
        except (RuntimeError, ValueError) as exc:
            self.notify(f"Cannot open the API port on {s.host}:{s.port}: {exc}", severity="error", timeout=10)
            return
        self._remember_api_port(True)
        self.notify(f"The OpenAI-compatible API is on at {self._server.url}")
        await self._poll_engine()

    async def _port_taken(self, host: str, port: int, error: OSError) -> None:
        """The API port could not be opened: when another chatapp window serves it (two windows on one
        engine, the port on in both), that is the API the user asked for; anything else is an error."""
        from chatapp.server.probe import chatapp_api_at

        url = await chatapp_api_at(host, port)
        if url is not None:
            self._api_elsewhere = url
            self.notify(
                f"The API is already on at {url}/v1, served by another chatapp window: the same engine answers it.",
                timeout=10,
            )
            return
        self.notify(
            f"Cannot open the API port on {host}:{port}: {error.strerror or error}. Another program may hold "
            "it: choose another port in the settings (F2).",
            severity="error",
            timeout=10,
        )

    def _remember_api_port(self, on: bool) -> None:
        """F9's state, restored at the next start (quitting with the port on keeps it on)."""
        if self._ui_state.api_port_on != on:
            self._ui_state.api_port_on = on
            ui_state.save(self._ui_state, self._ui_state_path)

    @work(group="engine", exclusive=True, exit_on_error=False)
    async def action_restart_engine(self) -> None:
        if self.engine.state not in ("dead", "off"):
            self.notify("The engine is running; restart is for when it has died.")
            return
        self.notify("Restarting the engine…")
        await self.engine.restart()
        await self._poll_engine()
        if self.engine.state == "dead":
            self.notify(f"The engine did not restart: {self.engine.last.detail}", severity="error", timeout=15)
        else:
            self.notify("The engine is back.")
            self._refresh_pane_titles()

    # -- models ----------------------------------------------------------------------------------

    @work(group="engine", exclusive=True, exit_on_error=False)
    async def switch_model(self, name: str) -> None:
        """Load another model in the shared engine; every pane is told and keeps its history."""
        self.notify(f"Loading {name}…")
        try:
            loaded = await self.engine.switch_model(name)
        except (EngineError, ValueError) as exc:
            self.notify(f"Could not switch to {name}: {exc}", severity="error", timeout=15)
            await self._poll_engine()
            return
        await self._poll_engine()
        main = self._main()
        if main is not None:
            for pane in main.panes:
                if not pane.config.is_remote and not pane.config.model:
                    pane.model_changed()  # it answers with the engine's default model
                pane.update_titles()
                if not pane.config.is_remote:
                    pane.notice(f"The engine now runs {loaded}; the conversation goes on with it.")
        self.notify(f"Switched to {loaded}.")

    @work(group="use-model", exclusive=True, exit_on_error=False)
    async def use_model(self, name: str, new_pane: bool) -> None:
        """The focused pane (or a new one) answers with ``name`` from now on: a local model loaded beside
        the others (the engine's default stays for the other panes). Loaded now, so the first answer
        does not wait for it."""
        main = self._main()
        if main is None:
            return
        if new_pane:
            config = self.create_session_config()
            config.model = name
            self.recorder.update_session(config.db_id, model=name)
            pane = await main.add_pane(config, Conversation())
        else:
            active = main.active_pane
            if active is None:
                return
            if active.busy:
                self.notify("This session is still answering; press Esc to stop it first.", severity="warning")
                return
            pane = active
            pane.config = pane.config.copy(model=name, backend=Backend.local())
            self.recorder.update_session(pane.config.db_id, model=name, backend=pane.config.backend)
        pane.update_titles()
        pane.notice(f"Loading {name}…")
        try:
            client = await self.client_for(pane.config)
            ready = getattr(client, "ready", None)
            if ready is not None:
                await ready()
        except (EngineError, InvalidRequestError, ValueError) as exc:
            pane.notice(f"Could not load {name}: {exc}")
            return
        pane.notice("")
        pane.update_titles()
        self.notify(f"{pane.config.title} answers with {name}.")

    @property
    def latest_pull(self) -> PullJob | None:
        return self.pulls[-1] if self.pulls else None

    def start_pull(self, spec: str) -> PullJob | None:
        if any(job.active for job in self.pulls):
            self.notify(
                "A download is already running; cancel it first (Ctrl+X in the model screen).", severity="warning"
            )
            return None
        job = PullJob(spec)
        self.pulls.append(job)
        self.run_worker(partial(self._pull, job), thread=True, group="pull", exit_on_error=False)
        return job

    def _pull(self, job: PullJob) -> None:
        """Runs in a thread: plan, then download with progress; the job records the outcome and the
        app hears of the end by a message (the thread touches nothing else of the app)."""
        try:
            size = self.catalog.plan(job.spec)
            job.total_bytes = size.total_bytes
            job.state = "downloading"
            job.name = self.catalog.pull(job.spec, job.progress)
            job.state = "done"
        except PullCancelled:
            job.state = "cancelled"
        except Exception as exc:  # HubError, disk errors: shown, never a traceback
            job.state, job.error = "failed", str(exc) or type(exc).__name__
        finally:
            self.post_message(PullEnded(job))

    def on_pull_ended(self, message: PullEnded) -> None:
        job = message.job
        if job.state == "done":
            self.notify(f"Downloaded {job.name}; pick it in the model screen to use it.")
        elif job.state == "failed":
            self.notify(f"Download of {job.spec} failed: {job.error}", severity="error", timeout=15)

    # -- export ----------------------------------------------------------------------------------

    def export_session(self, config: SessionConfig) -> list[Path]:
        if config.db_id is None:
            self.notify(
                "This session is not in the history (it could not be saved), so it cannot be exported.",
                severity="warning",
            )
            return []
        return self.export_by_id(config.db_id)

    def export_by_id(self, session_id: int) -> list[Path]:
        """Write the session as Markdown and JSON beside the history file; returns the files."""
        if self.store is None:
            return []
        folder = self.store.db_path.parent / "exports"
        try:
            title = self.store.get_session(session_id).title
            stem = f"{session_id}-{re.sub(r'[^A-Za-z0-9._-]+', '-', title).strip('-')[:60] or 'chat'}"
            folder.mkdir(parents=True, exist_ok=True)
            md = folder / f"{stem}.md"
            js = folder / f"{stem}.json"
            md.write_text(self.store.export_markdown(session_id), encoding="utf-8")
            js.write_text(self.store.export_json(session_id), encoding="utf-8")
        except (HistoryError, OSError) as exc:
            self.notify(f"Export failed: {exc}", severity="error")
            return []
        self.notify(f"Exported to {md} and {js.name}")
        return [md, js]

    # -- command palette ----------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette lists the same actions as the help screen (and Textual's own)."""
        for action in keymap.ACTIONS:
            if action.scope == "chat" and not isinstance(screen, MainScreen):
                continue
            target = screen if action.scope == "chat" else self
            key = keymap.display_key(keymap.key_for(action.name, self.settings.keys))
            yield SystemCommand(action.description, f"{action.name} · {key}", partial(target.run_action, action.action))
        yield from super().get_system_commands(screen)


def run(args: argparse.Namespace | None = None) -> int:
    """Entry point of `chatapp` with no subcommand."""
    model = getattr(args, "model", None) if args is not None else None
    options = {
        "max_model_len": getattr(args, "max_model_len", None),
        "kv_cache_memory_gib": getattr(args, "kv_cache_gib", None),
        "memory_gib": getattr(args, "memory_gib", None),
    }
    ChatApp(model=model, engine_options=options).run()
    return 0
