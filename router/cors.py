"""Calls from browser apps on other origins (router.yaml ``cors``).

Off unless ``cors.allow_origins`` lists origins: the API is authenticated by
a bearer key, never by cookies, so the router allows no credentials and needs
no more than the origins. One ``litestar.config.cors.CORSConfig`` holds the
rules: Litestar answers the preflights (``OPTIONS``) and decorates the
responses of its own routes with it, and the completion fast path
(``router.fastpath``), which writes its response heads itself, adds the same
headers from it (``response_headers``). A preflight Litestar would refuse
(an origin not listed, a method other than GET, POST or OPTIONS) is refused
by the fast path instead (``preflight_refusal``), with the same status, 400,
in OpenAI's error shape rather than Litestar's plain text (a browser fails
a preflight alike on every status that is not 2xx, so the status matters
only to other clients and to logs, where it stays what it was).
"""

from __future__ import annotations

import msgspec
from litestar.config.cors import CORSConfig

from router.errors import BadRequest, clip

__all__ = ["CorsSettings", "cors_config", "preflight_refusal", "response_headers"]

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


def preflight_refusal(config: CORSConfig, headers: list[tuple[bytes, bytes]]) -> BadRequest | None:
    """Why Litestar's CORS middleware would refuse an ``OPTIONS`` request with
    these (ASGI) headers, as the 400 to answer it with; None when it would
    answer it with a 204 (an allowed preflight) or it has no ``Origin``. Its
    checks: the origin, and ``Access-Control-Request-Method`` when sent;
    ``cors_config`` allows every request header, so those are never
    refused."""
    origin = method = None
    for k, v in headers:
        if k == b"origin" and origin is None:
            origin = v.decode("latin-1")
        elif k == b"access-control-request-method" and method is None:
            method = v.decode("latin-1")
    if not origin:
        return None
    origin_ok = config.is_origin_allowed(origin)
    method_ok = not method or config.is_allow_all_methods or method in config.allow_methods
    if origin_ok and method_ok:
        return None
    why = []
    if not origin_ok:
        why.append(f"the origin {clip(origin)} is not allowed")
    if not method_ok:
        why.append(f"the method {clip(method)} is not allowed (only {', '.join(sorted(config.allow_methods))})")
    return BadRequest(f"CORS preflight refused: {'; '.join(why)}.",
                      code="cors_method_not_allowed" if origin_ok else "cors_origin_not_allowed")
