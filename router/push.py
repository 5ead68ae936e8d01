"""The push relay: a generation's SSE events written to the client as they arrive.

``PushRelay`` is a ``Generation`` sink. Once the response head is out, each
piece the replica connection's reader hands it becomes its event (metrics,
encoding, resume buffer: ``router.relay.EventStream``) and goes to the
client's transport in the same callback: no task wakes up per token, no
async generator chain, no ASGI message per event. Pieces wait, and are
merged up to the tenant's ``chunk_tokens`` per event, only while the head is
not out yet, while the client's transport is paused (a slow reader: the
request task drains it; pieces that arrive meanwhile queue behind, so events
never overtake each other), or with an ASGI server whose transport the relay
cannot reach (then the request task sends every event, one ``send`` each).

The transport is reached through uvicorn's httptools protocol
(``send.__self__`` is its ``RequestResponseCycle``: ``transport``, ``flow``,
``disconnected``, ``chunked_encoding``, ``response_started``,
``response_complete``, ``keep_alive``, ``on_response``). On it the router
writes the whole response itself, as uvicorn's ``send`` would: the head
(``TransportWire.open``: uvicorn's default headers, then the router's), in
the same write as the first events, the chunked events, and the body's end,
in the same write as the stream's last events when they end it
(``TransportWire.finish``), after which it completes the cycle as uvicorn
does (the connection is kept alive or closed, a pipelined request starts).
That takes uvicorn's per-message work (header checks, a timeout context and
a wake-up per ``send``) and two system calls off every request (a one-token
stream is one write). Any other server gets ``AsgiWire``.
"""

from __future__ import annotations

import asyncio
import logging
import re

from replicas.protocol import FinishReason
from router.generation import StreamLost
from router.lane import Lane
from router.pieces import PieceQueue
from router.relay import EventStream

try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _HttptoolsCycle
except ImportError:  # pragma: no cover - uvicorn without httptools
    _HttptoolsCycle = None

_SSE_HEAD = b"HTTP/1.1 200 OK\r\n"
_SSE_TYPE = b"content-type: text/event-stream; charset=utf-8\r\n"
_END = b"0\r\n\r\n"  # the chunked body's end
# what uvicorn refuses in a header value (a client's Origin echoed by CORS)
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")

__all__ = ["PushRelay", "wire_for", "TransportWire", "AsgiWire", "ClientTooSlow", "bounded"]

log = logging.getLogger("fairstream.relay")


class ClientTooSlow(Exception):
    """The client took none of its stream for ``send_timeout`` seconds."""


async def bounded(aw, timeout: float):
    """``await aw``, or ``ClientTooSlow`` after ``timeout`` seconds (0: no limit)."""
    if not timeout:
        return await aw
    try:
        async with asyncio.timeout(timeout):
            return await aw
    except TimeoutError:
        raise ClientTooSlow(f"the client took none of its stream for {timeout:g}s") from None


class _Wire:
    """What both wires share: the router's ``send_timeout`` and the body's end."""

    __slots__ = ("timeout",)

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def end(self, send) -> None:
        """End the body with the server's own ``send`` (uvicorn's waits for the
        transport to drain: ``ClientTooSlow`` after ``timeout``)."""
        await bounded(send({"type": "http.response.body", "body": b"", "more_body": False}), self.timeout)


