"""POST /v1/embeddings: mean-pooled, L2-normalised final hidden states of the loaded model."""

from __future__ import annotations

import base64
import struct
from typing import Any

from starlette.requests import Request

from chatapp.server import generation as gen
from chatapp.server.errors import unsupported
from chatapp.server.routing import Router
from chatapp.server.schemas import EmbeddingList, EmbeddingRequest
from chatapp.server.state import ServerState

router = Router()

MAX_INPUTS = 256


def encode_base64(vector: list[float]) -> str:
    """The openai SDK's default wire form: little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings", body=EmbeddingRequest, answer=EmbeddingList, errors=(400, 404, 503))
async def embeddings(body: EmbeddingRequest, request: Request, state: ServerState) -> Any:
    """Embed texts or token ids: mean-pooled, L2-normalised final hidden states."""
    client, model = await state.engine_for(body.model)
    info = client.model_info
    if body.dimensions is not None:
        raise unsupported("dimensions", "choosing embedding dimensions")
    inputs = await gen.token_id_lists(client, body.input, "input", MAX_INPUTS)
    for i, ids in enumerate(inputs):
        gen.check_context(ids, info.max_model_len, None, "input" if len(inputs) == 1 else f"input[{i}]")
    batch: list[str | list[int]] = list(inputs)
    try:
        vectors = await gen.until_disconnect(request, client.embed(batch))
    except Exception as exc:  # noqa: BLE001
        raise state.error(exc, "input") from None
    as_base64 = body.encoding_format == "base64"
    data = [{"index": i, "embedding": encode_base64(v) if as_base64 else v} for i, v in enumerate(vectors)]
    tokens = sum(len(ids) for ids in inputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return EmbeddingList.model_validate({"data": data, "model": model, "usage": usage})
