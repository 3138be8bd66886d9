"""GET /v1/models and /v1/models/{id}: the models that answer on this port."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, Depends

from chatapp.server.errors import APIError
from chatapp.server.schemas import ErrorResponse, ModelCard, ModelList
from chatapp.server.state import ServerState, get_state

router = APIRouter()
log = logging.getLogger(__name__)

OWNER = "chatapp"


def _created(path: str, fallback: int) -> int:
    try:
        return int(Path(path).stat().st_mtime)
    except OSError:
        return fallback


def _cards(state: ServerState) -> list[ModelCard]:
    """The models that answer here (the loaded one), each with its context length (vLLM's field).

    Other models in the local store are not listed: a request naming one would get a 404, and
    clients pick the first listed id (`chatapp models list` shows the store)."""
    info = state.model_info
    if info is None:
        return []
    return [
        ModelCard(
            id=info.name,
            created=_created(info.path, state.started),
            owned_by=OWNER,
            max_model_len=info.max_model_len,
        )
    ]


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: ServerState = Depends(get_state)) -> ModelList:
    return ModelList(data=_cards(state))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> ModelCard:
    for card in _cards(state):
        if card.id == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist here.", param="model", code="model_not_found")