class TransportWire(_Wire):
    """Chunked body writes straight to uvicorn's transport (httptools).

    The head ``open`` makes goes out with the first write of the body, in
    the same system call (the first event follows the head at once: the
    head is made once the first piece is in), or on its own at the end of
    the loop's turn if nothing was written by then."""

    __slots__ = ("cycle", "transport", "flow", "_head")

    def __init__(self, cycle, timeout: float = 0.0, head: bytes | None = None) -> None:
        super().__init__(timeout)
        self.cycle = cycle
        self.transport = cycle.transport
        self.flow = cycle.flow
        self._head = head
        if head is not None:
            asyncio.get_running_loop().call_soon(self._write_head)

    @classmethod
    def open(cls, send, headers: dict[str, str], extra: list[tuple[bytes, bytes]],
             timeout: float = 0.0) -> TransportWire | None:
        """Make a ``200`` SSE response head (uvicorn's default headers,
        ``headers``, then ``extra``) for the transport of uvicorn's httptools
        cycle behind ``send``, and return the wire for its body (which writes
        the head with its first write, or at the end of this turn of the loop);
        None if ``send`` is not that cycle's, or it cannot take the head now
        (the caller then sends the head with ``send``). ``headers`` are the
        router's own; ``extra`` (CORS, which may echo the client's Origin)
        are checked as uvicorn checks every header."""
        cycle = getattr(send, "__self__", None)
        if (_HttptoolsCycle is None or type(cycle) is not _HttptoolsCycle or cycle.response_started
                or cycle.disconnected or cycle.flow.write_paused or cycle.scope["method"] not in ("POST", "GET")):
            return None
        for _, value in extra:
            if _BAD_VALUE.search(value):
                return None  # (uvicorn's send refuses it, as it refuses any other)
        # (the router's headers as one text, encoded once: a request's head
        # has ~9 of them, and two encodes and an append each were ~30 calls)
        own = "".join([f"{name}: {text}\r\n" for name, text in headers.items()]).encode("latin-1")
        parts = [_SSE_HEAD, *[b"%s: %s\r\n" % nv for nv in cycle.default_headers], _SSE_TYPE, own]
        if extra:
            parts += [b"%s: %s\r\n" % nv for nv in extra]
        if not cycle.keep_alive:  # (an HTTP/1.0 request's never is)
            parts.append(b"connection: close\r\n")
        http10 = cycle.scope.get("http_version") == "1.0"
        # HTTP/1.0 has no chunked encoding: the body ends where the connection does
        parts.append(b"\r\n" if http10 else b"transfer-encoding: chunked\r\n\r\n")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = not http10
        return (_Http10Wire if http10 else cls)(cycle, timeout, b"".join(parts))

    def _write_head(self) -> None:
        """The head, if no write of the body took it (a first piece that made
        no event), and the client is still there."""
        head = self._head
        if head is not None:
            self._head = None
            if not self.cycle.disconnected and not self.transport.is_closing():
                self.transport.write(head)

    @property
    def writable(self) -> bool:
        """A write now would not outrun the client (transport not paused)."""
        return not self.flow.write_paused and not self.cycle.disconnected

    @property
    def gone(self) -> bool:
        """The client disconnected."""
        return self.cycle.disconnected

    def write(self, data: bytes) -> None:
        if self._head is None:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            head, self._head = self._head, None
            self.transport.write(b"%s%x\r\n%s\r\n" % (head, len(data), data))

    def finish(self, data: bytes | None) -> None:
        """Write ``data`` (the stream's last events) and the body's end in
        one write, and complete the response as uvicorn's ``send`` does."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete:
            return
        out = b"%x\r\n%s\r\n%s" % (len(data), data, _END) if data else _END
        if self._head is not None:
            out = self._head + out
            self._head = None
        self.transport.write(out)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    async def end(self, send) -> None:
        """End the body unless ``finish`` did: once the transport takes
        writes (``ClientTooSlow`` after ``timeout``)."""
        if self.cycle.response_complete or self.cycle.disconnected:
            return
        await self.drain()
        self.finish(None)

    async def drain(self) -> None:
        """Until the transport takes writes again (or the client is gone);
        ``ClientTooSlow`` after ``timeout`` seconds."""
        if self.flow.write_paused and not self.cycle.disconnected:
            await bounded(self.flow.drain(), self.timeout)

    def abort(self) -> None:
        """Drop the connection now, whatever waits in its buffers."""
        self.transport.abort()

    async def send(self, data: bytes) -> None:
        await self.drain()
        if not self.cycle.disconnected:
            self.write(data)

    async def send_last(self, data: bytes) -> None:
        """``send`` the stream's last event, with the body's end."""
        await self.drain()
        self.finish(data)


class _Http10Wire(TransportWire):
    """``TransportWire`` for an HTTP/1.0 client: the body as is, not chunked,
    and its end is the connection's close (``open`` said ``connection:
    close``)."""

    __slots__ = ()

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        self.transport.write(data)

    def finish(self, data: bytes | None) -> None:
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete:
            return
        out = (self._head or b"") + (data or b"")
        self._head = None
        if out:
            self.transport.write(out)
        cycle.response_complete = True
        cycle.message_event.set()
        self.transport.close()
        cycle.on_response()


class AsgiWire(_Wire):
    """Any ASGI server: every event is one ``http.response.body`` message."""

    __slots__ = ("_send",)

    writable = False

    def __init__(self, send, timeout: float = 0.0) -> None:
        super().__init__(timeout)
        self._send = send

    async def send(self, data: bytes) -> None:
        await bounded(self._send({"type": "http.response.body", "body": data, "more_body": True}), self.timeout)

    send_last = send  # (``end`` ends the body)

    def abort(self) -> None:
        """(No transport to drop: the server closes the connection when the
        application returns without ending the body.)"""


def wire_for(send, timeout: float = 0.0) -> TransportWire | AsgiWire:
    """The fastest wire ``send`` allows; call after the response head was
    sent. ``timeout``: the router's ``send_timeout``."""
    cycle = getattr(send, "__self__", None)
    if (_HttptoolsCycle is not None and type(cycle) is _HttptoolsCycle and cycle.chunked_encoding
            and cycle.response_started and not cycle.response_complete):
        return TransportWire(cycle, timeout)
    return AsgiWire(send, timeout)


