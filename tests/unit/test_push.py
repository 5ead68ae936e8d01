"""The push relay's ordering and ending rules, driven by hand.

``PushRelay`` writes to uvicorn's transport from the replica reader's
callbacks and, while the transport is paused, from the request task. These
tests run the real relay, the real ``TransportWire`` over uvicorn's real
``FlowControl`` and (for the second) a real ``Generation`` fed through a
real ``Collector``; only the socket (a list of writes), the events'
encoding and the replica connection are stand-ins.
"""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

from uvicorn.protocols.http.flow_control import FlowControl

from replicas.protocol import Delta, FinishReason
import pytest

from router.generation import StreamLost
from router.metrics import Metrics
from router.pieces import PieceQueue
from router.push import ClientTooSlow, PushRelay, TransportWire
from router.relay import RELEASE_WAIT, EventStream
from router.sse import ChunkEncoder
from tests.unit.generations import started

NONE, STOP = FinishReason.NONE, FinishReason.STOP


class Socket:
    """What reaches the client: the chunked writes, de-framed (a write's
    data chunk, if it has one; ``ended``: the body's end came, and nothing
    may follow it)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.ended = False
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.ended, "a write after the body's end"
        while data:
            size, _, data = data.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                assert data == b"\r\n"
                self.ended = True
                return
            assert data[n:n + 2] == b"\r\n"
            self.writes.append(data[:n])
            data = data[n + 2:]

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Cycle:
    """The parts of uvicorn's RequestResponseCycle the wire reads and sets."""

    def __init__(self, keep_alive: bool = True) -> None:
        self.transport = Socket()
        self.flow = FlowControl(self.transport)
        self.disconnected = False
        self.response_complete = False
        self.keep_alive = keep_alive
        self.message_event = asyncio.Event()
        self.completed = 0  # on_response calls

    def on_response(self) -> None:
        self.completed += 1


class Events:
    """EventStream's interface: an event is its text, the tail ``[DONE]``.
    ``release_first``: the ticket is settled (``release``, held until
    ``released`` is set) before the tail goes out, as on a shared store;
    ``writes_at_release`` is what the client had then."""

    def __init__(self, fail_on_tail: bool = False, gen=None, release_first: bool = False,
                 socket: Socket | None = None) -> None:
        self.fail_on_tail = fail_on_tail
        self.gen = gen
        self.release_first = release_first
        self.socket = socket
        self.released = asyncio.Event()
        self.writes_at_release: list[bytes] | None = None
        self.calls: list[str] = []

    async def release(self) -> None:
        assert self.release_first
        self.calls.append("release")
        self.release_first = False  # (the ticket is done)
        await self.released.wait()
        assert self.socket is not None
        self.writes_at_release = list(self.socket.writes)

    def event(self, text: str, n: int, finish: FinishReason) -> bytes | None:
        return text.encode() if text or finish != NONE else None

    def tail(self) -> list[bytes]:
        self.calls.append("tail")
        if self.fail_on_tail:
            raise RuntimeError("encoding the tail failed")
        return [b"[DONE]"]

    def failed(self, e: BaseException) -> bytes:
        self.calls.append("failed")
        return b"error: " + str(e).encode()


async def test_events_queued_behind_a_paused_transport_are_never_overtaken() -> None:
    cycle = Cycle()
    relay = PushRelay(limit=1)
    cycle.flow.pause_writing()  # a slow client: its transport is paused
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    relay.piece("a", 1, NONE)
    await asyncio.sleep(0)  # the request task now waits for the transport
    # The transport drains; before the request task runs again the
    # replica's reader delivers more, the last piece included.
    cycle.flow.resume_writing()
    relay.piece("b", 1, NONE)
    relay.piece("c", 1, STOP)
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes == [b"a", b"b", b"c[DONE]"]
    # the last events and the body's end went in one write, and the
    # response is complete, as uvicorn's send leaves it
    assert cycle.transport.ended and cycle.response_complete and cycle.completed == 1
    assert cycle.message_event.is_set() and not cycle.transport.closed


