"""chatapp's inference engine: paged KV cache, prefix caching, FCFS scheduling with preemption.

The public names load on first use (PEP 562), so a light client can import a small module of
this package (model_ref, api, ipc) without loading torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EngineConfig": "chatapp.engine.config",
    "LLM": "chatapp.engine.llm",
    "RequestOutput": "chatapp.engine.outputs",
    "CompletionOutput": "chatapp.engine.outputs",
    "SamplingParams": "chatapp.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if name == "LLM":  # the engine in this process: numpy's BLAS threads would spin against its workers
            from chatapp.engine.blas_threads import import_numpy_with_one_blas_thread

            import_numpy_with_one_blas_thread()
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'chatapp.engine' has no attribute {name!r}")
