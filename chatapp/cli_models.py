"""`chatapp models ...`: list, pull, remove and inspect models (see the model-store issue)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="list, pull, remove and inspect models")
    models.set_defaults(handler=lambda args: models.print_help())