async def test_pieces_are_written_at_once_while_the_transport_takes_them() -> None:
    cycle = Cycle()
    relay = PushRelay(limit=16)
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    await asyncio.sleep(0)
    relay.piece("a", 1, NONE)
    assert cycle.transport.writes == [b"a"]  # in the callback, no task switch
    relay.piece("b", 1, STOP)
    assert cycle.transport.writes == [b"a", b"b[DONE]"] and cycle.transport.ended and cycle.completed == 1
    await asyncio.wait_for(run, 1)
    await TransportWire(cycle).end(None)  # (what the request task does next: nothing more to write)
    assert cycle.completed == 1


async def test_a_connection_not_kept_alive_is_closed_after_the_last_write() -> None:
    cycle = Cycle(keep_alive=False)  # (an HTTP/1.0 client, or "connection: close")
    relay = PushRelay(limit=16)
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    await asyncio.sleep(0)
    relay.piece("a", 1, STOP)
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes == [b"a[DONE]"] and cycle.transport.ended and cycle.transport.closed


async def test_an_error_event_ends_the_body_and_a_gone_client_gets_no_end() -> None:
    cycle = Cycle()
    relay = PushRelay()
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    await asyncio.sleep(0)
    relay.fail(RuntimeError("the replica died"))
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes == [b"error: the replica died"] and cycle.transport.ended
    assert cycle.completed == 1

    gone = Cycle()
    gone.disconnected = True
    TransportWire(gone).finish(b"late")
    assert gone.transport.writes == [] and not gone.transport.ended and gone.completed == 0


async def test_a_failure_on_the_last_piece_ends_the_stream_with_an_error_event() -> None:
    cycle = Cycle()
    relay = PushRelay()
    gen, col, slot, client = started(relay, max_tokens=4)
    col.put(Delta(1, [7], "x", NONE, [1, 2]))
    run = asyncio.ensure_future(relay.run(Events(fail_on_tail=True), TransportWire(cycle)))
    await asyncio.sleep(0)
    col.put(Delta(1, [8], "y", STOP))  # its tail fails to encode
    await asyncio.wait_for(run, 1)  # ends: does not wait for a piece that will never come
    assert cycle.transport.writes[0] == b"x"
    assert cycle.transport.writes[-1].startswith(b"error: internal error"), cycle.transport.writes
    assert slot.inflight == 0 and client.released == [1]


async def test_a_failure_on_a_last_piece_queued_behind_a_slow_client_ends_the_stream_with_an_error_event() -> None:
    # (the request task encodes what waited: the failure is its own to handle)
    cycle = Cycle()
    relay = PushRelay()
    gen, col, slot, client = started(relay, max_tokens=4)
    col.put(Delta(1, [7], "x", NONE, [1, 2]))
    run = asyncio.ensure_future(relay.run(Events(fail_on_tail=True, gen=gen), TransportWire(cycle)))
    await asyncio.sleep(0)
    cycle.flow.pause_writing()  # a slow client
    col.put(Delta(1, [8], "y", STOP))  # waits behind the paused transport; its tail fails to encode
    cycle.flow.resume_writing()
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes[-1].startswith(b"error: internal error"), cycle.transport.writes
    assert slot.inflight == 0 and client.released == [1]


