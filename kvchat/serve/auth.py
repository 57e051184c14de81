"""Who may talk to the server: loopback only, unless an API key guards it."""

from __future__ import annotations

import hmac
import ipaddress

from kvchat.errors import KvchatError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond this machine without a key (one-line error, the fix)."""
    if not is_loopback(host) and not api_key:
        raise KvchatError(
            f"--host {host} would accept connections from other machines; pass --api-key KEY "
            "(clients send it as a Bearer token) or keep the default --host 127.0.0.1"
        )


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
