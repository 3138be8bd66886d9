"""chatapp: a terminal chat application with its own local inference engine."""

import os as _os

# OpenMP threads that spin while waiting collapse when anything else wants the
# CPU (a TUI, a second engine client, a browser): on 2 cores a decode step got
# 3-7x slower. So they wait passively, after a short spin (a few microseconds).
# OpenMP now runs torch's own ops only; our C++ code (matmuls, attention, row
# loops) uses its own workers (chatapp/engine/csrc/worker_pool.h), which never
# wait for a thread that has not started. Both must be set before torch loads
# its OpenMP runtime, hence this package's very first import. A user's own
# settings win.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", "2000")

__version__ = "0.1.0"


def _resolve_with_store(spec: str | None):
    """The model store's resolver, handed to the engine (which never imports the store itself)."""
    from chatapp.engine.model_ref import ModelRef
    from chatapp.store import resolve_model

    resolved = resolve_model(spec)
    return ModelRef(resolved.name, resolved.path, resolved.source)


def _register_store() -> None:
    from chatapp.engine.model_ref import register_resolver

    register_resolver(_resolve_with_store, default_name="SmolLM2-135M-Instruct")  # store.BUNDLED_NAME


_register_store()
