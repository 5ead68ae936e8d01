"""The client connection's HTTP/1.1 protocol: uvicorn's httptools protocol
with the limits a server facing many clients needs.

uvicorn sets none for a request's head: here a connection that sends no
complete head within router.yaml's ``header_timeout`` gets a 408 (as one
whose body stops arriving for ``body_timeout``, or has not come whole
within ``body_total_timeout``), a head (or a chunked body's trailers)
larger than ``MAX_HEAD_BYTES`` a 431 (``router.request_size``), bytes
that are not HTTP/1.1 a 400, an HTTP/1.0 WebSocket upgrade a 400, all in OpenAI's error shape and counted in
``fairstream_http_connections_refused_total``. At start the router raises
its open-file limit to the hard limit (``open_file_limit``) and serves at
most ``max_connections`` client connections (by default about half that
limit: ``default_max_connections``): one more gets a 503 once its request is
read, and is closed after a lingering close (``HttpConnection._linger``);
past ``OVER_CAP_HELD`` such connections at once, one more gets the 503 as it
connects and is closed then. So a flood of connections cannot take the
descriptors the open streams need for their replicas and upstreams. At
shutdown a connection whose request has not come whole gets
``SHUTDOWN_READ`` seconds and a 503 ``router_shutdown``, not a reset.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.descriptors import OVER_CAP_HELD, default_max_connections, open_file_limit
from router.errors import RouterShutdown, error_body
from router.handshake import Handshake
from router.ids import new_id
from router.metrics import Metrics
from router.request_size import MAX_HEAD_BYTES, RequestSize

__all__ = ["HttpConnection", "MAX_HEAD_BYTES", "open_file_limit", "default_max_connections"]

log = logging.getLogger("fairstream.router")

HEAD_TIMEOUT = "Timed out reading the request head."
BODY_TIMEOUT = "Timed out reading the request body."
BODY_TOO_SLOW = "Timed out reading the request body: it arrived too slowly."
# fairstream_http_connections_refused_total's reason of each refusal (and
# the error's code)
_REASONS = {HEAD_TIMEOUT: "header_timeout", BODY_TIMEOUT: "body_timeout", BODY_TOO_SLOW: "body_timeout"}
# at most one "too many connections" warning per this many seconds
OVER_CAP_LOG_INTERVAL = 10.0
# seconds a connection past max_connections has to send its request before
# it is answered anyway (it must not hold a descriptor for the head timeout)
OVER_CAP_READ = 2.0
# seconds a connection whose request had not come whole when shutdown
# began has to send its head (then it is answered 503: HttpConnection.shutdown)
SHUTDOWN_READ = 1.0
# seconds a refused connection is read (and what it sends dropped) after its
# answer, before it is closed: ``HttpConnection._linger``
LINGER = 2.0
class _Pipeline(list):
    """uvicorn's queue of pipelined requests (it uses ``appendleft``, ``pop``
    and truth) on a list: an empty ``deque`` takes 624 bytes, an empty list
    56, on every connection, and requests rarely queue."""

    __slots__ = ()

    def appendleft(self, item) -> None:
        self.insert(0, item)


class _ListEvent(asyncio.Event):
    """``asyncio.Event`` with its waiters in a list (it appends, removes and
    iterates them): an empty ``deque`` takes 624 bytes, an empty list 56.
    uvicorn keeps two events per connection (its flow control's and the
    request's), and they are rarely waited on by more than one task."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters = []  # type: ignore[assignment]


def _answer_unread(cycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """``HttpConnection.answer_unread`` on the connection ``cycle``'s
    transport serves (False once it serves another protocol: a WebSocket)."""
    conn = cycle.transport.get_protocol()
    return isinstance(conn, HttpConnection) and conn.answer_unread(cycle, status, headers, body)


class HttpConnection(RequestSize, HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module's
    docstring (``head_timeout``, ``body_timeout``, ``body_total_timeout``:
    router.yaml's, set by ``Server``; between requests, uvicorn's keep-alive
    timeout applies), serving an upgrade it does not take as a plain request."""

    # (the router's own per-connection state in slots: uvicorn's ~27
    # attributes share their keys among instances, and 7 more in the
    # instance dict pushed it past CPython's limit for shared keys, to a
    # 1.6 KB dict of its own on every connection)
    __slots__ = ("_in_head", "_refused", "_over", "_deadline", "_lost", "_stopping", "_body_by",
                 "_body_at", "_upgrade")

    head_timeout = 30.0
    body_timeout = 60.0
    body_total_timeout = 120.0
    max_connections = 0  # 0: no cap
    metrics: Metrics | None = None  # (the router's: open and refused connections)
    _over_cap_logged = -OVER_CAP_LOG_INTERVAL  # (loop time of the last warning)
    _over_cap_count = 0  # connections refused since, not yet in a warning
    _over_cap_flush: asyncio.TimerHandle | None = None  # (the warning for the last of them)
    # connections past the cap open now that read or linger (at most
    # OVER_CAP_HELD): counted up in connection_made and down in
    # connection_lost, so never reset (a server's connections all close)
    _over_held = 0

    @classmethod
    def configure(cls, head_timeout: float, body_timeout: float, body_total_timeout: float, max_connections: int,
                  metrics: Metrics | None = None) -> None:
        """The limits of this process's server (one server per process), the
        metrics it counts connections in, and a fresh tally of connections
        refused past the cap."""
        cls.head_timeout, cls.body_timeout, cls.body_total_timeout = head_timeout, body_timeout, body_total_timeout
        cls.max_connections = max_connections
        cls.metrics = Handshake.metrics = metrics  # (Handshake: the WebSocket handshakes websockets refuses)
        if cls._over_cap_flush is not None:
            cls._over_cap_flush.cancel()
        cls._over_cap_flush, cls._over_cap_count, cls._over_cap_logged = None, 0, -OVER_CAP_LOG_INTERVAL

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        self.flow._is_writable_event = writable = _ListEvent()
        writable.set()  # (as FlowControl starts: writable)
        if self.metrics is not None:
            self.metrics.connections.inc()
        self._open_size()
        self._in_head = True
        self._refused = False
        self._stopping = False  # (shutdown began before its request came whole: see shutdown)
        # one past max_connections: its request is read, then answered 503;
        # past OVER_CAP_HELD of those at once, answered now (and not counted)
        over = 0 < self.max_connections < len(self.connections)
        now = over and HttpConnection._over_held >= OVER_CAP_HELD
        self._over = over and not now
        if self._over:
            HttpConnection._over_held += 1
        self._deadline: asyncio.TimerHandle | None = None
        self._body_by = 0.0  # (loop time the request's body must have come whole by: _start_body)
        self._body_at = -1.0  # (loop time _limit_body last armed the deadline, -1 once another limit replaced it)
        self._lost: list[Callable[[], None]] = []  # (see on_headers_complete)
        self._upgrade = False  # (an upgrade served as a plain request, from its head to its body's: _ignore_upgrade)
        if now:
            # Answered before its request, which it may be sending: if that
            # is in the socket when it closes, the client sees a reset and
            # not the 503 (a lingering close would keep its descriptor). But
            # a flood cannot hold more than OVER_CAP_HELD descriptors.
            self._refuse_over_cap(linger=False)
        elif self._over:  # (its request, or not, within OVER_CAP_READ: answered all the same)
            self._deadline = self.loop.call_later(OVER_CAP_READ, self._refuse_over_cap)
        else:
            self._limit(self.head_timeout, HEAD_TIMEOUT)

    def _limit(self, seconds: float, why: str | None) -> None:
        self._body_at = -1.0
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = (self.loop.call_later(seconds, self._refuse, 408, why, _REASONS[why], _REASONS[why])
                          if why else None)

    def _limit_unless_queued(self, seconds: float, why: str) -> None:
        """``_limit``, except for a request queued behind a response under way:
        uvicorn stops reading then, so what it has not sent may not arrive,
        and its time starts when it does (``on_response_complete``)."""
        if self.pipeline:
            self._limit(0, None)
        else:
            self._limit(seconds, why)

    def _start_body(self) -> None:
        """The request's body starts to count: it must come whole within
        ``body_total_timeout`` from now (``_limit_body``)."""
        self._body_by = self.loop.time() + self.body_total_timeout
        self._limit_body()

    def _limit_body(self) -> None:
        """The body's one deadline, as the head's: ``body_timeout`` from now
        (between two reads, as nginx's), but never past its total's end.
        Reset at each read alone, it let a body trickled a byte at a time
        hold its connection for as long as its length lasted (megabytes:
        days). None for a request queued behind a response under way
        (``_limit_unless_queued``; it starts in ``on_response_complete``)."""
        now = self.loop.time()
        left = self._body_by - now
        if left < self.body_timeout:
            self._limit_unless_queued(max(0.0, left), BODY_TOO_SLOW)
        else:
            self._limit_unless_queued(self.body_timeout, BODY_TIMEOUT)
        self._body_at = now

    def _refuse(self, status: int, message: str, code: str, reason: str, linger: bool = True) -> None:
        """Answer ``status`` as an OpenAI error with that ``code`` (a 503 with
        ``Retry-After: 1``) unless a response is under way, and close the
        connection (after a lingering close unless not ``linger``); counted
        with that ``reason``."""
        if self._refused or self.transport.is_closing():
            return  # (answered already: its linger's close stays armed)
        self._limit(0, None)
        self._refused = True
        if self.metrics is not None:
            self.metrics.connections_refused.labels(reason).inc()
        cycle = self.cycle
        # (no response under way: none started, and no earlier request's
        # response that this pipelined one waits behind)
        if (cycle is None or cycle.response_complete or not cycle.response_started) and not self.pipeline:
            if status == 503:
                body = error_body(message, "server_error", None, code)
                head = b"content-type: application/json\r\nretry-after: 1\r\n"
            else:
                body = error_body(message, "invalid_request_error", None, code)
                head = b"content-type: application/json\r\n"
            head += b"x-request-id: %s\r\n" % new_id().encode()  # (as every other answer of the API)
            if self._answer_closing(status, head + b"content-length: %d\r\n" % len(body), body, linger):
                return
        self.transport.close()

    def _answer_closing(self, status: int, head: bytes, body: bytes, linger: bool = True) -> bool:
        """Write a response with ``connection: close`` and close after a
        lingering close (``_linger``); False: that cannot be (TLS) or is not
        wanted, close now."""
        self.transport.write(b"HTTP/1.1 %d %s\r\n%sconnection: close\r\n\r\n%s"
                             % (status, HTTPStatus(status).phrase.encode(), head, body))
        return linger and self._linger()

    def _linger(self) -> bool:
        """Close the connection's sending side after a refusal and discard
        what the client still sends, until it closes its side or ``LINGER``
        seconds pass (nginx's lingering close). Closed at once, a socket with
        unread bytes, or bytes still arriving, is reset, and a client that
        sends its whole request before it reads (most do) then sees the reset
        instead of the answer: a header too large, a body past the head's
        timeout, a pipelined request past ``max_connections``. False where the
        transport cannot half-close (TLS)."""
        transport = self.transport
        if not transport.can_write_eof():
            return False
        transport.write_eof()  # (after what is buffered; data_received drops what comes in)
        self.flow.resume_reading()  # (uvicorn pauses reading while requests queue)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # (an earlier request's handler that has not answered yet: its
            # writes now would follow the end of the stream, which uvloop
            # refuses; as for a closed connection, it hears a disconnect)
            cycle.disconnected = True
            cycle.message_event.set()
        for callback in list(self._lost):  # (a fast-path handler still generating stops now, not at the close)
            callback()
        self._deadline = self.loop.call_later(LINGER, transport.close)
        return True

    def answer_unread(self, cycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Answer ``cycle``'s request, whose body has not been read (a refusal
        made from its head: no key, a body over the limit), and close the
        connection after a lingering close (``_linger``). Closed at once
        with that body unread or still arriving, the socket was reset, and a
        client that writes its whole request before it reads (the async
        openai SDK, httpx's AsyncClient) saw a connection error, which the
        SDK retries, instead of the answer. False (nothing done) unless
        ``cycle`` is this connection's latest request and nothing was
        answered yet: the caller then answers as before."""
        if cycle is not self.cycle or cycle.response_started or self._refused or self.transport.is_closing():
            return False
        self._limit(0, None)
        self._refused = True  # (what the client still sends is dropped: data_received)
        cycle.response_started = cycle.response_complete = True  # (uvicorn's cycle: nothing more to send)
        head = b"".join(k + b": " + v + b"\r\n" for k, v in headers if k.lower() != b"connection")
        if cycle.scope.get("method") == "HEAD":
            body = b""  # (its head only, as uvicorn sends it: RFC 9110 9.3.2)
        if not self._answer_closing(status, head, body):
            self.transport.close()
        return True

    def _refuse_over_cap(self, linger: bool = True) -> None:
        """Answer a connection past ``max_connections`` (its request read,
        or ``OVER_CAP_READ`` passed; or not read, and not ``linger``: past
        ``OVER_CAP_HELD``)."""
        if self._refused or self.transport.is_closing():
            return
        cls = type(self)
        cls._over_cap_count += 1
        wait = cls._over_cap_logged + OVER_CAP_LOG_INTERVAL - self.loop.time()
        if wait <= 0:
            self._warn_over_cap(self.loop, len(self.connections))
        elif cls._over_cap_flush is None:  # (the last of a burst is told too)
            cls._over_cap_flush = self.loop.call_later(wait, self._warn_over_cap, self.loop, None)
        self._refuse(503, f"The router has too many open connections ({self.max_connections}); retry shortly.",
                     "too_many_connections", "max_connections", linger)

    @classmethod
    def _warn_over_cap(cls, loop, open_now: int | None) -> None:
        if cls._over_cap_flush is not None:
            cls._over_cap_flush.cancel()
            cls._over_cap_flush = None
        if cls._over_cap_count:
            now = f"{open_now} connections open" if open_now is not None else "connections"
            log.warning("%s past max_connections (%d): %d refused with a 503 since the last warning",
                        now, cls.max_connections, cls._over_cap_count)
        cls._over_cap_logged, cls._over_cap_count = loop.time(), 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1 (a smuggling
        attempt, a NUL in a header): a refusal in OpenAI's error shape
        instead of its plain text, and never written into a response under
        way (a pipelined request's bad head cut a stream with it)."""
        self._refuse(400, f"{msg} It is not valid HTTP/1.1.", "invalid_http_request", "invalid_http")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._feed(data)
        if not self._refused:
            self._count_read(data)

    def _feed(self, data: bytes) -> None:  # (uvicorn's data_received, but for _ignore_upgrade)
        self._unset_keepalive_if_required()
        rest: bytes | None = data
        while rest is not None:  # (a loop, not a recursion: one read may hold thousands of upgrades)
            data, rest = rest, None
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                elif self._upgrade:
                    rest = self._ignore_upgrade(data[e.args[0]:])
            except httptools.HttpParserError:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")

    def _ignore_upgrade(self, rest: bytes) -> bytes:
        """Serve a request asking for an upgrade other than a WebSocket's (``Upgrade: h2c``:
        ``curl --http2``) as the HTTP/1.1 request it also is (RFC 9110 7.8). httptools stops at
        its head and parses no more (uvicorn served it bodiless and nothing after it): a new
        parser goes on, fed first a head of its framing headers (no request: ``_upgrade``): returned."""
        framing = b"".join(b"%s: %s\r\n" % h for h in self.headers if h[0] in (b"content-length", b"transfer-encoding"))
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # (as uvicorn's)
        self.headers, self.url, self._head = [], b"", 0  # (that head's; the request's are in its scope)
        return b"POST / HTTP/1.1\r\n%s\r\n%s" % (framing, rest)

    def on_message_begin(self) -> None:
        if self._refused or self._upgrade:
            # (a request pipelined behind the refused one, in the same read:
            # never served, and its head timer must not replace the linger's)
            return
        super().on_message_begin()
        if not self._in_head and not self._over:  # a keep-alive connection's next request
            self._in_head = True
            self._limit_unless_queued(self.head_timeout, HEAD_TIMEOUT)
        self._start_size()

    def on_headers_complete(self) -> None:
        if self._upgrade:  # (_ignore_upgrade's head: its request's body follows)
            self._upgrade = False
            return
        self._in_head = False
        if self._refused:
            return  # (the application never sees the request)
        if self._stopping:  # (nor does it see one that came whole after shutdown began)
            self._refuse_shutdown()
            return
        if self._over:
            if self.expect_100_continue:  # (it holds its body back for a 100: answer now, as RFC 9110 allows)
                self._refuse_over_cap()
            return  # (read to its end, then answered: on_message_complete)
        before = self.cycle
        super().on_headers_complete()  # (queues it behind a response under way, if one is)
        self._start_body()
        if self.cycle is not None:
            if self.cycle is not before:  # (a new request's: nothing waits on uvicorn's event yet)
                self.cycle.message_event = _ListEvent()
            # what the request's handler wants called when the connection
            # is lost (router.fastpath: no waiter task per request)
            self.cycle.lost_callbacks = self._lost
            # (and what answers an error before the body is read: router.fastpath;
            # a function, not this connection's bound method, which would
            # put the connection and its request in a reference cycle)
            self.cycle.answer_unread = _answer_unread
        self._upgrade = self.parser.should_upgrade() and not self._should_upgrade()  # (see _ignore_upgrade)

    def on_body(self, body: bytes) -> None:
        self._bodied = True  # (request_size: this read gave a body byte)
        if self._refused:
            return
        if not self._over:
            # (not again at the same loop time, as when the body came in the
            # head's read: uvloop's clock is that of the loop's turn, so the
            # same deadline would replace itself)
            if self.loop.time() != self._body_at:
                self._limit_body()
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused or self._upgrade:  # (_upgrade: its body is still to come)
            return
        if self._over:
            self._refuse_over_cap()
            return
        self._limit(0, None)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        if not queued or self.pipeline or self._refused or self.transport.is_closing():
            return
        # The last queued request starts: the time of what it has not sent
        # yet starts now (behind a response under way it may not have been
        # read: uvicorn pauses reading while requests queue).
        if self._in_head:
            self._limit(self.head_timeout, HEAD_TIMEOUT)
        elif self.cycle is not None and self.cycle.more_body:
            self._start_body()

    def handle_websocket_upgrade(self) -> None:
        if self._refused:
            return  # (an upgrade pipelined behind a refused request: the connection is closing)
        self._limit(0, None)  # (the WebSocket protocol takes the connection over)
        if self._over:
            self._refuse_over_cap()
            return
        version = self.scope["http_version"]
        if version < "1.1":  # (httptools parses HTTP/1.x and 0.9 only: one digit each side of the dot)
            # uvicorn hands websockets the request as HTTP/1.1 whatever it was,
            # and would upgrade an HTTP/1.0 connection; RFC 6455 4.1 wants 1.1
            self._refuse(400, f"A WebSocket upgrade needs HTTP/1.1 or later (RFC 6455, section 4.1); this request "
                              f"is HTTP/{version}.", "invalid_websocket_handshake", "invalid_websocket_handshake")
            return
        if self.metrics is not None:  # (counted by _WebSocket from here on; this protocol hears no more)
            self.metrics.connections.dec()
        super().handle_websocket_upgrade()
        # uvicorn's parser calls this protocol back through bound methods, a
        # reference cycle it cuts in connection_lost, which this protocol no
        # longer hears: cut here, it kept the connection until a collection
        self.parser = None  # type: ignore[assignment]

    def shutdown(self) -> None:
        """uvicorn's (an idle connection is closed; a busy one after its
        response), except for a connection whose request has not come whole:
        one that has sent no request yet, or is sending a head. Closed now,
        it would leave its client a reset for a request (or a WebSocket
        upgrade) it sent, or is sending, and no word why; it gets
        ``SHUTDOWN_READ`` seconds to send the head, and is answered 503
        ``router_shutdown`` then (or when they are up: one that sent nothing
        is closed). An idle keep-alive connection is closed at once, as
        uvicorn does: its client knows a reused connection may close."""
        if (self._in_head and not self._refused and not self._over and not self.pipeline
                and (self.cycle is None or (self._raw and self.cycle.response_complete))):
            self._stopping = True
            self._limit(0, None)
            self._deadline = self.loop.call_later(SHUTDOWN_READ, self._stop_reading)
            return
        super().shutdown()

    def _stop_reading(self) -> None:
        if self._raw:  # a head begun and not ended
            self._refuse_shutdown()
        elif not self._refused:
            self.transport.close()

    def _refuse_shutdown(self) -> None:
        e = RouterShutdown()
        self._refuse(e.status, e.message, "router_shutdown", "shutdown")

    def connection_lost(self, exc: Exception | None) -> None:
        self._limit(0, None)
        if self._over:
            HttpConnection._over_held -= 1
        if self.metrics is not None:
            self.metrics.connections.dec()
        super().connection_lost(exc)
        for callback in list(self._lost):
            callback()
