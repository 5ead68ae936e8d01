"""The HTTP server the router runs on: uvicorn, and what it does on SIGTERM.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes the idle
ones and waits for the requests in flight. ``Server.shutdown`` first tells
the router (``RouterService.drain``): requests then get router.yaml's
``shutdown_grace`` seconds to finish, after which the router ends each one
still running with an explicit ``router_shutdown`` error, so no client sees
its stream cut without a word. uvicorn's own limit comes ``SHUTDOWN_MARGIN``
seconds later, for those errors to go out; only what is still running then
is cancelled.

uvicorn would also close every WebSocket at once (code 1012); ``_WebSocket``
leaves an open one to the router, which lets its requests finish within the
grace like HTTP streams and then closes it (router/websocket.py).
"""

from __future__ import annotations

import logging
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from router.config import SHUTDOWN_MARGIN
from router.fastpath import FastPath

__all__ = ["Server"]

log = logging.getLogger("fairstream.router")


class _WebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (``ws="auto"`` with websockets installed),
    except that shutdown does not close an open connection: the router's
    handler does, once its requests have ended; uvicorn cancels the handler
    at its own limit if it has not."""

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent:
            # (a peer that never answers the router's close frame holds the
            # shutdown only this long, not websockets' 10 s)
            self.close_timeout = min(self.close_timeout, 1.0)
            return
        super().shutdown()


class Server(uvicorn.Server):
    """uvicorn on uvloop (router.listener) with httptools, for the router app."""

    def __init__(self, app: FastPath, **config: Any) -> None:
        self.service = app.svc
        super().__init__(uvicorn.Config(
            app,
            loop="router.listener:new_event_loop",
            http="httptools",
            ws=_WebSocket,
            lifespan="on",
            log_level="warning",
            log_config=None,  # uvicorn's own lines go through the process's handlers (router.logs): JSON too
            access_log=False,
            timeout_graceful_shutdown=int(app.svc.config.shutdown_grace + SHUTDOWN_MARGIN + 0.999),
            # Longer than clients' idle gaps, so a reused connection is not closed
            # under a request that is already on its way.
            timeout_keep_alive=30,
            **config,
        ))

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                addr = sock.getsockname()
                if isinstance(addr, str):  # a Unix socket
                    log.info("listening on unix:%s", addr)
                    continue
                host, port = addr[:2]
                log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    async def shutdown(self, sockets=None) -> None:
        self.service.drain()
        await super().shutdown(sockets)
