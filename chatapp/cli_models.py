"""`chatapp models ...`: list, pull, remove, inspect, add and search models.

Every failure reaches the user as one line on stderr (`error: ...`) and a
non-zero exit code; the traceback is logged only with `chatapp -v`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from chatapp.model_facts import estimate_for, format_bytes, format_count

log = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace], int]


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser(
        "models", help="list, pull, remove and inspect models", description="Manage the models chatapp can run."
    )
    models.set_defaults(handler=lambda args: models.print_help())
    cmds = models.add_subparsers(dest="models_command", metavar="ACTION")

    p = cmds.add_parser("list", help="the bundled model, Hugging Face cache models and added paths")
    p.set_defaults(handler=_guarded(cmd_list))

    p = cmds.add_parser("info", help="everything known about one model")
    p.add_argument("name", help="a name from `chatapp models list`")
    p.set_defaults(handler=_guarded(cmd_info))

    p = cmds.add_parser("pull", help="download a model from the Hugging Face Hub")
    p.add_argument("spec", metavar="REPO[:FILE]", help="owner/name, or owner/name:file.gguf for one GGUF file")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--force", action="store_true", help="download even if the memory estimate says it will not fit")
    p.set_defaults(handler=_guarded(cmd_pull))

    p = cmds.add_parser("rm", help="delete a downloaded model, or forget an added path")
    p.add_argument("name", help="a name from `chatapp models list`")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=_guarded(cmd_rm))

    p = cmds.add_parser("add", help="remember a local model directory or GGUF file")
    p.add_argument("path")
    p.set_defaults(handler=_guarded(cmd_add))

    p = cmds.add_parser("search", help="search the Hub for text-generation models chatapp can run")
    p.add_argument("query", nargs="?", default="")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(handler=_guarded(cmd_search))


def _guarded(handler: Handler) -> Handler:
    """Turn every error into one line and exit code 1 (Ctrl-C is left to chatapp.cli)."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from chatapp.engine.models.config import UnsupportedModelError
        from chatapp.hub import HubError, explain
        from chatapp.store import ModelNotFoundError, ModelStoreError

        try:
            return handler(args)
        except (HubError, ModelNotFoundError, ModelStoreError, UnsupportedModelError) as e:
            _error(str(e))
        except OSError as e:
            message = explain(e)
            _error(message or (f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)))
            log.info("details", exc_info=True)
        except Exception as e:  # a bug: still one line, with the details behind -v
            _error(explain(e) or f"unexpected {type(e).__name__}: {e} (run `chatapp -v ...` for details)")
            log.info("details", exc_info=True)
        return 1

    return run


def _error(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _status(facts: Any) -> str:
    return "ok" if facts.supported else f"unsupported: {facts.reason}"


def cmd_list(args: argparse.Namespace) -> int:
    from chatapp.model_facts import available_memory
    from chatapp.store import list_models

    available = available_memory()
    rows = []
    for m in list_models():
        f = m.facts
        estimate = estimate_for(f, available_bytes=available) if f.supported else None
        memory = f"{format_bytes(estimate.total_bytes)} ({estimate.label})" if estimate else "?"
        rows.append(
            [
                m.name,
                m.source,
                f.architecture or f.family or "?",
                format_count(f.parameters),
                format_bytes(m.size_bytes),
                f.quantization or "?",
                str(f.context_length) if f.context_length else "?",
                memory,
                _status(f),
            ]
        )
    print(_table(rows, ["NAME", "SOURCE", "ARCHITECTURE", "PARAMS", "SIZE", "QUANT", "CONTEXT", "MEMORY", "STATUS"]))
    # On stderr: stdout stays one table for scripts to parse.
    print(
        f"MEMORY: weights + KV cache at the model's context (held to what fits); "
        f"{format_bytes(available)} available now",
        file=sys.stderr,
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from chatapp.store import find_model

    m = find_model(args.name)
    f = m.facts
    estimate = estimate_for(f)
    lines = [
        ("name", m.name),
        ("source", m.source),
        ("path", str(m.path)),
        ("repo", f"{m.repo_id} @ {m.revision}" if m.repo_id else None),
        ("architecture", f.architecture),
        ("family", f.family),
        ("parameters", f"{format_count(f.parameters)} ({f.parameters:,})" if f.parameters else None),
        ("quantisation", f.quantization),
        ("context length", str(f.context_length) if f.context_length else None),
        ("size on disk", format_bytes(m.size_bytes)),
        ("supported", "yes" if f.supported else f"no: {f.reason}"),
        ("memory", estimate.describe() if estimate else None),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        if value is not None:
            print(f"{key.ljust(width)}  {value}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from chatapp import hub

    plan = hub.plan_pull(args.spec, revision=args.revision)
    print(f"{plan.name} @ {plan.commit[:12]}: {len(plan.files)} files, {format_bytes(plan.total_bytes)}")
    if plan.estimate:
        print(f"memory: {plan.estimate.describe()}")
    hub.check_plan(plan, force=args.force)
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    again = f"run `chatapp models pull {args.spec}` again to continue"
    need = hub.bytes_to_download(plan)
    with tqdm(
        total=plan.total_bytes,
        initial=plan.total_bytes - need,
        unit="B",
        unit_scale=True,
        desc=f"pulling {plan.name}",
        disable=None,
    ) as bar:  # None: only on a terminal
        try:
            path = hub.download_plan(plan, progress=bar.update)
        except KeyboardInterrupt:
            bar.close()
            _error(f"interrupted; {again}")
            return 130
        except hub.HubError as e:
            bar.close()
            raise hub.HubError(f"{e}; {again}") from e
    print(f"pulled {plan.name} into {path}")
    if plan.gguf_file and plan.facts is None:
        # The Hub said nothing about this GGUF file: its own header tells us now.
        from chatapp.model_facts import facts_from_gguf

        facts = facts_from_gguf(path)
        if not facts.supported:
            _error(f"chatapp cannot run {plan.name}: {facts.reason}; remove it with `chatapp models rm {plan.name}`")
            return 1
        estimate = estimate_for(facts)
        if estimate:
            print(f"memory: {estimate.describe()}")
    print(f"run it with: chatapp --model {plan.name}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from chatapp.store import find_model, plan_removal

    removal = plan_removal(find_model(args.name))
    if removal.deletes_files and not args.yes:
        if not sys.stdin.isatty():
            _error(f"would {removal.summary}; not deleting without confirmation: pass --yes")
            return 1
        answer = input(f"This will {removal.summary}. Continue? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    removal.execute()
    print(f"done: {removal.summary}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from chatapp.store import find_model, remember_path

    path = remember_path(args.path)
    m = find_model(str(path))
    print(f"added {path} ({m.facts.architecture or m.facts.family or 'unknown architecture'}, {_status(m.facts)})")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from chatapp.hub import search_models

    results = search_models(args.query, limit=args.limit)
    rows = [
        [
            r.repo_id,
            r.format,
            r.architecture or "?",
            format_count(r.parameters),
            f"{r.downloads:,}" if r.downloads is not None else "?",
            format_bytes(r.estimate.total_bytes) if r.estimate else "?",
            r.label + (" (gated)" if r.gated else ""),
        ]
        for r in results
    ]
    print(_table(rows, ["REPO", "FORMAT", "ARCHITECTURE", "PARAMS", "DOWNLOADS", "MEMORY", "FIT"]))
    return 0
