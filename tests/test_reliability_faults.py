"""Faults (issue 9): the engine killed with SIGKILL under load, seen from the HTTP server and from the TUI.

The server answers 503 with Retry-After and a clear message while the engine is gone, restarts it by
itself and then serves the same answers as before; the TUI shows the death in the answer that was
streaming and in the status bar, and its restart key brings the engine back. Tiny random models, each
module part on its own engine (in a private runtime dir), since every test here kills one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability_helpers import error_of, sse_data
from tests.server_harness import ServedEngine, idle

pytestmark = pytest.mark.timeout(300)

ENDLESS = 100_000  # longer than the context: only the kill ends these
RECOVERY_DEADLINE_S = 120


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-faults"), max_position_embeddings=32768)


# -- the HTTP server --------------------------------------------------------------------------------


async def _in_flight(http: httpx.AsyncClient, i: int) -> dict[str, Any]:
    """One of the requests running when the engine is killed: what its client saw."""
    body = {"prompt": f"Request {i} of the crowd", "max_tokens": ENDLESS, "ignore_eos": True}
    if i % 2:
        response = await http.post("/v1/completions", json=body)
        return {"stream": False, "status": response.status_code, "response": response}
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return {"stream": True, "status": response.status_code, "response": response}
        lines = [line async for line in response.aiter_lines()]
    return {"stream": True, "status": 200, "events": sse_data(lines)}


def _check_unavailable(response: httpx.Response) -> None:
    """The answer while there is no engine: 503, Retry-After, and a message that says so."""
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) > 0
    error = error_of(response)
    assert error["type"] == "server_error" and error["code"] == "engine_unavailable", error
    assert "engine" in error["message"] and "retry" in error["message"], error


def test_engine_killed_under_load_gives_503s_then_the_server_recovers_by_itself(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine = {"model": str(tiny_model), "num_kv_blocks": 512, "max_num_seqs": 32}
    with ServedEngine(tmp_path_factory.mktemp("runtime"), engine) as served:
        probe = {"prompt": "The same question before and after the crash:", "max_tokens": 16, "temperature": 0}
        before = httpx.post(f"{served.url}/v1/completions", json=probe, timeout=60).json()
        old_pid = served.stats().engine_pid

        async def crowd() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=served.url, timeout=RECOVERY_DEADLINE_S) as http:
                tasks = [asyncio.create_task(_in_flight(http, i)) for i in range(24)]
                deadline = time.monotonic() + 60
                while (await asyncio.to_thread(served.stats)).num_running < 24:
                    assert time.monotonic() < deadline, "the crowd never got going"
                    await asyncio.sleep(0.05)
                os.kill(old_pid, signal.SIGKILL)
                async with asyncio.timeout(RECOVERY_DEADLINE_S):
                    return await asyncio.gather(*tasks)

        outcomes = asyncio.run(crowd())
        for outcome in outcomes:
            if outcome["status"] != 200:
                _check_unavailable(outcome["response"])  # before the first token: still an HTTP error
                continue
            assert outcome["stream"], "a whole answer cannot have finished: the requests were endless"
            events = outcome["events"]
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]  # mid-stream: an error event, then [DONE]
            assert error["type"] == "server_error" and "engine" in error["message"], error

        # Until the engine is back every answer is a 503 with Retry-After; then the same answer as before.
        seen_503 = 0
        deadline = time.monotonic() + RECOVERY_DEADLINE_S
        while True:
            assert time.monotonic() < deadline, "the server never got its engine back"
            response = httpx.post(f"{served.url}/v1/completions", json=probe, timeout=60)
            if response.status_code == 200:
                break
            _check_unavailable(response)
            seen_503 += 1
            time.sleep(0.2)
        assert seen_503 > 0  # a fresh engine takes seconds to start: the first request cannot have had one
        assert response.json()["choices"] == before["choices"]
        assert served.handle.running and served.stats().engine_pid != old_pid
        stream = httpx.post(f"{served.url}/v1/completions", json={**probe, "stream": True}, timeout=60)
        assert stream.status_code == 200 and sse_data(stream.text.splitlines())[-1] == "[DONE]"
        assert idle(served.wait_until(idle, timeout=10))


# -- the TUI ----------------------------------------------------------------------------------------


def _tiny_engine_app(tmp_path: Path, tiny_model: Path, runtime: Path, **kwargs: Any) -> Any:
    """The real app on the real engine process, with a tiny model in a private runtime dir."""
    from chatapp.engine.client import AsyncEngineClient
    from chatapp.engine.config import EngineConfig
    from chatapp.tui.app import ChatApp

    async def factory() -> AsyncEngineClient:
        return AsyncEngineClient(EngineConfig(model=str(tiny_model), num_kv_blocks=2048), runtime_dir=runtime)

    return ChatApp(
        settings_path=tmp_path / "settings.toml",
        history_path=tmp_path / "history.sqlite3",
        engine_factory=factory,
        session_sampling={"temperature": 0, "max_tokens": 24},
        **kwargs,
    )


async def test_tui_engine_killed_mid_stream_shows_it_and_restarts(tiny_model: Path, tmp_path: Path) -> None:
    from chatapp.tui.widgets.status_bar import StatusBar
    from tests.tui_helpers import answered, main_screen, panes, send, wait_for

    app = _tiny_engine_app(tmp_path, tiny_model, tmp_path / "runtime")
    async with app.run_test(size=(140, 40)) as pilot:
        bar = main_screen(app).query_one(StatusBar)
        await wait_for(pilot, lambda: bar.engine.state == "ready", "engine ready", steps=3000)
        pane = panes(app)[0]
        await send(pilot, pane, "First question")
        await wait_for(pilot, lambda: answered(pane), "first answer", steps=3000)
        reference = pane.conversation.leaf.content
        assert pane.conversation.leaf.status == "complete" and reference

        pane.config.sampling = {"temperature": 0, "max_tokens": ENDLESS}  # to the end of a 32k context
        await send(pilot, pane, "A question whose answer never ends")
        await wait_for(pilot, lambda: len(pane.conversation.leaf.content) > 20, "streaming", steps=3000)
        os.kill(app.engine.raw_client.engine_pid, signal.SIGKILL)
        await wait_for(pilot, lambda: answered(pane, 2), "the stream ended", steps=3000)
        cut = pane.conversation.leaf
        assert cut.status == "error" and cut.content  # the text so far is kept, and marked
        assert "engine" in (cut.error or "") and "died" in cut.error
        await wait_for(pilot, lambda: bar.engine.state == "dead", "dead shown", steps=3000)
        assert "F10 restarts" in str(bar.render())

        await pilot.press("f10")
        await wait_for(pilot, lambda: bar.engine.state == "ready", "restarted", steps=6000)
        pane.config.sampling = {"temperature": 0, "max_tokens": 24}
        await send(pilot, pane, "First question")
        await wait_for(pilot, lambda: answered(pane, 3), "an answer after the restart", steps=3000)
        assert pane.conversation.leaf.status == "complete"
        assert pane.conversation.leaf.content != ""
        await app.action_quit()


async def test_tui_and_its_api_port_restart_one_engine_whoever_asks_first(tiny_model: Path, tmp_path: Path) -> None:
    """The TUI shares its engine client with its API port, so after a kill both may restart it: the
    server when an editor retries, the user with the restart key. Pressed while the server's restart
    runs, the key must join it (one engine process, not two); when the server alone brought the engine
    back, the TUI must show it running again and answer, and a late key press must not end the
    server's streams."""
    import psutil

    from chatapp.tui.widgets.status_bar import StatusBar
    from tests.tui_helpers import answered, main_screen, panes, send, wait_for

    runtime = tmp_path / "runtime"

    def engine_pids() -> list[int]:
        return [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if "chatapp.engine.launch" in " ".join(p.info["cmdline"] or [])
            and str(runtime) in " ".join(p.info["cmdline"] or [])
        ]

    (tmp_path / "settings.toml").write_text('[server]\nhost = "127.0.0.1"\nport = 0\n')
    app = _tiny_engine_app(tmp_path, tiny_model, runtime)
    async with app.run_test(size=(140, 40)) as pilot:
        bar = main_screen(app).query_one(StatusBar)
        await wait_for(pilot, lambda: bar.engine.state == "ready", "engine ready", steps=3000)
        await pilot.press("f9")
        await wait_for(pilot, lambda: bar.server_url is not None, "API on", steps=3000)
        client = app.engine.raw_client
        body = {"prompt": "An editor retrying", "max_tokens": 4, "temperature": 0}

        async with httpx.AsyncClient(base_url=f"{bar.server_url}/v1", timeout=60) as http:

            async def retry_until_served() -> None:
                for _ in range(600):
                    response = await http.post("/completions", json=body)
                    if response.status_code == 200:
                        return
                    _check_unavailable(response)
                    await pilot.pause(0.2)
                raise AssertionError("the API never got its engine back")

            for user_presses_the_key in (True, False):
                old_pid = client.engine_pid
                os.kill(old_pid, signal.SIGKILL)
                await wait_for(pilot, lambda: bar.engine.state == "dead", "dead shown", steps=3000)
                _check_unavailable(await http.post("/completions", json=body))  # the server starts its restart
                if user_presses_the_key:
                    await pilot.press("f10")  # while the server's restart is under way
                await retry_until_served()
                await wait_for(pilot, lambda: bar.engine.state in ("ready", "busy"), "the TUI sees it back", steps=3000)
                assert engine_pids() == [client.engine_pid] and client.engine_pid != old_pid

            # A late press of the key (the engine runs) must leave a stream over the API alone.
            async with http.stream("POST", "/completions", json={**body, "max_tokens": 300, "stream": True}) as s:
                lines = s.aiter_lines()
                await anext(lines)
                await pilot.press("f10")
                await pilot.pause(0.5)
                events = sse_data([line async for line in lines])
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-2:]
        pane = panes(app)[0]
        await send(pilot, pane, "Still there?")
        await wait_for(pilot, lambda: answered(pane), "a TUI answer", steps=3000)
        assert pane.conversation.leaf.status == "complete"
        await app.action_quit()


