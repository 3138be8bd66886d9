"""Structured output on the OpenAI port: ``response_format`` and vLLM's ``guided_*`` fields become
the engine's guided decoding (chatapp/engine/guided.py), checked here so that a bad schema, regex
or grammar is a 400 naming the problem before anything reaches the engine."""

from __future__ import annotations

from typing import Any

from chatapp.engine.guided import GuidedDecoding, GuidedDecodingError
from chatapp.server.errors import bad_request
from chatapp.server.schemas import SamplingFields

_GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def guided_decoding(body: SamplingFields) -> GuidedDecoding | None:
    """What the request asks its output to follow, or None for free text."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None:
        asked += _response_format(fmt)
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            asked.append((field, {kind: value}))
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"give one of {', '.join(p for p, _ in asked)}, not several", asked[1][0])
    param, fields = asked[0]
    try:
        spec = GuidedDecoding(**fields)
        spec.check()
    except (ValueError, GuidedDecodingError) as exc:
        raise bad_request(str(exc), param) from None
    return spec


def _response_format(fmt: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = fmt.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", {"json_object": True})]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request(
                "response_format json_schema needs a json_schema object with a schema", "response_format.json_schema"
            )
        # No schema at all: any JSON object (OpenAI requires one; some clients leave it out).
        schema = spec.get("schema")
        return [("response_format.json_schema", {"json_schema": schema} if schema else {"json_object": True})]
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format.type"
    )
