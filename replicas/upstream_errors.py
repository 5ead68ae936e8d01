"""How an OpenAI-compatible upstream's failures read: ``UpstreamFailed``
(it failed a request, which then moves to another replica or ends), the
message of its error bodies, and whether its 400 refuses a field the router
adds (``return_token_ids``, ``stream_options``) so the request can go again
without it.

One place for the client (``replicas.upstream``), its response bodies
(``replicas.upstream_sse``) and a resume onto it (``replicas.splice``).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from policies.dispatch_pace import MAX_RETRY_AFTER

__all__ = ["UpstreamFailed", "error_text", "rejects_field"]


class UpstreamFailed(Exception):
    """The upstream failed the request (5xx, error event, cut stream);
    ``busy``: it answered 429 or 503, asking for ``retry_after`` seconds."""

    def __init__(self, message: str = "", busy: bool = False, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.busy = busy
        self.retry_after = retry_after


def retry_after_seconds(value: bytes | None) -> float:
    """A Retry-After header's delay in seconds (0: absent, or an HTTP date),
    at most ``MAX_RETRY_AFTER`` (the router passes it on to its clients: an
    upstream's or a proxy's day, or 1e300, is no forecast worth a client's)."""
    try:
        return min(MAX_RETRY_AFTER, max(0.0, float(value))) if value else 0.0
    except ValueError:
        return 0.0


def error_text(body: bytes | str | Any, limit: int = 500) -> str:
    """The message of an OpenAI- or vLLM-style error body."""
    obj = body
    if isinstance(body, (bytes, str)):
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError:  # (a web server's HTML page: its text on one line, cut short)
            text = " ".join((body.decode(errors="replace") if isinstance(body, bytes) else body).split())
            return text if len(text) <= limit else text[:limit] + "..."
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:limit]
        return str(err)[:limit]
    return str(obj)[:limit]


_REFUSAL = r"(?:unrecognized|unknown|extra|not permitted|not allowed|unexpected)"


def rejects_field(message: str, field: str) -> bool:
    """Whether a 400's ``message`` says the API does not take ``field``
    ("Unrecognized request argument supplied: return_token_ids", "Extra inputs
    are not permitted ... 'stream_options'"), rather than quoting a request
    body that has it (``input_value={..., 'stream_options': ...}``): a refusal
    word near the name, not across a brace, and the name not a quoted key."""
    f = re.escape(field)
    name = rf"(?:(?<!['\"])\b{f}\b|\b{f}\b(?!['\"]\s*:))"
    near = rf"{_REFUSAL}[^{{}}\n]{{0,100}}?{name}|{name}[^{{}}\n]{{0,100}}?{_REFUSAL}"
    return re.search(near, message.lower()) is not None

