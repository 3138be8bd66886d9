"""`chatapp serve`: the engine and the HTTP server, without the TUI.

The server listens at once and answers 503 (with Retry-After) while the
model loads, so scripts can poll /health instead of guessing when it is up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatapp.engine.client import AsyncEngineClient

API_KEY_ENV = "CHATAPP_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the local OpenAI-compatible HTTP server (no TUI)",
        description="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/embeddings, /v1/models) on chatapp's shared engine.",
    )
    # SUPPRESS: `chatapp --model M serve` (the top-level option) must not be reset by this one's default.
    serve.add_argument(
        "--model",
        action="append",
        default=argparse.SUPPRESS,
        help="model name, directory or GGUF file (default: the bundled SmolLM2); repeat it to load several "
        "(the first is the default, requests naming no model run on it; any local model answers by name)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; anything else needs --api-key to be safe)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this key (Authorization: Bearer KEY, or x-api-key: KEY); default ${API_KEY_ENV}, else none",
    )
    serve.add_argument(
        "--cors-origin",
        dest="cors_origins",
        action="extend",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="allow browser pages from ORIGIN (repeatable; default: no CORS)",
    )
    from chatapp.cli import add_engine_options

    add_engine_options(serve, default=argparse.SUPPRESS)  # as --model: the top-level value survives
    serve.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from chatapp.server.exposure import exposure_warning

    warning = exposure_warning(args.host, args.api_key)
    if warning:
        bar = "!" * min(len(warning), 100)
        print(f"{bar}\n{warning}\n{bar}", file=sys.stderr, flush=True)
    return asyncio.run(_serve(args))


def _model_args(value: object) -> list[str]:
    """`--model` given once or more (serve's own option appends; the top-level one is a string)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return []


async def _load_more(client: AsyncEngineClient, models: list[str]) -> None:
    """The models beside the default one: preloaded by an engine this command spawned (then this only
    waits for them), loaded now by one it attached to."""
    for model in models:
        try:
            info = await client.load_model(model)
            print(f"Ready: {info.name}", flush=True)
        except Exception as exc:  # noqa: BLE001  one model that cannot load leaves the others serving
            print(f"chatapp serve: could not load {model}: {exc}", file=sys.stderr, flush=True)


async def _serve(args: argparse.Namespace) -> int:
    from chatapp.engine import startup_gc
    from chatapp.engine.client import AsyncEngineClient
    from chatapp.engine.config import EngineConfig
    from chatapp.settings import load_or_default

    settings, error = load_or_default()
    if error is not None:
        print(f"chatapp serve: {error} (running on the defaults)", file=sys.stderr)
    options = settings.engine.options(
        max_model_len=getattr(args, "max_model_len", None),
        kv_cache_memory_gib=getattr(args, "kv_cache_gib", None),
        memory_gib=getattr(args, "memory_gib", None),
    )
    models = _model_args(getattr(args, "model", None))
    default = models[0] if models else settings.default_model
    client = AsyncEngineClient(EngineConfig(model=default, preload=tuple(models[1:]), **options))
    client.add_state_listener(
        lambda state, detail: print(f"engine: {state}{': ' + detail if detail else ''}", file=sys.stderr, flush=True)
    )
    # The engine first: it loads while this process imports the HTTP server (~0.25 s: Starlette, uvicorn, our routes).
    starting = asyncio.create_task(client.start())
    await asyncio.wait({starting}, timeout=0.02)  # long enough to reach the engine's spawn
    from chatapp.server.run import start_server

    try:
        handle = await start_server(
            client,
            args.host,
            args.port,
            api_key=args.api_key,
            cors_origins=args.cors_origins,
            access_log=args.verbose,
            log_exposure=False,
        )
    except OSError as exc:
        print(f"chatapp serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await client.close()
        return 1
    print(f"Serving the OpenAI-compatible API at {handle.url}/v1 (Ctrl+C stops)", flush=True)
    startup_gc.release(freeze=True)  # this process's imports are done (cli.main held the collector for them)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    code = 0
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            if starting.exception() is not None:
                print(f"chatapp serve: the engine did not start: {starting.exception()}", file=sys.stderr)
                code = 1
            else:
                if client.model_mismatch:
                    print(f"chatapp serve: note: {client.model_mismatch}", file=sys.stderr)
                print(f"Ready: {client.model_info.name}", flush=True)
                preloading = asyncio.create_task(_load_more(client, models[1:]))
                try:
                    await stopping
                finally:
                    preloading.cancel()
    finally:
        starting.cancel()
        stopping.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await handle.stop()
        await client.close()
    return code
