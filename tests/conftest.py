"""Shared fixtures. Tests never touch the user's data, config or runtime dirs.

The cache dir is left alone on purpose: the bundled model's one-time
conversion is cached there and shared by every test run.
"""

from __future__ import annotations

# isort: off
import chatapp  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads (chatapp/__init__.py)
# isort: on

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test still running near its timeout has its asyncio tasks printed first (hang_report.py says why)."""
    from tests import hang_report

    done = hang_report.watch(item)
    try:
        yield
    finally:
        if done is not None:
            done.set()


@pytest.fixture(autouse=True, scope="session")
def _private_dirs(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("chatapp-home")
    for var in ("CHATAPP_DATA_DIR", "CHATAPP_CONFIG_DIR", "CHATAPP_RUNTIME_DIR", "CHATAPP_LOG_DIR"):
        os.environ[var] = str(base / var.lower())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (GQA 4:2) with the real SmolLM2 tokenizer."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory: pytest.TempPathFactory):
    """The bundled model behind a keyless OpenAI-compatible server, one per test module that asks."""
    from tests.server_harness import ServedEngine

    with ServedEngine(tmp_path_factory.mktemp("runtime"), {"kv_cache_memory_gib": 0.25}) as served:
        yield served


@pytest.fixture(scope="module")
def bundled_sdk(bundled_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{bundled_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bundled_model(bundled_server) -> str:
    return bundled_server.client.model_info.name
