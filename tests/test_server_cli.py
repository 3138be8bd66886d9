"""`chatapp serve` (issue 6): arguments, the exposure warning, and a real run in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from chatapp.cli import build_parser
from chatapp.engine import ipc, prestart
from chatapp.server import cli as serve_cli
from chatapp.server.run import exposure_warning

pytestmark = pytest.mark.timeout(180)


def test_serve_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.cors_origins) == ("127.0.0.1", 8000, None, [])
    assert getattr(args, "model", None) is None
    assert build_parser().parse_args(["--model", "m1", "serve"]).model == "m1"
    assert serve_cli._model_args(build_parser().parse_args(["serve", "--model", "m2"]).model) == ["m2"]
    both = build_parser().parse_args(["serve", "--model", "m2", "--model", "m3", "--memory-gib", "6"])
    assert serve_cli._model_args(both.model) == ["m2", "m3"] and both.memory_gib == 6.0
    assert serve_cli._model_args(build_parser().parse_args(["--model", "m1", "serve"]).model) == ["m1"]
    args = build_parser().parse_args(["serve", "--cors-origin", "http://a", "http://b", "--cors-origin", "http://c"])
    assert args.cors_origins == ["http://a", "http://b", "http://c"]
    monkeypatch.setenv(serve_cli.API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_exposure_warning_only_for_non_loopback_without_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    assert "WITHOUT an API key" in exposure_warning("0.0.0.0", None)
    assert "WITHOUT an API key" in exposure_warning("192.168.1.5", None)

    async def no_serve(args: object) -> int:
        return 0

    monkeypatch.setattr(serve_cli, "_serve", no_serve)
    assert serve_cli.run(build_parser().parse_args(["serve", "--host", "0.0.0.0"])) == 0
    assert "WARNING: serving on 0.0.0.0 WITHOUT an API key" in capsys.readouterr().err
    assert serve_cli.run(build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"])) == 0
    assert capsys.readouterr().err == ""


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "CHATAPP_RUNTIME_DIR": str(tmp_path / "runtime"), "PYTHONUNBUFFERED": "1"}


def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "chatapp", "serve", "--port", str(port)],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr


def test_serve_runs_the_engine_and_the_api_until_interrupted(tiny_llama: Path, tmp_path: Path) -> None:
    """Two models preloaded (issue 19): both answer by name; the first is the default."""
    from tests.tiny_model import make_tiny_model

    second = make_tiny_model(tmp_path / "second-tiny", seed=7)
    command = ["serve", "--model", str(tiny_llama), "--model", str(second), "--port", "0", "--api-key", "k"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatapp", *command],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", first)
        assert match, first
        url = match.group(1)
        loading = httpx.get(f"{url}/health")  # it listens at once, while the engine starts
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health").status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.25)
        # The engine is the one `chatapp serve` started before its own imports (prestart.py).
        record = ipc.read_record(tmp_path / "runtime")
        assert record is not None and prestart.CONFIG_FROM_STDIN in psutil.Process(record.pid).cmdline()
        sdk = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        answer = sdk.chat.completions.create(
            model=tiny_llama.name, max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.usage.completion_tokens == 3
        printed = [proc.stdout.readline()]
        while f"Ready: {second.name}" not in printed[-1]:
            assert proc.poll() is None and time.monotonic() < deadline
            printed.append(proc.stdout.readline())
        listed = {m.id: m for m in sdk.models.list().data}
        assert listed[second.name].loaded is True and next(iter(listed)) == tiny_llama.name
        other = sdk.chat.completions.create(
            model=second.name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert other.model == second.name and other.usage.completion_tokens == 2
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"Ready: {tiny_llama.name}" in "".join(printed) and "Traceback" not in err


def test_a_model_with_a_broken_tokenizer_file_is_a_clear_error_without_a_traceback(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The client's tokenizer preload fails as the engine's load does; asyncio used to print that preload's
    unretrieved exception, traceback and all, and the engine's message did not name the file."""
    import shutil

    broken = shutil.copytree(tiny_llama, tmp_path / "cut-download")
    text = (broken / "tokenizer.json").read_bytes()
    (broken / "tokenizer.json").write_bytes(text[: len(text) // 2])
    done = subprocess.run(
        [sys.executable, "-m", "chatapp", "serve", "--model", str(broken), "--port", "0"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"{broken / 'tokenizer.json'} cannot be read" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--model", "serve"], True),  # a model named like the subcommand: still the TUI
        (["--model=x.gguf", "-v"], True),
        (["serve", "--port", "0"], True),
        (["--max-model-len", "4096", "serve"], True),
        (["models", "list"], False),
        (["--model", "m", "models", "rm", "m"], False),
        (["serve", "--help"], False),
        (["-h"], False),
    ],
)
def test_the_engine_is_started_early_only_for_the_tui_and_serve(argv: list[str], expected: bool) -> None:
    from chatapp.cli import starts_engine

    assert starts_engine(argv) is expected


def test_the_early_reading_knows_every_top_level_option_that_takes_a_value() -> None:
    from chatapp.cli import TOP_LEVEL_VALUE_OPTIONS

    parser = build_parser()
    takes_value = {
        option
        for action in parser._actions
        if action.option_strings and action.nargs != 0
        for option in action.option_strings
    }
    assert takes_value == TOP_LEVEL_VALUE_OPTIONS


def test_the_collector_is_held_off_while_serve_starts_and_resumes_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """startup_gc.py: the start's imports run without cyclic collection; it resumes once serve listens
    (here: when its handler returns)."""
    import gc

    from chatapp import cli

    seen: list[bool] = []
    monkeypatch.setattr(cli, "_prestart_engine", lambda: None)  # no engine process from a unit test
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(gc.isenabled()) or 0)
    try:
        assert cli.main(["serve", "--port", "0"]) == 0
        assert seen == [False]
        assert gc.isenabled()
    finally:
        gc.enable()


def test_startup_gc_resumes_only_what_it_stopped() -> None:
    import gc

    from chatapp.engine import startup_gc

    gc.disable()  # turned off by someone else: hold() does not take it over, release() leaves it off
    try:
        startup_gc.hold()
        assert not startup_gc.held()
        startup_gc.release()
        assert not gc.isenabled()
    finally:
        gc.enable()
    startup_gc.hold()
    try:
        assert startup_gc.held() and not gc.isenabled()
    finally:
        startup_gc.release()
    assert gc.isenabled() and not startup_gc.held()


def test_a_frozen_start_is_left_alone_until_a_model_is_dropped() -> None:
    """release(freeze=True) puts what the start made out of the collector's reach (no ~80 ms walk of it
    between an engine's load and its "ready"); a model dropped later is freed even if it holds a cycle
    frozen with the start (collect_everything, as the engine's switch and unload call it)."""
    import gc
    import weakref

    from chatapp.engine import startup_gc

    class Model:
        me: object

    startup_gc.hold()
    try:
        assert startup_gc.held()
        model = Model()
        model.me = model  # a cycle: reference counting alone never frees it
        alive = weakref.ref(model)
        frozen = gc.get_freeze_count()
        startup_gc.release(freeze=True)
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        del model
        gc.collect()
        assert alive() is not None, "frozen objects are not walked by the collector"
        startup_gc.collect_everything()
        assert alive() is None
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()
