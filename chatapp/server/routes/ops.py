"""GET /health (for probes and the TUI) and GET /metrics (Prometheus text format)."""

from __future__ import annotations

from starlette.responses import JSONResponse, PlainTextResponse

from chatapp.engine.api import EngineBusyError, EngineDeadError, EngineStats
from chatapp.server.errors import RETRY_AFTER_SECONDS
from chatapp.server.probe import SERVER_NAME
from chatapp.server.routing import Router
from chatapp.server.state import ServerState

health_router = Router()
metrics_router = Router()

# (EngineStats field, metric name, type, help)
_METRICS = [
    ("num_running", "chatapp_requests_running", "gauge", "Requests being generated now."),
    ("num_waiting", "chatapp_requests_waiting", "gauge", "Requests queued for a place in the batch."),
    ("kv_blocks_used", "chatapp_kv_cache_blocks_used", "gauge", "KV cache blocks in use."),
    ("kv_blocks_total", "chatapp_kv_cache_blocks_total", "gauge", "KV cache blocks in the pool."),
    (
        "prefix_cache_hit_rate",
        "chatapp_prefix_cache_hit_rate",
        "gauge",
        "Share of prompt tokens found in the prefix cache.",
    ),
    ("prefix_cache_queries", "chatapp_prefix_cache_queries_total", "counter", "Prompt tokens looked up."),
    ("prefix_cache_hits", "chatapp_prefix_cache_hits_total", "counter", "Prompt tokens found in the cache."),
    ("num_preemptions", "chatapp_preemptions_total", "counter", "Requests preempted to free KV blocks."),
    ("prompt_tokens_total", "chatapp_prompt_tokens_total", "counter", "Prompt tokens processed."),
    ("generation_tokens_total", "chatapp_generation_tokens_total", "counter", "Tokens generated."),
    (
        "forward_seconds_total",
        "chatapp_forward_seconds_total",
        "counter",
        "Seconds in the model's forward pass (and LM head).",
    ),
    (
        "step_seconds_total",
        "chatapp_step_seconds_total",
        "counter",
        "Seconds in engine steps: the forward plus scheduling, input preparation and sampling.",
    ),
    (
        "busy_loop_seconds_total",
        "chatapp_busy_loop_seconds_total",
        "counter",
        "Seconds the engine loop spent while it had work: steps plus IPC and housekeeping.",
    ),
    (
        "generation_tokens_per_second",
        "chatapp_generation_tokens_per_second",
        "gauge",
        "Generation speed over the last seconds of work.",
    ),
]


async def _engine_stats(state: ServerState) -> tuple[str, EngineStats | None]:
    """(phase, stats): asks the engine itself, so a dead engine is noticed (and restarted) here too."""
    phase = state.phase
    if phase == "dead":
        state.engine_died()
        phase = state.phase
    if phase != "ready" or state.client is None:
        return phase, None
    try:
        return "ready", await state.client.stats()
    except EngineDeadError:
        state.engine_died()
        return "restarting" if state.phase == "restarting" else "dead", None
    except EngineBusyError:
        return "loading", None


@health_router.get("/health", errors=(503,))
async def health(state: ServerState) -> JSONResponse:
    """200 once the engine is ready; 503 with Retry-After while it loads or restarts."""
    phase, _ = await _engine_stats(state)
    body = {"status": "ok" if phase == "ready" else phase, "model": state.model_id(), "server": SERVER_NAME}
    if phase == "ready":
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@metrics_router.get("/metrics", text=True)
async def metrics(state: ServerState) -> PlainTextResponse:
    """The engine's counters in Prometheus' text format."""
    phase, stats = await _engine_stats(state)
    labels = f'{{model="{_label(state.model_id())}"}}'
    lines = [
        "# HELP chatapp_engine_ready 1 when the engine takes requests, else 0.",
        "# TYPE chatapp_engine_ready gauge",
        f"chatapp_engine_ready{labels} {int(phase == 'ready')}",
    ]
    for key, name, kind, help_text in _METRICS:
        if stats is None:
            continue
        value = float(getattr(stats, key))
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {value!r}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