# -- the history's disk fills up ------------------------------------------------------------------


def test_tui_with_a_full_disk_warns_keeps_the_chat_in_memory_and_loses_nothing_saved(tmp_path: Path) -> None:
    """A real write failure (EFBIG from RLIMIT_FSIZE, in a child process); see tests/tui_diskfull_app.py."""
    import json
    import sqlite3
    import subprocess
    import sys

    from tests.tui_diskfull_app import LONG, REPLY
    from tests.tui_helpers import make_app, panes, wait_for

    root = Path(__file__).resolve().parent.parent
    child = subprocess.run(
        [sys.executable, "-m", "tests.tui_diskfull_app", str(tmp_path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Traceback" not in child.stderr, child.stderr[-3000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen["in_memory"] == ["Saved first", REPLY, LONG, REPLY]  # the chat went on in memory
    assert seen["failing"] and "history not saved" in seen["status_bar"]
    notice = next(n for n in seen["notices"] if n.startswith("Could not save the chat history"))
    assert "disk" in notice and "in memory" in notice, notice

    conn = sqlite3.connect(tmp_path / "history.sqlite3")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    saved = [row[0] for row in conn.execute("SELECT content FROM messages ORDER BY id")]
    conn.close()
    assert saved[:2] == ["Saved first", REPLY]  # what was saved before the disk filled up is all there
    assert LONG not in saved

    async def reopen() -> list[str]:
        app = make_app(tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = panes(app)[0]
            await wait_for(pilot, lambda: pane.view_for(pane.conversation.leaf) is not None, "restored")
            shown = [m.content for m in pane.conversation.path()]
            await app.action_quit()
        return shown

    assert asyncio.run(reopen()) == ["Saved first", REPLY]
