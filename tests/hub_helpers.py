"""Fixtures' building blocks for tests that talk to the fake Hub."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests.fake_hub import FakeHub


def point_hf_at(hub_url: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Send huggingface_hub to ``hub_url`` with a private cache; returns the hub cache dir.

    huggingface_hub reads its environment once, at import, into
    ``huggingface_hub.constants``; so the constants are patched as well as the
    variables (which subprocesses and a fresh import would read).
    """
    from huggingface_hub import constants

    cache = home / "hub"
    env = {
        "HF_ENDPOINT": hub_url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub_url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub_url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # never this machine's real login
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    return cache


def run_cli(*argv: str) -> tuple[int, str, str]:
    """Run `chatapp ARGV` in this process; (exit code, stdout, stderr)."""
    from chatapp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse errors
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def with_config(model_dir: Path, **changes: object) -> dict[str, bytes]:
    """The files of ``model_dir`` with config.json fields changed."""
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    config = json.loads(files["config.json"])
    config.update(changes)
    files["config.json"] = json.dumps(config).encode()
    return files


def tiny_gguf(path: Path, arch: str = "llama", rows: int = 64) -> Path:
    """A few-KB GGUF file with a Llama-style header (enough for the store's facts, not for conversion)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tensor("token_embd.weight", np.arange(rows * 8, dtype=np.float16).reshape(rows, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["FakeHub", "point_hf_at", "run_cli", "with_config", "tiny_gguf"]
