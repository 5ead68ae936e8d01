"""The HTTP server the router runs on: uvicorn, and what it does on SIGTERM.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes the idle
ones and waits for the requests in flight. ``Server.shutdown`` first tells
the router (``RouterService.drain``): requests then get router.yaml's
``shutdown_grace`` seconds to finish, after which the router ends each one
still running with an explicit ``router_shutdown`` error, so no client sees
its stream cut without a word. uvicorn's own limit comes ``SHUTDOWN_MARGIN``
seconds later, for those errors to go out; only what is still running then
is cancelled.

A second SIGINT (Ctrl-C) quits at once, but not abruptly: uvicorn would
stop waiting and skip the application's shutdown (the replicas and their run
directory left behind, every request task cancelled with a traceback).
``Server`` instead ends what is in flight at once (``RouterService.stop_now``:
the same ``router_shutdown`` errors as at the end of the grace), drops the
connections still open ``FORCED_MARGIN`` seconds later, cancels what still
runs after as long again, and then shuts the router down as usual.

uvicorn would also close every WebSocket at once (code 1012); ``_WebSocket``
leaves an open one to the router, which lets its requests finish within the
grace like HTTP streams and then closes it (router/websocket.py).

The client connections' HTTP protocol, with its limits (head and body
timeouts, the connection cap, refusals in OpenAI's error shape), is
router/connection.py's ``HttpConnection``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from router.config import SHUTDOWN_MARGIN
from router.connection import HttpConnection
from router.descriptors import default_max_connections, open_file_limit
from router.fastpath import FastPath
from router.handshake import Handshake, fits

__all__ = ["Server"]

log = logging.getLogger("fairstream.router")


class _WebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (``ws="auto"`` with websockets installed),
    except that shutdown does not close an open connection: the router's
    handler does, once its requests have ended; uvicorn cancels the handler
    at its own limit if it has not. Counted in ``fairstream_http_connections``
    from the upgrade on. A handshake it refuses (no ``Sec-WebSocket-Key``, a
    bad ``Sec-WebSocket-Version``, ...) is answered in OpenAI's error shape
    (router/handshake.py), not with websockets' plain text."""

    @classmethod
    def probe(cls, config: uvicorn.Config, server_state) -> bool:
        """Whether this uvicorn makes, for a WebSocket connection, the
        websockets ``ServerProtocol`` that ``connection_made`` gives
        ``Handshake``'s class (``handshake.fits``); once at start. If not, the
        router serves on, its connections keeping the class uvicorn gives them
        (refused handshakes then get websockets' plain-text answers and are
        not counted), and says so in a warning."""
        try:
            conn: object = cls(config=config, server_state=server_state, app_state={}).conn
        except Exception as e:  # (a uvicorn whose protocol is built otherwise)
            conn = e
        if fits(conn):
            return True
        log.warning("uvicorn %s makes %r for a WebSocket connection, not websockets' ServerProtocol: the WebSocket "
                    "handshakes websockets refuses get its plain-text answers, not OpenAI's error shape, and are not "
                    "counted in fairstream_http_connections_refused_total (router/handshake.py)",
                    uvicorn.__version__, conn)
        return False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn builds websockets' ServerProtocol itself (in __init__);
        # Handshake only overrides its ``reject``, no state of its own, so the
        # instance takes that class as it is: nothing is rebuilt per connection.
        # (Anything else keeps its class: probe warned at start.)
        if fits(self.conn):
            self.conn.__class__ = Handshake
        if HttpConnection.metrics is not None:
            HttpConnection.metrics.connections.inc()

    async def send(self, message) -> None:  # type: ignore[override]
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # (a denial response, router/handshake.py ``deny``, is sent and the
            # connection closed; uvicorn does not mark the handshake done
            # then, and would log an error, "returned without completing
            # handshake", for every refused upgrade: uvicorn PR #3138)
            self.handshake_complete = True

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:  # (accepted: the handler can reach its connection)
            scope["extensions"][SOCKET_EXTENSION] = self

    def abort(self) -> None:
        """Drop the connection now, whatever waits in its buffers: a client
        that stopped reading never lets a close (which waits for them) end."""
        self.transport.abort()

    def limit_message_size(self, size: int) -> None:
        """The largest message the client may send from now on (decompressed;
        websockets closes with 1009 past it)."""
        if hasattr(self.conn, "max_message_size"):  # (websockets 15 and later)
            self.conn.max_message_size = size
        else:
            self.conn.max_size = size

    def connection_lost(self, exc: Exception | None) -> None:
        if HttpConnection.metrics is not None:
            HttpConnection.metrics.connections.dec()
        super().connection_lost(exc)
        scope = getattr(self, "scope", None)
        if scope is not None:  # (the scope and this protocol refer to each other: a cycle, cut once closed)
            scope["extensions"].pop(SOCKET_EXTENSION, None)

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent:
            # (a peer that never answers the router's close frame holds the
            # shutdown only this long, not websockets' 10 s)
            self.close_timeout = min(self.close_timeout, 1.0)
            return
        if self.handshake_initiated and not self.handshake_complete:
            # an upgrade the application has not answered yet (its task runs):
            # it refuses it now that the router drains, a 503 router_shutdown
            # (router/fastpath.py), where uvicorn would answer a 500 here
            return
        super().shutdown()


