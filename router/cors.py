"""Calls from browser apps on other origins (router.yaml ``cors``).

Off unless ``cors.allow_origins`` lists origins: the API is authenticated by
a bearer key, never by cookies, so the router allows no credentials and needs
no more than the origins. One ``litestar.config.cors.CORSConfig`` holds the
rules: Litestar answers the preflights (``OPTIONS``) and decorates the
responses of its own routes with it, and the completion fast path
(``router.fastpath``), which writes its response heads itself, adds the same
headers from it (``response_headers``).
"""

from __future__ import annotations

import msgspec
from litestar.config.cors import CORSConfig

__all__ = ["CorsSettings", "cors_config", "response_headers"]

# what a browser app may read from a response: the request id to quote, and
# what the rate limits say (OpenAI's x-ratelimit-* names, Retry-After)
EXPOSE = [
    "x-request-id",
    "retry-after",
    *(f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")),
]


class CorsSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Cross-origin calls from browser apps."""

    allow_origins: list[str] = msgspec.field(default_factory=list)
    """Origins whose pages may call the API (`https://chat.example.com`; `*` inside one matches anything, `"*"` alone any origin). Empty: cross-origin calls are refused by the browser."""
    max_age: int = 600
    """Seconds a browser may keep a preflight's answer."""


def cors_config(settings: CorsSettings) -> CORSConfig | None:
    """Litestar's CORS config for ``settings``; None when CORS is off."""
    if not settings.allow_origins:
        return None
    return CORSConfig(allow_origins=list(settings.allow_origins), allow_methods=["GET", "POST", "OPTIONS"],
                      allow_headers=["*"], expose_headers=EXPOSE, max_age=settings.max_age)


def response_headers(config: CORSConfig, origin: str) -> list[tuple[bytes, bytes]]:
    """The CORS headers of a response to a request from ``origin``, as
    Litestar's CORS middleware sets them on its routes' responses. (No
    ``Vary`` on a refusal, as there: every response needs a key, and shared
    caches do not store answers to requests with ``Authorization``.)"""
    headers = dict(config.simple_headers)
    if not config.is_allow_all_origins and config.is_origin_allowed(origin):
        headers["Access-Control-Allow-Origin"] = origin
        headers["Vary"] = "Origin"
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