async def test_on_a_shared_store_the_tail_waits_for_the_release_and_the_last_piece_does_not() -> None:
    # (a client's next request follows [DONE] at once: the lease must be free by then)
    cycle = Cycle()
    relay = PushRelay(limit=16)
    events = Events(release_first=True, socket=cycle.transport)
    run = asyncio.ensure_future(relay.run(events, TransportWire(cycle)))
    await asyncio.sleep(0)
    relay.piece("a", 1, NONE)
    relay.piece("b", 1, STOP)
    assert cycle.transport.writes == [b"a", b"b"]  # the last piece's text at once, in the callback
    for _ in range(3):
        await asyncio.sleep(0)
    assert not cycle.transport.ended and cycle.completed == 0  # the tail waits for the release
    events.released.set()
    await asyncio.wait_for(run, 1)
    assert events.writes_at_release == [b"a", b"b"]
    assert cycle.transport.writes == [b"a", b"b", b"[DONE]"] and cycle.transport.ended and cycle.completed == 1
    # the ending was encoded before the release: a client that leaves during
    # it still has a finished stream (the tail sets the outcome "ok")
    assert events.calls == ["tail", "release"]


@pytest.mark.parametrize("how", ["error", "tail fails", "paused"])
async def test_on_a_shared_store_every_end_of_the_stream_comes_after_the_release(how: str) -> None:
    cycle = Cycle()
    relay = PushRelay(limit=16)
    events = Events(release_first=True, socket=cycle.transport, fail_on_tail=how == "tail fails")
    if how == "tail fails":
        events.gen = started(relay, max_tokens=4)[0]
    run = asyncio.ensure_future(relay.run(events, TransportWire(cycle)))
    await asyncio.sleep(0)
    if how == "paused":
        cycle.flow.pause_writing()
    relay.piece("a", 1, NONE)
    if how == "error":
        relay.fail(RuntimeError("the replica died"))
    else:
        relay.piece("b", 1, STOP)
    if how == "paused":
        await asyncio.sleep(0)
        cycle.flow.resume_writing()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not cycle.transport.ended
    events.released.set()
    await asyncio.wait_for(run, 1)
    assert cycle.transport.ended and cycle.completed == 1
    last = cycle.transport.writes[-1]
    assert events.writes_at_release == cycle.transport.writes[:-1], (events.writes_at_release, last)
    expected = {"error": b"error: the replica died", "paused": b"[DONE]"}.get(how)
    assert last == expected if expected else last.startswith(b"error: internal error"), last
    assert events.calls == {"error": ["failed", "release"], "paused": ["tail", "release"],
                            "tail fails": ["tail", "failed", "release"]}[how]


class _Admission:
    """``Admission`` on a shared store whose settlement hangs until ``done`` is set."""

    def __init__(self) -> None:
        self.store = SimpleNamespace(shared=True, healthy=True)
        self.done = asyncio.Event()
        self.finished: list[int] = []

    async def finish(self, ticket, used: int) -> None:
        ticket.done = True
        self.finished.append(used)
        await self.done.wait()

    def finish_now(self, ticket, used: int) -> None:
        pass  # (as Admission's on a shared store)


async def _relayed_on_a_hanging_store() -> tuple[Cycle, PushRelay, EventStream, _Admission, list[asyncio.Task],
                                                   asyncio.Future]:
    """A push relay running a real ``EventStream`` of a real generation, on a
    shared store whose settlement hangs; the background tasks, and the relay's."""
    cycle = Cycle()
    relay = PushRelay(limit=16)
    tasks: list[asyncio.Task] = []

    def background(coro) -> asyncio.Task:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    admission = _Admission()
    svc = SimpleNamespace(metrics=Metrics(), admission=admission, background=background)
    gen = started(relay, max_tokens=4)[0]
    outcome = SimpleNamespace(started=time.monotonic(), counted=(0, 0), record=lambda *a, **kw: None)
    es = EventStream(svc, gen, ChunkEncoder(False, "cmpl-x", "m", 0), (False, False),  # type: ignore[arg-type]
                     SimpleNamespace(name="t", priority="normal"), SimpleNamespace(done=False),  # type: ignore[arg-type]
                     outcome, None)  # type: ignore[arg-type]
    run = asyncio.ensure_future(relay.run(es, TransportWire(cycle)))
    await asyncio.sleep(0)
    return cycle, relay, es, admission, tasks, run


