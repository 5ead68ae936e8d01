"""The loopback guard: a load test only hits this machine unless told otherwise."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = ["check_base_url", "is_loopback_host"]


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, any address in 127.0.0.0/8 and ``::1`` (no DNS lookups)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_base_url(url: str, allow_remote: bool) -> str:
    """The normalized base URL (no trailing slash, and no ``/v1``: the SDK's
    base URL names the router too); ``ValueError`` says why it is refused."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base URL must be http:// or https://, not {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"base URL has no host: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"base URL must not have a query or fragment: {url!r}")
    if not allow_remote and not is_loopback_host(host):
        raise ValueError(
            f"refusing to send load to {host!r}: not a loopback address (127.0.0.0/8, ::1, localhost). "
            "Pass --allow-remote to load a remote router you are responsible for."
        )
    url = url.rstrip("/")
    if url.endswith("/v1"):  # (the openai SDK's base URL: the paths here start with /v1 themselves)
        url = url[:-3]
    return url
