"""GET /v1/models and /v1/models/{id}: the loaded model first, then other local models."""

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


def _local_models() -> list[tuple[str, int]]:
    """(id, created) of the models in the local store, when the store can list them."""
    from chatapp import store

    lister = getattr(store, "list_models", None)
    if lister is None:
        return []
    try:
        return [(m.name, _created(str(m.path), 0)) for m in lister()]
    except Exception:  # noqa: BLE001  a broken store must not break /v1/models
        log.exception("listing local models failed")
        return []


def _cards(state: ServerState) -> list[ModelCard]:
    cards = []
    info = state.model_info
    if info is not None:
        cards.append(ModelCard(id=info.name, created=_created(info.path, state.started), owned_by=OWNER))
    seen = {c.id for c in cards}
    for name, created in _local_models():
        if name not in seen:
            seen.add(name)
            cards.append(ModelCard(id=name, created=created or state.started, owned_by=OWNER))
    return cards


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: ServerState = Depends(get_state)) -> ModelList:
    return ModelList(data=_cards(state))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> ModelCard:
    for card in _cards(state):
        if card.id == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist here.", param="model", code="model_not_found")