# the WebSocket scope's extension through which the handler reaches its connection (_WebSocket)
SOCKET_EXTENSION = "fairstream.socket"
# the largest WebSocket message, once authenticated: twice max_body_bytes plus
# this much (a request body over max_body_bytes, up to twice it, is refused
# and the socket goes on; past that, websockets closes the socket with 1009)
WS_ENVELOPE = 64 * 1024


# after a second SIGINT, seconds for the shutdown errors to go out before the
# connections still open are dropped, and again before what still runs is cancelled
FORCED_MARGIN = 1.0


def ws_max_message(max_body_bytes: int) -> int:
    return 2 * max_body_bytes + WS_ENVELOPE


class Server(uvicorn.Server):
    """uvicorn on uvloop (router.listener) with httptools, for the router app."""

    def __init__(self, app: FastPath, force_signal: int | None = None, **config: Any) -> None:
        self.service = app.svc
        self.force_signal = force_signal  # (a worker's: router.config.FORCE_SIGNAL)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._forced = False  # (a second SIGINT forced the stop)
        # (the one that began the stop: the exit status follows it where the
        # signals uvicorn raises again at the end do nothing, SIG_IGN)
        self.first_signal: int | None = None
        cfg = app.svc.config
        files = open_file_limit()
        HttpConnection.configure(cfg.header_timeout, cfg.body_timeout, cfg.body_total_timeout,
                                 cfg.max_connections or default_max_connections(files), app.svc.metrics)
        log.info("open-file limit %s; serving at most %s client connections", files or "unlimited",
                 HttpConnection.max_connections or "unlimited")
        super().__init__(uvicorn.Config(
            app,
            loop="router.listener:new_event_loop",
            http=HttpConnection,
            ws=_WebSocket,
            ws_max_size=ws_max_message(cfg.max_body_bytes),  # (router/websocket.py lowers it until auth)
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

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.force_signal is not None:
            signal.signal(self.force_signal, self._forced_from_outside)
        await super().serve(sockets)

    def _forced_from_outside(self, sig: int, frame: FrameType | None) -> None:
        """``force_signal`` (a worker's: its parent had a second SIGINT): the
        stop, forced, whatever this process had before (a SIGTERM, a SIGINT,
        or nothing yet); quietly once forced."""
        self.should_exit = True
        if self.first_signal is None:
            self.first_signal = signal.SIGINT
        loop = self._loop
        if not self._forced and loop is not None and not loop.is_closed():
            self._forced = True
            loop.call_soon_threadsafe(self._force)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's handler only sets a flag, which its main loop reads. A
        second SIGINT during the shutdown forces the stop (``_force``; uvicorn
        would set ``force_exit`` and skip the application's shutdown, and it
        is not kept in the signals raised again at the end: the exit is the
        first signal's). And while the router closes its parts (the
        lifespan's shutdown, after the requests or after a port it could not
        listen on) no main loop runs: the service is told of every signal
        itself, and cuts what it may (``hurry``). (A signal handler runs
        between two bytecodes of whatever the loop was doing: the calls go
        through the loop's own queue.)"""
        if self.first_signal is None:
            self.first_signal = sig
        loop = self._loop
        live = loop is not None and not loop.is_closed()
        if sig == signal.SIGINT and self.should_exit:
            if not self._forced:
                self._forced = True
                if live:
                    loop.call_soon_threadsafe(self._force)
            elif live:
                loop.call_soon_threadsafe(log.warning, "SIGINT again: the stop is forced already and goes on "
                                          "(replicas stopping, the last settlements); SIGKILL ends it at once")
        else:
            super().handle_exit(sig, frame)
        if live:
            loop.call_soon_threadsafe(self.service.hurry)

    def _force(self) -> None:
        # (armed first: a failure of stop_now does not leave the exit waiting on the graceful timeout)
        self._loop.call_later(FORCED_MARGIN, self._drop_connections)
        self.service.stop_now()  # (it says so in a warning)

    def _drop_connections(self) -> None:
        """The errors had their moment: a client that is not reading them
        holds the exit no longer (its request ends as one whose client left)."""
        left = list(self.server_state.connections)
        if left:
            log.warning("forced stop: dropping %d client connections still open", len(left))
        for conn in left:
            conn.transport.abort()
        self._loop.call_later(FORCED_MARGIN, self._cancel_tasks)

    def _cancel_tasks(self) -> None:
        left = list(self.server_state.tasks)
        if left:
            log.warning("forced stop: cancelling %d request tasks still running", len(left))
        for task in left:
            task.cancel()

    async def startup(self, sockets=None) -> None:
        _WebSocket.probe(self.config, self.server_state)
        try:
            await super().startup(sockets)
        except SystemExit as e:
            # uvicorn logged the OSError alone ("[Errno -2] Name or service
            # not known"), then stopped the router (its lines come between):
            # this line says both where and why. Its exit is raised in the
            # handler of that OSError, which is thus the exit's context.
            why = e.__context__
            if isinstance(why, OSError):
                log.error("cannot listen on %s:%d: %s", self.config.host, self.config.port, why)
            else:  # (the application's start-up failed: uvicorn logged the error)
                log.error("the router did not start: its start-up failed (the error is logged above)")
            raise
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