class PushRelay(PieceQueue):
    """Sink of one streamed generation; ``run`` writes what waits and returns
    when the stream has ended (``[DONE]`` or an error event written)."""

    __slots__ = ("events", "wire", "finished", "_tail")

    def __init__(self, limit: int = 0) -> None:
        super().__init__(limit)
        self.events: EventStream | None = None
        self.wire: TransportWire | AsgiWire | None = None
        self.finished = False
        # the stream's tail (usage, ``[DONE]``, the body's end) is left to
        # ``run``, to go out once the ticket is settled (``EventStream.release_first``)
        self._tail = False

    def piece(self, text: str, n: int, finish: FinishReason) -> None:
        wire = self.wire
        if wire is not None and wire.writable and not self._pending:  # (a TransportWire)
            data = self._encode(text, n, finish)
            if self.finished:
                if not self._tail:
                    wire.finish(data)
                elif data:
                    wire.write(data)
                self._wake()
            elif data:
                wire.write(data)
            return
        self._pending.append((text, n, finish))
        self._wake()

    def lane(self, gen, handle, dog, sched) -> Lane | None:
        """A token lane (router/lane.py) for ``gen``'s next plain pieces, if
        this stream can take one: SSE straight to uvicorn's transport, its
        first token out, nothing waiting, no continuous usage."""
        es, wire = self.events, self.wire
        if (self._pending or type(wire) is not TransportWire or es is None or es.last is None or es.usage_each
                or es.skip_chars or not es.enc.plain_ready):
            return None
        observe = sched.observe if sched.adapts(handle.slot) else None
        return Lane(gen, self, es, wire, handle, dog, sched.counters.charge, observe, es.policy)

    async def first(self) -> None:
        """Wait for the first piece; raise the failure if that came first."""
        await self._until_ready()
        if not self._pending:
            raise self._failure()

    def _encode_waiting(self) -> bytes | None:
        """The bytes of the pieces that wait. A failure (a bug) ends the
        stream with an error event, as one in ``piece`` does through
        ``Generation.on_delta``: the generation stops, the client is told."""
        try:
            return self._encode(*self._take())
        except Exception as e:  # noqa: BLE001 - this stream only
            self._pending.clear()
            self._exc = self._broken(e)
            return None

    def _encode_tail(self) -> bytes:
        """The stream's tail, left to ``run`` (``_tail``); its error event
        if encoding it fails."""
        events = self.events
        assert events is not None
        try:
            return b"".join(events.tail())
        except Exception as e:  # noqa: BLE001 - this stream only
            return events.failed(self._broken(e))

    def _broken(self, e: Exception) -> StreamLost:
        """A bug encoding this stream's output: it stops, its client is told."""
        log.exception("stream relay failed encoding its output", exc_info=e)
        assert self.events is not None
        self.events.gen.close()
        return StreamLost(f"internal error relaying the stream: {e!r}")

    def _encode(self, text: str, n: int, finish: FinishReason) -> bytes | None:
        events = self.events
        assert events is not None
        data = events.event(text, n, finish)
        if finish != FinishReason.NONE:
            if events.release_first:
                self._tail = True
            else:
                data = (data or b"") + b"".join(events.tail())
            self.finished = True
        return data

    async def run(self, events: EventStream, wire: TransportWire | AsgiWire) -> None:
        """Relay until the end of the stream (the response head is out) or
        the client's disconnect."""
        self.events = events
        self.wire = wire  # from here on, pieces may be written as they arrive
        while True:
            if self._pending:
                if isinstance(wire, AsgiWire):
                    # piece() never writes to this wire: nothing can overtake
                    data = self._encode_waiting()
                    if data:
                        await wire.send(data)
                    continue
                if not wire.writable:
                    if wire.gone:
                        return
                    await wire.drain()  # pieces keep queueing behind what waits
                    continue
                data = self._encode_waiting()  # and written with no await between
                if self.finished and not self._tail:
                    wire.finish(data)
                elif data:
                    wire.write(data)
                continue
            if self.finished:
                if self._tail:  # (nothing can come after the last piece: an await is safe here)
                    self._tail = False
                    data = self._encode_tail()  # (first: a client leaving now still has a finished stream)
                    await events.release()
                    await wire.send_last(data)
                return
            if self._exc is not None:
                data = events.failed(self._exc)
                self.finished = True
                if events.release_first:
                    await events.release()
                await wire.send_last(data)
                return
            await self._until_ready()

    async def _until_ready(self) -> None:
        while not self._pending and self._exc is None and not self.finished:
            await self._sleep()
