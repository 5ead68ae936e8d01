"""The WebSocket opening handshake's refusals, in OpenAI's error shape, and
counted in ``fairstream_http_connections_refused_total``.

uvicorn hands an upgrade request to websockets' ``ServerProtocol``, whose
``accept`` answers one that is not a valid handshake (no ``Sec-WebSocket-Key``
or a malformed one, a ``Sec-WebSocket-Version`` other than 13, a method other
than GET, ...) with its ``reject``: a plain-text 400 (405, 426, 505). uvicorn
calls ``reject`` as well when the application closes the socket before it
accepts it (a 403 with no body) or fails before then (a 500). ``Handshake``
is that protocol with ``reject`` answering in OpenAI's error shape, with the
same status and websockets' reason; router/server.py's ``_WebSocket`` gives
its connections this class (``fits`` says whether it can). An accepted
handshake never calls it.

The router refuses two upgrades itself, before its WebSocket endpoint sees
them (router/fastpath.py, through ``deny``): one to a path with no WebSocket
endpoint (a 404, as for an HTTP request to an unknown path) and one that
comes while the router shuts down (a 503, ``router_shutdown``). An upgrade
in HTTP/1.0 is refused before websockets sees it (router/connection.py ``HttpConnection``).
"""

from __future__ import annotations

import email.utils
import http
from typing import TYPE_CHECKING, Any

from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.server import ServerProtocol

from router.errors import ApiError, clip, error_body
from router.ids import new_id

if TYPE_CHECKING:
    from router.metrics import Metrics

__all__ = ["Handshake", "refusal_body", "refusal_reason", "fits", "deny"]

# the longest message (websockets' reason echoes the client's header
# values, and a request head may be 64 KiB)
MAX_MESSAGE = 300
# uvicorn's reason-less refusal: the application closed the socket before accepting it
CLOSED_BEFORE_ACCEPT = "The router closed the WebSocket connection before accepting it."
# the ASGI extension through which an application answers an upgrade with an HTTP response
DENIAL = "websocket.http.response"


def refusal_body(status: int, text: str) -> bytes:
    """The OpenAI error of a refused handshake with websockets' (or
    uvicorn's) ``text``: ``invalid_websocket_handshake`` for a request that is
    not a valid handshake, ``forbidden`` for a socket the application closed
    before accepting it, a ``server_error`` for a failure on the server's
    side."""
    message = clip(" ".join(text.split()), MAX_MESSAGE)
    if status >= 500:
        return error_body(message or http.HTTPStatus(status).phrase + ".", "server_error")
    if not message:
        return error_body(CLOSED_BEFORE_ACCEPT, "invalid_request_error", None, "forbidden")
    return error_body(message, "invalid_request_error", None, "invalid_websocket_handshake")


def refusal_reason(status: int) -> str:
    """fairstream_http_connections_refused_total's ``reason`` of a ``reject``:
    the application's refusals (a socket closed or failed before it was
    accepted: 403, 5xx) apart from requests that are no valid handshake."""
    return "websocket_refused" if status == 403 or status >= 500 else "invalid_websocket_handshake"


def fits(conn: object) -> bool:
    """Whether ``conn``, the websockets protocol uvicorn made for a
    connection, can take ``Handshake``'s class: websockets' own
    ``ServerProtocol``, nothing derived from it (a subclass's overrides would
    be lost) and nothing else (whose state ``reject`` does not know)."""
    return type(conn) is ServerProtocol


class Handshake(ServerProtocol):
    """websockets' server side of a connection; its refusals in OpenAI's
    shape, and counted. No state of its own (``__slots__``), so that an
    instance of websockets' class can take this one as it is."""

    __slots__ = ()

    # where refusals are counted (router/connection.py ``HttpConnection.configure``; one server per process)
    metrics: Metrics | None = None

    def reject(self, status: http.HTTPStatus | int, text: str) -> Response:
        """As websockets' ``reject`` (its headers, ``Connection: close``
        included; ``accept`` adds ``Allow`` to its 405 and ``Upgrade`` to its
        426), with a JSON body."""
        status = http.HTTPStatus(status)
        body = refusal_body(status.value, text)
        if self.metrics is not None:
            self.metrics.connections_refused.labels(refusal_reason(status.value)).inc()
        headers = Headers([
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", "application/json"),
            ("x-request-id", new_id()),
        ])
        return Response(status.value, status.phrase, headers, body)


async def deny(scope: dict[str, Any], receive, send, error: ApiError) -> bool:
    """Answer the upgrade of ``scope`` with ``error`` (its status, headers and
    OpenAI body) instead of accepting it, and close the connection: ASGI's
    WebSocket denial response. False, with nothing sent, on a server that
    does not offer it."""
    if DENIAL not in scope.get("extensions", {}):
        return False
    await receive()  # (its websocket.connect: the server's, already waiting)
    headers = [(b"content-type", b"application/json"),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items())]
    if "x-request-id" not in error.headers:  # (as every other answer of the API)
        headers.append((b"x-request-id", new_id().encode()))
    await send({"type": "websocket.http.response.start", "status": error.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": error.body()})
    return True
