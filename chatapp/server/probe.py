"""Whether chatapp's own API answers at an address (another window of the TUI may serve it).

Its own module, free of the HTTP server's imports: the TUI asks when its API port is taken, to tell "another chatapp
window serves it, on the same engine" from "another program holds the port".
"""

from __future__ import annotations

SERVER_NAME = "chatapp"
"""What /health says in its ``server`` field (the probe below looks for it)."""

PROBE_TIMEOUT_S = 1.0


def base_url(host: str, port: int) -> str:
    """The address a client uses (a server on every interface is reached on this machine's loopback)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


async def chatapp_api_at(host: str, port: int) -> str | None:
    """The base URL when chatapp's API answers /health at ``host:port``, else None (nothing there,
    or another program: anything that is not our /health's JSON)."""
    import httpx  # here: ~50 ms of every server's start otherwise, for a probe made only when a port is taken

    url = base_url(host, port)
    try:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as http:
            response = await http.get(f"{url}/health")
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return url if isinstance(body, dict) and body.get("server") == SERVER_NAME else None
