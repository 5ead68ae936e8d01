"""The WebSocket opening handshake's refusals, in OpenAI's error shape.

uvicorn hands an upgrade request to websockets' ``ServerProtocol``, whose
``accept`` answers one that is not a valid handshake (no ``Sec-WebSocket-Key``
or a malformed one, a ``Sec-WebSocket-Version`` other than 13, a method other
than GET, ...) with its ``reject``: a plain-text 400 (405, 426, 505). uvicorn
calls ``reject`` as well when the application closes the socket before it
accepts it (a 403 with no body: Litestar does so for a path with no
WebSocket route) or fails before then (a 500). ``Handshake`` is that
protocol with ``reject`` answering in OpenAI's error shape, with the same
status and websockets' reason; router/server.py's ``_WebSocket`` gives its
connections this class. An accepted handshake never calls it.
"""

from __future__ import annotations

import email.utils
import http

from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.server import ServerProtocol

from router.errors import clip, error_body

__all__ = ["Handshake", "refusal_body"]

# the longest message (websockets' reason echoes the client's header
# values, and a request head may be 64 KiB)
MAX_MESSAGE = 300
# uvicorn's reason-less refusal: the application closed the socket before accepting it
CLOSED_BEFORE_ACCEPT = "The router refused the WebSocket connection; its WebSocket endpoint is /v1/ws."


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


class Handshake(ServerProtocol):
    """websockets' server side of a connection; its refusals in OpenAI's shape."""

    def reject(self, status: http.HTTPStatus | int, text: str) -> Response:
        """As websockets' ``reject`` (its headers, ``Connection: close``
        included; ``accept`` adds ``Allow`` to its 405 and ``Upgrade`` to its
        426), with a JSON body."""
        status = http.HTTPStatus(status)
        body = refusal_body(status.value, text)
        headers = Headers([
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", "application/json"),
        ])
        return Response(status.value, status.phrase, headers, body)
