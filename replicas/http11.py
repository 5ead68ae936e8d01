"""A small HTTP/1.1 client for streamed responses, at protocol level.

The hot path of an OpenAI-compatible upstream: each piece of a response body
goes from the socket (``data_received``) through httptools' parser (the C
parser uvicorn uses; it undoes the chunked framing) to a sink the caller
set, synchronously. There is no stream reader and no task wake-up per piece,
so a relayed token costs one callback here instead of aiohttp's
``StreamReader`` plus a task switch (docs/perf.md). Connections are kept
alive and reused, one pool per upstream, at most ``limit`` at once.
Control calls (health checks, ``/metrics``, ``/detokenize``) stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpError", "HeadTimeout", "HttpPool", "Response", "sse_data"]

KEEPALIVE = 30.0  # seconds an idle connection is kept for reuse


def sse_data(buf: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads (stripped) of the complete server-sent events
    in ``buf``, one per event, and the incomplete rest to keep. An event's
    data lines are one payload, joined by newlines, as the SSE standard has
    it (a proxy or server that folds a JSON chunk over several lines). A
    line ends with LF, CRLF or a lone CR, as the standard has it. A CR that
    ends ``buf`` after a line's text stays in the rest (the next read may
    bring its LF); one that ends a blank line ends its event now (an LF
    after it is an empty line, which is nothing)."""
    held = b""
    # (``find``, not ``in``: CPython 3.11's ``bytes.__contains__`` first
    # tries its argument as an int, and a bytes argument costs it a TypeError
    # made, formatted and cleared: ~1,800 instructions, twice per token)
    if buf.find(b"\r") >= 0:
        if buf[-1:] == b"\r" and buf[-2:-1] not in (b"\r", b"\n"):
            buf, held = buf[:-1], b"\r"
        buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    *events, rest = buf.split(b"\n\n")
    out = []
    for event in events:
        if event.startswith(b"data:") and event.find(b"\n") < 0:
            out.append(event[5:].strip())  # (the usual event: one data line)
            continue
        lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out, rest + held


class HttpError(Exception):
    """The connection failed, or closed before the response was complete."""


class HeadTimeout(HttpError):
    """No response head within the request's ``head_timeout``: the server has the request."""


