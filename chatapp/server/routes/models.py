"""GET /v1/models and /v1/models/{id}: every local model that answers on this port.

The engine's default model comes first (clients that pick the first id get the model that is ready),
then the other models the engine holds, then the rest of the local store: any listed id answers,
loaded on demand. ``loaded`` says which are held now (Ollama's /api/ps).
"""

from __future__ import annotations

import logging
from pathlib import Path

from chatapp.server.errors import APIError
from chatapp.server.routing import Router
from chatapp.server.schemas import ModelCard, ModelList
from chatapp.server.state import ServerState

router = Router()
log = logging.getLogger(__name__)

OWNER = "chatapp"


def _created(path: str, fallback: int) -> int:
    try:
        return int(Path(path).stat().st_mtime)
    except OSError:
        return fallback


async def _cards(state: ServerState) -> list[ModelCard]:
    info = state.model_info
    if info is None:
        return []
    cards = [
        ModelCard(
            id=info.name,
            created=_created(info.path, state.started),
            owned_by=OWNER,
            max_model_len=info.max_model_len,
            loaded=True,
        )
    ]
    held = {info.path}
    for status in await state.engine_models():
        other = status.info
        if status.default or other is None or other.path in held:
            continue
        held.add(other.path)
        cards.append(
            ModelCard(
                id=state.id_for(other),
                created=_created(other.path, state.started),
                owned_by=OWNER,
                max_model_len=other.max_model_len,
                loaded=status.state == "ready",
            )
        )
    taken = {card.id.lower() for card in cards}
    for entry in state.catalog():
        if entry.spec in held or entry.id.lower() in taken:
            continue
        cards.append(ModelCard(id=entry.id, created=entry.created or state.started, owned_by=OWNER))
    return cards


@router.get("/v1/models", answer=ModelList)
async def list_models(state: ServerState) -> ModelList:
    """Every local model that answers on this port, the default one first."""
    return ModelList(data=await _cards(state))


@router.get("/v1/models/{model_id:path}", answer=ModelCard, errors=(404,))
async def get_model(model_id: str, state: ServerState) -> ModelCard:
    """One model's card."""
    for card in await _cards(state):
        if card.id == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist here.", param="model", code="model_not_found")
