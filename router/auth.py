"""API key -> tenant. Keys are stored and compared as SHA-256 digests."""

from __future__ import annotations

import hashlib
import unicodedata

from router.errors import Forbidden, Unauthorized
from router.tenants import TenantsFile

__all__ = ["KeyIndex", "hash_key", "bearer", "authorization", "header_text", "key_problem", "SEVERAL"]

# The Authorization "value" of a request that sent the header more than
# once (a NUL: never in a value that reached the router). Which one to use
# is no choice to make: a gateway that adds its own without removing the
# client's would otherwise authenticate by whichever a route happened to read.
SEVERAL = "\x00several"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def header_text(raw: bytes) -> str:
    """An Authorization header's bytes as the text the client meant: UTF-8,
    what curl and most clients send (and what a key is hashed as), else
    latin-1, what Python's http.client and requests, browsers' ``fetch``
    and Node send for characters up to U+00FF. (Read as latin-1 alone, as
    uvicorn and Litestar read headers, a non-ASCII key sent as UTF-8 was
    hashed as other text than its digest's and never matched over HTTP,
    while it did over the WebSocket; bytes that are both are UTF-8 here.)"""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def authorization(headers) -> str | None:
    """The Authorization header of a request's (Litestar) ``headers`` (read
    as ``header_text``); ``SEVERAL`` when it came more than once."""
    values = headers.getall("authorization", [])
    return SEVERAL if len(values) > 1 else header_text(values[0].encode("latin-1")) if values else None


def key_problem(key: str) -> str | None:
    """Why ``key`` can be no API key (None: it can be): a key is sent in a
    header, where control characters other than the tab cannot go (RFC
    9110 5.5), and the same rule holds for the WebSocket's auth message, so
    that both take the same keys. (Spaces and tabs around a key are no
    part of it: ``bearer`` drops them.)"""
    if key.isprintable():  # (no control character or lone surrogate: the usual key, at C speed)
        return None
    for ch in key:
        category = unicodedata.category(ch)
        if category == "Cs":
            return "the key is not valid Unicode text"
        if category == "Cc" and ch != "\t":
            return f"the key has a control character ({ch!r}), which no HTTP header can carry"
    return None


def bearer(authorization: str | None) -> str:
    """The key in an ``Authorization: Bearer KEY`` header (or a WebSocket's
    auth message, given as that header), without the spaces around it; 401
    if absent, malformed, sent more than once or no possible key
    (``key_problem``)."""
    if authorization == SEVERAL:
        raise Unauthorized("The request has more than one Authorization header; send one.")
    if not authorization:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Malformed Authorization header; expected 'Bearer YOUR_KEY'.")
    problem = key_problem(key)
    if problem is not None:
        raise Unauthorized(f"Malformed API key: {problem}.")
    return key


class KeyIndex:
    """Maps key digests to tenant names.

    The presented key is hashed before any comparison, so the dict lookup
    compares digests, never the secret: its timing depends on the digest of
    what the caller sent, which tells the caller nothing about stored keys
    (an attacker cannot steer a SHA-256 prefix). That is the constant-time
    property of comparing hashes, with O(1) lookup for any number of keys."""

    def __init__(self, tenants: TenantsFile) -> None:
        self._tenants: dict[str, str] = {}
        for name, tenant in tenants.tenants.items():
            for digest in tenant.keys:
                self._tenants[digest] = name
        self._admins = set(tenants.admin_keys)

    def tenant(self, key: str) -> str:
        digest = hash_key(key)
        name = self._tenants.get(digest)
        if name is None:
            if digest in self._admins:
                raise Forbidden("Admin keys cannot call the inference API; use a tenant key.")
            raise Unauthorized(f"Incorrect API key provided: {_redact(key)}.")
        return name

    def admin(self, key: str) -> None:
        digest = hash_key(key)
        if digest in self._admins:
            return
        if digest in self._tenants:
            raise Forbidden("This endpoint needs an admin key; tenant keys are not allowed.")
        raise Unauthorized(f"Incorrect API key provided: {_redact(key)}.")


def _redact(key: str) -> str:
    """A wrong key as its error and the log show it: its ends, as OpenAI
    shows them, only when they are a small part of it (of a 9-character
    key they were 7)."""
    return key[:3] + "*" * 4 + key[-4:] if len(key) >= 24 else "****"
