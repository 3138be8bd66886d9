"""What the model screen lists and fetches, behind a small interface.

:class:`HubCatalog` is the real one, built on the model store
(``chatapp.store``: local models) and the Hub client (``chatapp.hub``:
search, pull). Tests give the screen a catalog with fixed entries, so what it
shows does not depend on the machine's caches or the network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

Progress = Callable[[int], None]
"""Called from the download thread with each number of bytes received."""


@dataclass(frozen=True)
class LocalEntry:
    name: str
    """What ``switch_model`` and ``--model`` accept."""
    source: str
    size_bytes: int | None
    details: str
    """Architecture, parameters, quantisation; or why it cannot run."""
    runnable: bool = True


@dataclass(frozen=True)
class HubEntry:
    repo_id: str
    downloads: int | None
    size_bytes: int | None
    """Weights as the engine holds them (float32), when known."""
    label: str
    """"fits", "will be slow", "will not fit" or "size unknown"."""


@dataclass(frozen=True)
class PullSize:
    name: str
    total_bytes: int


class ModelCatalog(Protocol):
    def list_local(self) -> list[LocalEntry]: ...

    def search(self, query: str) -> list[HubEntry]: ...

    def plan(self, spec: str) -> PullSize:
        """Check a pull can go ahead (supported, fits on disk); raise ValueError-like errors saying why not."""

    def pull(self, spec: str, progress: Progress) -> str:
        """Download; returns the name to switch to. Runs in a thread."""


class HubCatalog:
    """The real catalog: the local model store and the Hugging Face Hub."""

    def list_local(self) -> list[LocalEntry]:
        from chatapp import store
        from chatapp.model_facts import available_memory, estimate_for, format_bytes, format_count

        available = available_memory()
        entries = []
        for m in store.list_models():
            f = m.facts
            estimate = estimate_for(f, available_bytes=available)
            memory = (
                f"needs {format_bytes(estimate.total_bytes)} of {format_bytes(available)} free ({estimate.label})"
                if estimate
                else None
            )
            bits = [
                b
                for b in (
                    f.architecture,
                    format_count(f.parameters) + " params" if f.parameters else None,
                    f.quantization,
                    memory,
                )
                if b
            ]
            details = ", ".join(bits) if f.supported else f"cannot run: {f.reason}"
            entries.append(LocalEntry(m.name, m.source, m.size_bytes, details, f.supported))
        return entries

    def search(self, query: str) -> list[HubEntry]:
        from chatapp import hub

        return [
            HubEntry(r.repo_id, r.downloads, r.estimate.weights_bytes if r.estimate else None, r.label)
            for r in hub.search_models(query)
        ]

    def plan(self, spec: str) -> PullSize:
        from chatapp import hub

        plan = hub.plan_pull(spec)
        hub.check_plan(plan)
        return PullSize(plan.name, hub.bytes_to_download(plan))

    def pull(self, spec: str, progress: Progress) -> str:
        from chatapp import hub

        plan = hub.plan_pull(spec)
        hub.check_plan(plan)
        hub.download_plan(plan, progress=progress)
        return plan.name
