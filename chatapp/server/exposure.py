"""Whether a server address is reachable from other machines, and the warning when it is without a key.

Its own module, free of the HTTP server's imports: `chatapp serve` checks the address before it imports the server.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to shout when the server is reachable from other machines without a key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"WARNING: serving on {host} WITHOUT an API key: anyone who can reach this machine can use "
        f"the model. Pass --api-key KEY, or bind 127.0.0.1."
    )
