"""Errors that map to HTTP: each carries its status, OpenAI error type and headers."""

from __future__ import annotations

import math

import msgspec

from policies.dispatch_pace import MAX_RETRY_AFTER

__all__ = [
    "ApiError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "ServiceUnavailable",
    "ReplicaUnavailable",
    "RouterShutdown",
    "UnsupportedMediaType",
    "GatewayTimeout",
    "error_body",
    "clip",
    "unknown_path",
    "retry_after_header",
]


def retry_after_header(seconds: float) -> str:
    """The ``Retry-After`` value for a wait of ``seconds``, the one rounding
    every answer uses: the figure ``x-ratelimit-reset-*`` shows for the same
    wait (``router.ticket.fmt_duration``: rounded up at its unit, forgiving
    1e-6 of it as float noise), rounded up to whole seconds, so a client
    that waits that long is not refused for the rest and the figure is never
    below the reset header's; at least 1 (0 would invite a retry in a busy
    loop). Not capped: a rate limit's wait is what its bucket needs (a token
    bucket driven below zero by a stream that used more than it reserved can
    need minutes); the estimates are capped where they are made
    (``DispatchPace.retry_after``; an upstream's ``Retry-After`` as it is
    read, ``retry_after_seconds``: ``MAX_RETRY_AFTER``), and a wait without
    an end (inf, NaN) says that cap."""
    if not seconds < math.inf:  # (inf, NaN)
        return str(int(MAX_RETRY_AFTER))
    scale = 1000 if seconds <= 0.999 else 100 if seconds < 10 else 10 if seconds < 60 else 1
    shown = math.ceil(seconds * scale - 1e-6) / scale
    return str(max(1, math.ceil(shown)))


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``.
    A lone surrogate in the text (a client's, echoed back) is written as its
    escape: UTF-8 has no such character, and the encode's error was a 500."""
    try:
        return msgspec.json.encode(_ErrorBody(_ErrorDetail(message, type_, param, code)))
    except UnicodeEncodeError:
        return msgspec.json.encode(_ErrorBody(_ErrorDetail(_escaped(message), type_, _escaped(param), code)))


def _escaped(text: str | None) -> str | None:
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def clip(text: str, n: int = 100) -> str:
    """``text`` for an error message: a client's value echoed back whole
    could be megabytes."""
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


MAX_PARAM = 200  # characters of an error's ``param`` (a field name the client sent)


class ApiError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = clip(param, MAX_PARAM) if param else param  # (a client's field name: could be megabytes)
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    status = 403
    type = "invalid_request_error"
    code = "forbidden"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"


def unknown_path(path: str) -> NotFound:
    """The 404 of a path the router serves nothing on, an HTTP request's or
    a WebSocket upgrade's (``path`` as the request sent it, decoded)."""
    return NotFound(f"Unknown path {clip(path)}.")


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float | None, **kw) -> None:
        """``retry_after`` None: retrying cannot help (the request never
        fits); the answer says so to the SDK (``x-should-retry: false``)
        instead of naming a time."""
        super().__init__(message, **kw)
        if retry_after is None:
            self.headers["x-should-retry"] = "false"
        else:
            self.headers.setdefault("retry-after", retry_after_header(retry_after))


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class GatewayTimeout(ApiError):
    """A tenant time limit passed before the response started."""

    status = 504
    type = "timeout"
    code = "timeout"


class RouterShutdown(ServiceUnavailable):
    """The router is stopping: its shutdown grace is over, or (WebSocket) a
    new request came while it drains."""

    code = "router_shutdown"

    def __init__(self, message: str = "The router is shutting down; retry the request.") -> None:
        super().__init__(message, headers={"retry-after": "1"})


class ReplicaUnavailable(ServiceUnavailable):
    """No replica can take the request (none ready, or all failed it)."""

    code = "no_replica_available"

    def __init__(self, message: str, **kw) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("retry-after", "1")  # (a replica is usually back within seconds)
