"""router/server.py ``_WebSocket`` and router/fastpath.py on a WebSocket
upgrade: the check that uvicorn still makes websockets' own
``ServerProtocol`` (which ``_WebSocket`` gives ``router.handshake.Handshake``'s
class), and an upgrade that shutdown meets before it is answered. uvicorn's
protocol and FastPath are real, over a small Litestar app, a stand-in
service and a transport that records what is written."""

from __future__ import annotations

import asyncio
import logging
import re
import types

import uvicorn
from litestar import Litestar, WebSocket, websocket
from uvicorn.server import ServerState
from websockets.server import ServerProtocol

from router import server as srv
from router.fastpath import FastPath
from router.handshake import Handshake
from router.metrics import Metrics

HANDSHAKE = (b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@websocket("/v1/ws")
async def _socket(socket: WebSocket) -> None:
    await socket.accept()
    await socket.close()


def _app() -> tuple[FastPath, types.SimpleNamespace]:
    app = Litestar([_socket], openapi_config=None, logging_config=None)
    svc = types.SimpleNamespace(draining=False, metrics=Metrics())
    app.state.service = svc
    return FastPath(app), svc


def _config(app) -> uvicorn.Config:
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    return config


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after the close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return default

    def set_protocol(self, protocol) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Derived(ServerProtocol):
    """What a future uvicorn might make: websockets' protocol with overrides of its own."""


class _BuildsAnother(srv._WebSocket):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Derived()


class _BuiltOtherwise(srv._WebSocket):
    def __init__(self, config, server_state, app_state, extra) -> None:  # (a changed signature)
        super().__init__(config, server_state, app_state)


async def test_the_probe_passes_on_this_uvicorn_and_its_connections_take_handshakes_class(caplog) -> None:
    app, _ = _app()
    config = _config(app)
    with caplog.at_level(logging.WARNING, logger="fairstream.router"):
        assert srv._WebSocket.probe(config, ServerState())
    assert not caplog.records
    ws = srv._WebSocket(config=config, server_state=ServerState(), app_state={})
    ws.connection_made(_Transport())
    assert type(ws.conn) is Handshake


async def test_a_uvicorn_that_makes_another_protocol_is_warned_of_and_its_connections_are_left_as_they_are(
        caplog) -> None:
    app, _ = _app()
    config = _config(app)
    for cls, what in ((_BuildsAnother, "_Derived"), (_BuiltOtherwise, "TypeError")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fairstream.router"):
            assert not cls.probe(config, ServerState())
        [record] = caplog.records
        assert "not websockets' ServerProtocol" in record.getMessage() and what in record.getMessage()
    ws = _BuildsAnother(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    ws.connection_made(transport)
    assert type(ws.conn) is _Derived  # (its overrides kept: not made a Handshake)
    ws.data_received(HANDSHAKE[:-2] + b"Sec-WebSocket-Version: 8\r\n\r\n")  # (refused by websockets, as it would)
    assert transport.written.startswith(b"HTTP/1.1 426 ") or transport.written.startswith(b"HTTP/1.1 400 ")


async def test_an_upgrade_shutdown_meets_before_it_is_answered_gets_a_503_router_shutdown() -> None:
    # uvicorn answered it a 500 (its handshake not complete), and then the
    # application's accept went to a closed transport
    app, svc = _app()
    ws = srv._WebSocket(config=_config(app), server_state=ServerState(), app_state={})
    transport = _Transport()
    ws.connection_made(transport)
    ws.data_received(HANDSHAKE)  # (the application's task is started, not run yet)
    svc.draining = True  # (as router/server.py Server.shutdown: the router drains, then its connections shut down)
    ws.shutdown()
    for _ in range(100):
        if transport.closed:
            break
        await asyncio.sleep(0.01)
    assert transport.written.startswith(b"HTTP/1.1 503 "), transport.written
    assert transport.written.count(b"HTTP/1.1 ") == 1
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert b"\r\nretry-after: 1\r\n" in head.lower() and b"\r\ncontent-type: application/json\r\n" in head.lower()
    assert b'"code":"router_shutdown"' in body
    assert re.search(rb"\r\nx-request-id: [0-9a-f]{24}\r\n", head.lower()), head
    value = svc.metrics.registry.get_sample_value("fairstream_http_connections_refused_total", {"reason": "shutdown"})
    assert value == 1


async def test_an_upgrade_before_shutdown_is_accepted() -> None:
    app, _ = _app()
    ws = srv._WebSocket(config=_config(app), server_state=ServerState(), app_state={})
    transport = _Transport()
    ws.connection_made(transport)
    ws.data_received(HANDSHAKE)
    for _ in range(100):
        if transport.written:
            break
        await asyncio.sleep(0.01)
    assert transport.written.startswith(b"HTTP/1.1 101 "), transport.written


async def test_on_a_server_without_denial_responses_litestar_answers_the_upgrades_fastpath_would_refuse() -> None:
    app, svc = _app()
    svc.draining = True
    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/nowhere", "raw_path": b"/v1/nowhere", "root_path": "",
             "query_string": b"", "headers": [(b"host", b"x")], "subprotocols": [], "asgi": {"version": "3.0"},
             "scheme": "ws", "server": None, "client": None, "extensions": {}}
    await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["websocket.close"], sent  # (Litestar's: no route; uvicorn makes it a 403)
    assert not svc.metrics.registry.get_sample_value("fairstream_http_connections_refused_total",
                                                     {"reason": "websocket_not_found"})
