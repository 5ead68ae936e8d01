"""uvloop, with a listener that accepts every waiting connection at once.

libuv (since 1.45, bundled by uvloop 0.18+) accepts one connection per turn
of the event loop (libuv/libuv#3696). A router that is busy relaying tokens
turns its loop every few milliseconds to tens of milliseconds, so a burst of
new connections is taken in one by one: in the S1 benchmark (64 clients
connecting at once while the first streams already run) the last one waited
over a second between its request going out and the router reading it,
which was most of fairstream's TTFT p99 there (docs/perf.md). The asyncio
loop accepts up to ``backlog`` connections per turn; this listener does the
same on uvloop: a reader on the listening socket that ``accept()``s until
none is left (up to ``ACCEPTS_PER_TURN`` a turn) and hands each connection
to ``connect_accepted_socket`` (uvloop's own TCP transport, as
``create_server`` would make).

Only plain TCP listeners go through it (``create_server`` with a host and
port, or a bound socket); TLS and UNIX sockets keep uvloop's own server.
uvicorn runs on it with ``loop="router.listener:new_event_loop"`` (a custom
loop factory).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

import uvloop

__all__ = ["Loop", "BatchServer", "new_event_loop"]

log = logging.getLogger("fairstream.router")

# Out of file descriptors (or buffers): stop accepting for this long, as asyncio does.
ACCEPT_RETRY_DELAY = 1.0
# At most this many accepts per turn of the loop (the rest wait for the next
# turns: the socket stays readable). Starting a connection costs ~60 us
# (its transport, uvicorn's protocol), so a storm of 3,000 taken in one turn
# paused every running stream ~190 ms; 128 is ~8 ms a turn, and still takes
# a burst of clients as large as the benchmark's (64) in one.
ACCEPTS_PER_TURN = 128
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Loop(uvloop.Loop):
    """uvloop's loop; ``create_server`` for plain TCP accepts in batches."""

    async def create_server(self, protocol_factory, host=None, port=None, *, family=socket.AF_UNSPEC,
                            flags=socket.AI_PASSIVE, sock=None, backlog=100, ssl=None, reuse_address=None,
                            reuse_port=None, **kwargs: Any) -> asyncio.AbstractServer:
        plain = all(v is None or (k == "start_serving" and v) for k, v in kwargs.items())
        if ssl is not None or not plain or (sock is not None and (sock.family not in (socket.AF_INET, socket.AF_INET6)
                                                                  or sock.type != socket.SOCK_STREAM)):
            return await super().create_server(protocol_factory, host, port, family=family, flags=flags, sock=sock,
                                               backlog=backlog, ssl=ssl, reuse_address=reuse_address,
                                               reuse_port=reuse_port, **kwargs)
        if sock is not None:
            sock.listen(backlog)  # as uvloop and asyncio do (a bound socket need not listen yet)
            socks = [sock]
        else:
            socks = await self._bind(host, port, family, flags, backlog, reuse_address, reuse_port)
        return BatchServer(self, socks, protocol_factory, backlog)

    async def _bind(self, host, port, family, flags, backlog: int, reuse_address, reuse_port) -> list[socket.socket]:
        hosts: Iterable[str | None] = [host] if host is None or isinstance(host, str) else host
        infos: dict[tuple, None] = {}
        for h in hosts:
            for info in await self.getaddrinfo(h or None, port, family=family, type=socket.SOCK_STREAM, flags=flags):
                infos[info] = None
        socks: list[socket.socket] = []
        try:
            for af, kind, proto, _, addr in infos:
                try:
                    s = socket.socket(af, kind, proto)
                except OSError:
                    continue  # e.g. no IPv6 in this kernel: serve on the other families, as asyncio does
                socks.append(s)
                if reuse_address is not False:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if af == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.bind(addr)
                except OSError as e:
                    raise OSError(e.errno, f"error while attempting to bind on address {addr!r}: "
                                           f"{(e.strerror or str(e)).lower()}") from None
                s.listen(backlog)
        except BaseException:
            for s in socks:
                s.close()
            raise
        if not socks:
            raise OSError(f"could not bind to {host!r}:{port}")
        return socks


class BatchServer(asyncio.AbstractServer):
    """Listening sockets whose waiting connections are accepted in the turn
    of the loop that finds them, up to ``ACCEPTS_PER_TURN`` (or ``backlog``)
    a turn: a storm of clients is taken in over a few turns, between which
    the running streams' tokens go out."""

    def __init__(self, loop: Loop, socks: list[socket.socket], protocol_factory: Callable[[], asyncio.Protocol],
                 backlog: int) -> None:
        self._loop = loop
        self._socks = socks
        self._fds = [s.fileno() for s in socks]
        self._factory = protocol_factory
        self._per_turn = max(1, min(backlog, ACCEPTS_PER_TURN))
        self._reading = False
        self._closed = asyncio.Event()
        # connections accepted and not yet handed to their protocol
        self._starting: dict[asyncio.Task[Any], socket.socket] = {}
        for s in socks:
            s.setblocking(False)
        self._start()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return () if self._closed.is_set() else tuple(self._socks)

    def _start(self) -> None:
        if self._reading or self._closed.is_set():
            return
        self._reading = True
        for s, fd in zip(self._socks, self._fds):
            self._loop.add_reader(fd, self._accept, s)

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            for fd in self._fds:
                self._loop.remove_reader(fd)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(self._per_turn):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                if e.errno in _RESOURCE_ERRORS:
                    log.error("accepting connections failed (%s); retrying in %.0f s", e, ACCEPT_RETRY_DELAY)
                    self._pause()
                    self._loop.call_later(ACCEPT_RETRY_DELAY, self._start)
                    return
                raise
            conn.setblocking(False)
            # (a task: connect_accepted_socket is a coroutine; the connection
            # reaches its protocol one turn later than with uvloop's own server)
            task = self._loop.create_task(self._connect(conn))
            self._starting[task] = conn
            task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[Any]) -> None:
        self._starting.pop(task, None)

    async def _connect(self, conn: socket.socket) -> None:
        if self._closed.is_set():
            conn.close()  # accepted just before the server closed: not served
            return
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception as e:  # noqa: BLE001 - one connection's failure; the server goes on
            log.warning("an accepted connection failed to start: %r", e)
            conn.close()

    def close(self) -> None:
        """Stop accepting; connections accepted and not yet started are
        closed (their protocol never saw them, so a graceful shutdown would
        not know to end them)."""
        if self._closed.is_set():
            return
        self._pause()
        for s in self._socks:
            s.close()
        self._closed.set()
        for task, conn in list(self._starting.items()):
            task.cancel()
            conn.close()  # no-op once its transport took the descriptor

    async def wait_closed(self) -> None:
        await self._closed.wait()
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)

    def is_serving(self) -> bool:
        return not self._closed.is_set()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def start_serving(self) -> None:
        self._start()

    async def serve_forever(self) -> None:
        self._start()
        try:
            await self._closed.wait()
        finally:
            self.close()


def new_event_loop() -> Loop:
    """uvicorn's custom loop factory (``loop="router.listener:new_event_loop"``)."""
    return Loop()