async def test_a_store_that_hangs_holds_a_streams_end_no_longer_than_release_wait() -> None:
    cycle, relay, es, admission, tasks, run = await _relayed_on_a_hanging_store()
    began = time.monotonic()
    relay.piece("a", 1, STOP)
    await asyncio.wait_for(run, 5)
    waited = time.monotonic() - began
    assert RELEASE_WAIT <= waited < RELEASE_WAIT + 0.5, waited
    assert cycle.transport.ended and cycle.transport.writes[-1].endswith(b"data: [DONE]\n\n")
    assert len(admission.finished) == 1 and not tasks[0].done()  # the settlement goes on in the background
    admission.done.set()
    await asyncio.gather(*tasks)


async def test_a_client_that_leaves_during_the_release_still_has_a_finished_stream() -> None:
    cycle, relay, es, admission, tasks, run = await _relayed_on_a_hanging_store()
    relay.piece("a", 1, STOP)
    await asyncio.sleep(0.05)  # the request task waits for the release
    assert admission.finished and not run.done()
    cycle.disconnected = True
    run.cancel()  # (what the router does when the client's connection goes)
    with pytest.raises(asyncio.CancelledError):
        await run
    assert es.result == "ok" and es.final is not None  # settled as finished, not as "cancelled"
    admission.done.set()
    await asyncio.gather(*tasks)


async def test_a_client_that_takes_nothing_for_send_timeout_is_given_up() -> None:
    # (nginx's send_timeout: a client that stopped reading would otherwise
    # hold its request, its lease and its queued pieces as long as TCP lasts)
    cycle = Cycle()
    relay = PushRelay()
    cycle.flow.pause_writing()  # the client's buffers are full and it reads nothing
    relay.piece("a", 1, NONE)
    started_at = time.monotonic()
    with pytest.raises(ClientTooSlow):
        await asyncio.wait_for(relay.run(Events(), TransportWire(cycle, timeout=0.2)), 5)
    assert 0.2 <= time.monotonic() - started_at < 1
    assert cycle.transport.writes == []


async def test_a_slow_client_that_keeps_taking_its_stream_is_not_given_up() -> None:
    cycle = Cycle()
    relay = PushRelay()
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle, timeout=0.2)))
    for text in "abcdef":
        cycle.flow.pause_writing()
        relay.piece(text, 1, NONE)
        await asyncio.sleep(0.1)  # each wait is shorter than the limit; all of them together longer
        cycle.flow.resume_writing()
    relay.piece("g", 1, STOP)
    await asyncio.wait_for(run, 1)
    assert b"".join(cycle.transport.writes) == b"abcdefg[DONE]"


class RawSocket(Socket):
    """A transport that keeps the bytes as written."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = b""

    def write(self, data: bytes) -> None:
        self.raw += data

    def is_closing(self) -> bool:
        return self.closed


def uvicorn_cycle(keep_alive: bool = True, method: str = "POST"):
    """uvicorn's own RequestResponseCycle over a RawSocket."""
    import logging

    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    transport = RawSocket()
    done: list[int] = []
    cycle = RequestResponseCycle(
        scope={"type": "http", "method": method, "path": "/v1/completions", "headers": []},  # type: ignore[typeddict-item]
        transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),
        access_logger=logging.getLogger("t"), access_log=False,
        default_headers=[(b"date", b"Mon, 30 Nov 2026 16:00:00 GMT"), (b"server", b"uvicorn")],
        message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
        on_response=lambda: done.append(1),
    )
    return cycle, transport, done


