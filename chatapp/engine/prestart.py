"""Start the engine process before the client that will use it has finished starting itself.

Why: a client spends ~0.2 s importing its own modules and reading settings before it knows the engine
config it will spawn with, and the engine spends ~0.2 s importing its modules before it can begin
loading. Started first, the engine imports on the other core meanwhile, then waits on its stdin for
the config; the client hands it over when it decides to spawn (client.py `_spawn`), or closes the
pipe when it attaches to an engine that is already running, and the waiting process exits.

This module imports nothing heavy: it runs before the client's imports.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

DISCOVERY_FILE = "engine.json"  # ipc.DISCOVERY_FILE (not imported: ipc loads msgspec)
LOCK_FILE = "engine.lock"  # ipc.LOCK_FILE
LOG_FILE = "engine.log"  # ipc.LOG_FILE
CONFIG_FROM_STDIN = "--config-stdin"

_waiting: tuple[Path, subprocess.Popen[bytes]] | None = None


def start(runtime: Path) -> subprocess.Popen[bytes] | None:
    """Start an engine process that waits for its config, unless an engine seems to run already
    (its discovery record exists: then the client attaches, or spawns as usual if the record is stale).
    Returns the waiting process (None when none was started)."""
    global _waiting
    if _waiting is not None or (runtime / DISCOVERY_FILE).exists():
        return None
    _rotate_unless_spawning(runtime)
    log_fd = os.open(runtime / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatapp.engine.launch", CONFIG_FROM_STDIN, "--runtime-dir", str(runtime)],
            stdin=subprocess.PIPE,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        return None  # the client spawns one itself, and reports what is wrong
    finally:
        os.close(log_fd)
    _waiting = (runtime, proc)
    return proc


def rotate_log(log_path: Path, max_bytes: int = 5 * 2**20) -> None:
    """Keep one previous engine log (engine.log.1), before an engine is started with no engine running."""
    with contextlib.suppress(OSError):
        if log_path.stat().st_size > max_bytes:
            log_path.replace(log_path.with_name(log_path.name + ".1"))


def _rotate_unless_spawning(runtime: Path) -> None:
    """rotate_log, unless another client holds the discovery lock: it may be spawning an engine that
    writes to the current log (and reads its tail to report a failed start)."""
    try:
        fd = os.open(runtime / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rotate_log(runtime / LOG_FILE)
    except BlockingIOError:
        return
    finally:
        os.close(fd)  # releases the lock


def take(runtime: Path, config_json: str) -> subprocess.Popen[bytes] | None:
    """The waiting engine for this runtime directory, handed its config; None when there is none
    (or it died meanwhile), and the client spawns one itself."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is None:
        return None
    where, proc = waiting
    if where != runtime or proc.poll() is not None:
        _dismiss(proc)
        return None
    assert proc.stdin is not None
    try:
        proc.stdin.write(config_json.encode())
        proc.stdin.close()
    except OSError:  # it died between poll() and the write
        _dismiss(proc)
        return None
    return proc


def dismiss() -> None:
    """Let a waiting engine go (the client attached to a running one): it exits on its closed stdin."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None:
        _dismiss(waiting[1])


def _dismiss(proc: subprocess.Popen[bytes]) -> None:
    """Close its stdin; it exits once its imports are done, and a thread waits for it (no zombie is
    left for the client's lifetime)."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    threading.Thread(target=proc.wait, name="prestarted-engine-reaper", daemon=True).start()
