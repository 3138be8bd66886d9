"""Remote sessions' API keys live in the settings file (0600), never in the chat history.

Why: the history is a database people back up, sync and export; a key there leaks with it. The
settings file already holds named endpoints (URL and key), so a key typed into a session's settings
becomes such an endpoint, and the session refers to it by name. Sessions saved by earlier versions
with a key in the history are moved the same way when the app opens them.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlparse

from chatapp.history import Backend
from chatapp.settings import RemoteEndpoint, Settings


def without_key(backend: Backend) -> Backend:
    """What the history stores of a backend: everything but the key."""
    return dataclasses.replace(backend, api_key=None) if backend.api_key else backend


def move_key_to_settings(settings: Settings, backend: Backend) -> tuple[Settings, Backend] | None:
    """(settings with an endpoint holding the backend's URL and key, the backend naming that endpoint),
    or None when there is nothing to move (no key) or no URL to file it under."""
    if not backend.api_key:
        return None
    named = settings.endpoint(backend.endpoint) if backend.endpoint else None
    url = backend.base_url or (named.base_url if named is not None else None)
    if not url:
        return None
    for endpoint in settings.endpoints:  # the same URL and key already filed: use it
        if endpoint.base_url == url and endpoint.api_key == backend.api_key:
            return settings, Backend.remote(backend.base_url, endpoint=endpoint.name)
    new = settings.model_copy(deep=True)
    name = _free_name(new, urlparse(url).netloc or "remote")
    new.endpoints.append(RemoteEndpoint(name=name, base_url=url, api_key=backend.api_key))
    return new, Backend.remote(backend.base_url, endpoint=name)


def _free_name(settings: Settings, base: str) -> str:
    taken = {e.name for e in settings.endpoints}
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    return name