class Response:
    """One response: status and headers once ``HttpPool.request`` returns,
    then the body, given to a sink as it arrives (or kept for ``read``)."""

    __slots__ = ("status", "headers", "on_head", "_sink", "_kept", "_done", "_conn", "_release")

    def __init__(self, conn: _Conn, on_head: Callable[[Response], None] | None = None) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        # called with the response in the connection's callback once status
        # and headers are in, before any body piece (e.g. to ``stream_to``)
        self.on_head = on_head
        self._sink: Callable[[bytes], None] | None = None
        self._kept: list[bytes] = []
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._conn: _Conn | None = conn
        self._release: Callable[[], None] | None = None

    def stream_to(self, sink: Callable[[bytes], None]) -> None:
        """Hand every body piece to ``sink`` (from ``data_received``). An
        exception from ``sink`` ends the response: ``finished`` raises it."""
        self._sink = sink
        kept, self._kept = self._kept, []
        for piece in kept:  # what came with the head (maybe the whole body, already ended)
            try:
                sink(piece)
            except Exception as e:  # noqa: BLE001 - as in _body
                self.close(e)
                if self._done.exception() is None:  # it had ended before the sink failed
                    self._done = asyncio.get_running_loop().create_future()
                    self._done.set_exception(e)
                return
        if self._done.done():
            self._sink = None  # (it had ended: nothing more comes, and no cycle is left through the sink)

    async def finished(self) -> None:
        """Wait for the end of the body (``HttpError`` if the connection broke)."""
        await asyncio.shield(self._done)

    def when_finished(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(exc)`` when the response ends: ``exc`` None when it
        completed or was closed by us, else what broke it."""
        self._done.add_done_callback(lambda f: callback(f.exception()))

    async def read(self) -> bytes:
        """The whole body (for error responses)."""
        await self.finished()
        return b"".join(self._kept)

    def close(self, exc: BaseException | None = None) -> None:
        """Stop reading: an unfinished response closes its connection (which
        makes vLLM abort the request); a finished one has already let it go.
        ``exc``: what ``finished`` raises, if it has not ended yet."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abandon()
        self._end(exc)

    # -- from the connection and the pool ------------------------------------

    def _body(self, piece: bytes) -> None:
        if self._done.done():
            return
        if self._sink is None:
            self._kept.append(piece)
            return
        try:
            self._sink(piece)
        except Exception as e:  # noqa: BLE001 - the caller's parser failed: end this response with it
            self.close(e)

    def _hold(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the response ends (now, if it has)."""
        if self._done.done():
            release()
        else:
            self._release = release

    def _end(self, exc: BaseException | None) -> None:
        self._conn = None
        self._sink = None  # (the sink, an SSE reader, refers back to this response: no cycle left)
        release, self._release = self._release, None
        if release is not None:
            release()
        if not self._done.done():
            if exc is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(exc)
                self._done.exception()  # marked retrieved: a closed response may never be awaited


class _Conn(asyncio.Protocol):
    """One keep-alive connection; serves one response at a time."""

    __slots__ = ("pool", "transport", "parser", "response", "head", "keep_alive", "closed", "got_bytes", "idle_since",
                 "body")

    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.keep_alive = False
        self.closed = False
        self.got_bytes = False
        self.idle_since = 0.0
        # the body pieces of the read being parsed: httptools gives every
        # chunk of a chunked body on its own (an upstream writes one per SSE
        # event), and they go on as one piece when the read is parsed, so a
        # read of many events is one pass of the SSE reader, not one per event
        self.body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._flush()  # (what came before the bad bytes is the response's)
            self._fail(HttpError(f"bad HTTP response: {e}"))
            return
        # ``_flush`` and ``Response._body`` in one frame: this runs once per
        # token of a stream that is not ahead of the router, and each of the
        # two calls was a Python frame of its own (docs/perf.md, "Session 39")
        body = self.body
        if body:
            self.body = []
            r = self.response
            if r is not None:  # (its ``_done`` is not done while it is ours: ``_end`` and ``close`` let it go first)
                piece = body[0] if len(body) == 1 else b"".join(body)
                sink = r._sink
                if sink is None:
                    r._kept.append(piece)
                    return
                try:
                    sink(piece)
                except Exception as e:  # noqa: BLE001 - as in Response._body
                    r.close(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        self._fail(HttpError(f"connection closed{': ' + str(exc) if exc else ''}"))
        self.parser = None  # type: ignore[assignment]  # (it holds this protocol's callbacks: no cycle left)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        r = self.response
        if r is None:
            return
        r.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if r.on_head is not None:
            on_head, r.on_head = r.on_head, None
            try:
                on_head(r)
            except Exception as e:  # noqa: BLE001 - the caller's hook failed: end this response with it
                r.close(e)
        if self.head is not None and not self.head.done():
            self.head.set_result(r)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self._flush()
        r, self.response = self.response, None
        self.parser = httptools.HttpResponseParser(self)
        if self.keep_alive and not self.closed:
            self.pool._idle_again(self)
        else:
            self.close()
        if r is not None:
            r._end(None)

    # ours
    def _flush(self) -> None:
        """The body pieces parsed so far to the response, as one piece."""
        body = self.body
        if body:
            self.body = []
            r = self.response
            if r is not None:
                r._body(body[0] if len(body) == 1 else b"".join(body))

    def send(self, request: bytes, response: Response) -> asyncio.Future[Response]:
        self.response = response
        self.got_bytes = False
        self.head = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.head

    def abandon(self) -> None:
        """The response's reader left before its end: drop the connection."""
        if self.head is not None and not self.head.done():
            # whoever still awaits the head learns the response is gone; if
            # nobody does (an abort before the request's task ran), no warning
            self.head.set_exception(HttpError("response closed"))
            self.head.exception()
        if self.response is not None:
            self.response = None
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    def _fail(self, exc: HttpError) -> None:
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(exc)
            head.exception()  # retrieved: a request sent at once may never be awaited (closed first)
        r, self.response = self.response, None
        self.close()
        if r is not None:
            r._end(exc)


class Sent(NamedTuple):
    """A request ``HttpPool.send_now`` wrote: its connection, its response,
    the future of the response's head, and its bytes (to send again on a new
    connection if the kept-alive one turns out closed)."""

    conn: _Conn
    response: Response
    head: asyncio.Future[Response]
    request: bytes


class HttpPool:
    """Keep-alive connections to one server (``base_url``: scheme, host, port, path prefix)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, *, limit: int = 0,
                 connect_timeout: float = 10.0) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        if u.port:
            host += f":{u.port}"
        lines = [f"Host: {host}", "Accept: text/event-stream", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._headers = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._slots = asyncio.Semaphore(limit) if limit else None

    def can_send_now(self) -> bool:
        """``send_now`` would likely find a connection (worth encoding for)."""
        return self._slots is None and bool(self._idle)

    def send_now(self, method: str, path: str, body: bytes,
                 on_head: Callable[[Response], None] | None = None) -> Sent | None:
        """Write the request at once, with no await, on an idle kept-alive
        connection; None when there is none (or a concurrency limit is set).
        ``response_to(sent)`` then waits for its response."""
        if self._slots is not None:
            return None
        conn = self._take_idle()
        if conn is None:
            return None
        response = Response(conn, on_head)
        request = self._encode(method, path, body)
        return Sent(conn, response, conn.send(request, response), request)

    async def request(self, method: str, path: str, body: bytes,
                      on_head: Callable[[Response], None] | None = None, head_timeout: float = 0.0) -> Response:
        """Send the request; return once the response's status and headers
        are in. ``on_head``: the response's ``on_head`` hook. ``head_timeout``
        (0: none): the longest wait for the head once the request is written
        (not for a connection or a slot): ``HttpError`` then."""
        return await self._exchange(self._encode(method, path, body), None, on_head, head_timeout)

    async def response_to(self, sent: Sent, head_timeout: float = 0.0) -> Response:
        """``request`` for a request ``send_now`` wrote. If the kept-alive
        connection was closed under it, the new connection's response gets
        the hook ``send_now`` was given (still unused: no byte came back)."""
        return await self._exchange(sent.request, sent, sent.response.on_head, head_timeout)

    async def _exchange(self, request: bytes, sent: Sent | None,
                        on_head: Callable[[Response], None] | None, head_timeout: float = 0.0) -> Response:
        slots = self._slots
        if slots is not None:
            await slots.acquire()
        try:
            for attempt in range(2):
                if sent is not None and attempt == 0:
                    conn, response, head, reused = sent.conn, sent.response, sent.head, True
                else:
                    conn = self._take_idle()
                    reused = conn is not None
                    if conn is None:
                        conn = await self._connect()
                    response = Response(conn, on_head)
                    head = conn.send(request, response)
                try:
                    if head_timeout:
                        async with asyncio.timeout(head_timeout):
                            await head
                    else:
                        await head
                except HttpError:
                    # A kept-alive connection the server closed meanwhile: the
                    # request never reached it (no byte came back); once more
                    # on a new one.
                    if reused and not conn.got_bytes and attempt == 0:
                        continue
                    raise
                except TimeoutError:  # (the server has the request: not sent again)
                    response.close()
                    raise HeadTimeout(f"no response head within {head_timeout:g}s") from None
                except BaseException:
                    response.close()
                    raise
                if slots is not None:
                    response._hold(slots.release)
                return response
            raise AssertionError("unreachable")
        except BaseException:
            if slots is not None:
                slots.release()
            raise

    def _encode(self, method: str, path: str, body: bytes) -> bytes:
        return b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method.encode(), (self.prefix + path).encode(), self._headers, len(body), body)

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()

    # -- connections -----------------------------------------------------------

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            # (closing, not yet closed: the peer's EOF closed the transport and
            # connection_lost runs a turn later; uvloop raises on a write then)
            if not conn.closed and now - conn.idle_since < KEEPALIVE and not (
                    conn.transport is not None and conn.transport.is_closing()):
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise HttpError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as e:
            raise HttpError(f"connect to {self.host}:{self.port} failed: {e}") from e
        self._all.add(conn)
        return conn

    def _idle_again(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