@pytest.mark.parametrize("keep_alive", [True, False])
async def test_the_wire_writes_the_bytes_uvicorns_send_writes(keep_alive: bool) -> None:
    """Head, events and end as the router writes them (``TransportWire.open``,
    ``write``, ``finish``) are byte for byte what uvicorn's ``send`` writes
    for the same response, and leave its cycle in the same state."""
    headers = {"x-request-id": "abc", "x-ratelimit-limit-requests": "60", "cache-control": "no-cache"}
    cors = [(b"access-control-allow-origin", b"https://app.example"), (b"vary", b"Origin")]

    ours, ours_socket, ours_done = uvicorn_cycle(keep_alive)
    wire = TransportWire.open(ours.send, headers, cors)
    assert wire is not None
    wire.write(b"data: 1\n\n")
    wire.finish(b"data: 2\n\ndata: [DONE]\n\n")

    theirs, theirs_socket, theirs_done = uvicorn_cycle(keep_alive)
    await theirs.send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        *[(k.encode(), v.encode()) for k, v in headers.items()], *cors]})
    await theirs.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await theirs.send({"type": "http.response.body", "body": b"data: 2\n\ndata: [DONE]\n\n", "more_body": True})
    await theirs.send({"type": "http.response.body", "body": b"", "more_body": False})

    assert ours_socket.raw == theirs_socket.raw
    for attr in ("response_started", "response_complete", "chunked_encoding", "keep_alive"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.message_event.is_set() and ours_done == theirs_done == [1]
    assert ours_socket.closed == theirs_socket.closed == (not keep_alive)


async def test_the_wire_leaves_the_head_to_uvicorn_when_it_cannot_write_it_itself() -> None:
    cycle, _, _ = uvicorn_cycle()
    # a header value uvicorn refuses (a control character in an echoed Origin)
    assert TransportWire.open(cycle.send, {}, [(b"access-control-allow-origin", b"x\x01y")]) is None
    cycle.flow.pause_writing()  # a transport that takes no writes now
    assert TransportWire.open(cycle.send, {}, []) is None
    assert TransportWire.open(Cycle().on_response, {}, []) is None  # (not uvicorn's httptools cycle)
    assert not cycle.response_started


async def test_the_head_goes_out_with_the_first_write_or_alone_at_the_end_of_the_turn() -> None:
    writes: list[bytes] = []
    cycle, socket, _ = uvicorn_cycle()
    socket.write = writes.append  # type: ignore[method-assign]
    wire = TransportWire.open(cycle.send, {"x-request-id": "abc"}, [])
    assert wire is not None and writes == []
    wire.write(b"data: 1\n\n")
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    await asyncio.sleep(0)
    assert len(writes) == 1  # (not again)

    # a one-token stream: head, event and the body's end in one write
    writes.clear()
    cycle, socket, _ = uvicorn_cycle()
    socket.write = writes.append  # type: ignore[method-assign]
    wire = TransportWire.open(cycle.send, {}, [])
    assert wire is not None
    wire.finish(b"data: [DONE]\n\n")
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"0\r\n\r\n")

    # nothing written in this turn: the head alone, once the turn ends
    writes.clear()
    cycle, socket, _ = uvicorn_cycle()
    socket.write = writes.append  # type: ignore[method-assign]
    assert TransportWire.open(cycle.send, {}, []) is not None
    assert writes == []
    await asyncio.sleep(0)
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n")

    # ... unless the client left meanwhile
    writes.clear()
    cycle, socket, _ = uvicorn_cycle()
    socket.write = writes.append  # type: ignore[method-assign]
    assert TransportWire.open(cycle.send, {}, []) is not None
    cycle.disconnected = True
    await asyncio.sleep(0)
    assert writes == []


@pytest.mark.parametrize("queue", [PieceQueue, PushRelay])
async def test_a_failure_raised_to_the_consumer_leaves_no_cycle_with_the_queue(queue) -> None:
    # The consumer's frames, in the failure's traceback, hold the queue:
    # were the queue to keep the failure, the three would be a cycle, and
    # keep a refused request's body with them until a cycle collection.
    async def consume(q: PieceQueue) -> None:
        await (q.first() if isinstance(q, PushRelay) else q.get())

    gc.collect()
    gc.disable()
    try:
        q = queue()
        q.fail(StreamLost("refused"))
        with pytest.raises(StreamLost):
            await consume(q)
        del q
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0
