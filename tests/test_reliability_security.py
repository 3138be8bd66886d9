"""Security (issue 9): where the server listens, what the API key guards, who may use the engine's
socket, and that a model name sent over HTTP never opens a file. Tiny random model.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import inspect
import os
import socket
import stat
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from chatapp.engine import ipc
from tests.reliability_helpers import error_of
from tests.server_harness import ServedEngine

pytestmark = pytest.mark.timeout(180)

KEY = "security-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "TOP-SECRET-0123456789"
NOBODY = 65534


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-sec"), max_position_embeddings=1024)
    # The runtime dir sits in a directory anyone may enter, so only its own modes keep others out.
    open_parent = Path(tempfile.mkdtemp(prefix="chatapp-sec-", dir="/tmp"))
    open_parent.chmod(0o755)
    with ServedEngine(open_parent / "runtime", {"model": str(model), "num_kv_blocks": 128}, api_key=KEY) as se:
        yield se


# -- listening -----------------------------------------------------------------------------------


def test_the_server_listens_on_loopback_unless_told_otherwise() -> None:
    from chatapp.cli import build_parser
    from chatapp.server import start_server

    assert inspect.signature(start_server).parameters["host"].default == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"

    async def listen() -> tuple[str, list[int]]:
        handle = await start_server(None, port=0)  # every default but the port
        try:
            refused = []
            for addrs in psutil.net_if_addrs().values():
                for addr in addrs:  # this machine's other addresses: nothing must answer there
                    if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                        with socket.socket() as probe:
                            probe.settimeout(2)
                            refused.append(probe.connect_ex((addr.address, handle.port)))
            return handle.host, refused
        finally:
            await handle.stop()

    host, refused = asyncio.run(listen())
    assert host == "127.0.0.1"
    assert all(code == errno.ECONNREFUSED for code in refused), refused


# -- the API key --------------------------------------------------------------------------------


def _routes(served: ServedEngine) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""

    out = []
    for route in served.handle.app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            out.append((method, route.path.replace("{model_id:path}", "some-model")))
    assert out, "no routes found: has Starlette changed how it stores them?"
    return out


def test_every_route_but_health_needs_the_key(served: ServedEngine) -> None:
    routes = _routes(served)
    paths = {path for _, path in routes}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/metrics",
        "/openapi.json",
        "/health",
    } <= paths, paths
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"x-api-key": "wrong"},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": KEY},
        ):
            response = httpx.request(method, served.url + path, headers=headers, json={}, timeout=30)
            if path == "/health":
                assert response.status_code == 200, response.text
                continue
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert error_of(response)["code"] in ("missing_api_key", "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/docs", "/redoc"):  # no key can be sent from a browser page: not served with a key
        assert httpx.get(served.url + path, headers=AUTH).status_code == 404
    described = httpx.get(f"{served.url}/openapi.json", headers=AUTH)
    assert described.status_code == 200 and "/v1/chat/completions" in described.json()["paths"]


def test_the_key_is_compared_in_constant_time(served: ServedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatapp.server import auth

    calls: list[tuple[Any, Any]] = []
    compare_digest = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert httpx.get(f"{served.url}/v1/models", headers={"Authorization": "Bearer not-it"}).status_code == 401
    assert httpx.get(f"{served.url}/v1/models", headers=AUTH).status_code == 200
    assert calls == [(b"not-it", KEY.encode()), (KEY.encode(), KEY.encode())]


# -- the engine's socket ------------------------------------------------------------------------


def _as_nobody(fn: Any) -> int:
    """Run ``fn()`` in a child process that has become user and group "nobody"; its int result comes back."""
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only the check and _exit
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _connect(path: str) -> int:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
        return 0
    except OSError as exc:
        return exc.errno or 98


def _read(path: Path) -> int:
    try:
        path.read_bytes()
        return 0
    except OSError as exc:
        return exc.errno or 98


def test_another_user_cannot_use_the_engine_socket(served: ServedEngine) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test plays another user and needs root (the test suite runs as root)")
    runtime = served.runtime_dir
    record = ipc.read_record(runtime)
    assert record is not None and record.pid == served.client.engine_pid
    sock_path = record.socket.removeprefix("ipc://")
    assert _connect(sock_path) == 0  # the owner can (so the check below can tell the difference)
    assert _as_nobody(lambda: _connect(sock_path)) == errno.EACCES
    assert _as_nobody(lambda: _read(runtime / ipc.DISCOVERY_FILE)) == errno.EACCES
    assert _as_nobody(lambda: _read(Path(record.log_path))) == errno.EACCES
    # Two locks, each enough alone: the private directory and the socket's own mode.
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600


# -- model names over HTTP ---------------------------------------------------------------------


def test_a_model_name_never_opens_a_file(
    served: ServedEngine, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.tiny_model import make_tiny_model

    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    another_model = make_tiny_model(tmp_path_factory.mktemp("another-model"), max_position_embeddings=1024)
    loaded = served.client.model_info
    names = [
        "/etc/passwd",
        "../../secret",
        "../../../../../../etc/shadow",
        str(secret),
        os.path.relpath(secret),
        f"file://{secret}",
        "~root/.bashrc",
        str(tmp_path),
        str(another_model),
        another_model.name,
        "/proc/self/environ",
        "\\..\\..\\windows\\win.ini",
    ]
    user = [{"role": "user", "content": "hi"}]
    for name in names:
        for path, body in (
            ("/v1/chat/completions", {"model": name, "messages": user, "max_tokens": 1}),
            ("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1}),
            ("/v1/embeddings", {"model": name, "input": "hi"}),
        ):
            response = httpx.post(served.url + path, json=body, headers=AUTH, timeout=30)
            assert response.status_code == 404, (name, path, response.text)
            assert error_of(response)["param"] == "model"
            assert SECRET not in response.text and "root:" not in response.text
        card = httpx.get(f"{served.url}/v1/models/{urllib.parse.quote(name, safe='')}", headers=AUTH)
        assert card.status_code == 404, (name, card.text)
        assert SECRET not in card.text and "root:" not in card.text
    assert served.client.model_info == loaded  # nothing else was loaded behind everyone's back
    assert served.stats().model == loaded.name


def test_the_runtime_directory_must_be_ours_and_its_fallback_is_not_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from chatapp import paths

    monkeypatch.delenv("CHATAPP_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # platformdirs falls back to /tmp/runtime-UID
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fallback = paths.runtime_dir()
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    theirs = tmp_path / "made-by-someone-else"
    theirs.mkdir()
    monkeypatch.setenv("CHATAPP_RUNTIME_DIR", str(theirs))
    monkeypatch.setattr(os, "getuid", lambda: theirs.stat().st_uid + 1)  # as another user would see it
    with pytest.raises(PermissionError, match="belongs to another user; set CHATAPP_RUNTIME_DIR"):
        paths.runtime_dir()
