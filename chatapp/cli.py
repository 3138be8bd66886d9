"""The `chatapp` command: the TUI by default, plus `serve` and `models` subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatapp", description="Chat with local models in your terminal.")
    parser.add_argument("--model", help="model name, directory or GGUF file (default: the bundled SmolLM2)")
    add_engine_options(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine activity")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from chatapp import cli_models

    cli_models.register(sub)
    _register_serve(sub)
    return parser


def add_engine_options(parser: argparse.ArgumentParser, default: object = None) -> None:
    """--max-model-len, --kv-cache-gib and --memory-gib (over settings.toml's [engine]); used when the
    engine starts."""
    parser.add_argument(
        "--max-model-len",
        type=_positive(int),
        default=default,
        metavar="TOKENS",
        help="context length in tokens (default: settings, else the model's own, held to memory)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=_positive(float),
        default=default,
        metavar="GIB",
        help="the most memory the KV cache may take (default: settings, else sized to the context)",
    )
    parser.add_argument(
        "--memory-gib",
        type=_positive(float),
        default=default,
        metavar="GIB",
        help="the most memory all loaded models together may take; the least recently used idle one "
        "is unloaded for room (default: settings, else the memory available)",
    )


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _register_serve(sub: argparse._SubParsersAction) -> None:
    from chatapp.server.cli import register

    register(sub)


def _prestart_engine() -> None:
    """The TUI and `chatapp serve` start the engine process first, so its imports run while theirs do."""
    from chatapp import paths
    from chatapp.engine import prestart

    try:
        prestart.start(paths.runtime_dir())
    except OSError:  # no runtime directory: the client says so when it tries to spawn
        return


TOP_LEVEL_VALUE_OPTIONS = frozenset({"--model", "--max-model-len", "--kv-cache-gib", "--memory-gib"})
"""The top-level options that take a value (tests/test_server_cli.py checks this against the parser)."""


def starts_engine(argv: list[str]) -> bool:
    """Whether the command line runs the TUI or `serve` (which start the engine), read from the words
    before the parser is built: ~0.05 s sooner for the engine's start. A wrong guess costs little: an
    engine process nobody takes exits by itself."""
    if "-h" in argv or "--help" in argv:
        return False
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-"):
            return word == "serve"  # the subcommand
        i += 2 if word in TOP_LEVEL_VALUE_OPTIONS else 1
    return True  # no subcommand: the TUI


def main(argv: list[str] | None = None) -> int:
    from chatapp.engine import startup_gc

    if starts_engine(sys.argv[1:] if argv is None else argv):
        startup_gc.hold()  # released once the TUI's first screen is up, or `serve` listens
        _prestart_engine()
    try:
        return _run(argv)
    finally:
        startup_gc.release()


def _run(argv: list[str] | None) -> int:
    from chatapp.logs import log_to_file, log_to_terminal

    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    try:
        if handler is not None:
            log_to_terminal(args.verbose)
            return int(handler(args) or 0)
        log_to_file(args.verbose)  # Textual owns the terminal
        from chatapp.tui.app import run

        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
