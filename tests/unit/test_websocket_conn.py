"""A WebSocket connection's sends after its client has gone."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from litestar.exceptions import WebSocketDisconnect

from replicas.protocol import FinishReason
from router.errors import RouterShutdown
from router.sse import ChunkEncoder
from router.websocket import CLOSE_WAIT, _Conn
from router.websocket_stream import SocketFrames, run_create


class GoneSocket:
    """A socket whose client disconnected: every send fails, as uvicorn's does."""

    scope: dict = {}

    def __init__(self) -> None:
        self.sends = 0

    async def send_data(self, data: str, mode: str) -> None:
        self.sends += 1
        raise WebSocketDisconnect(detail="client gone", code=1006)


def service(send_timeout: float) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(send_timeout=send_timeout))


async def test_a_send_to_a_gone_client_is_dropped_not_raised() -> None:
    # (raised in a request's task, it left "Task exception was never
    # retrieved" in the log and the relay unclosed until garbage collection)
    sock = GoneSocket()
    conn = _Conn(service(60), sock)  # type: ignore[arg-type]
    await conn.send(b'{"id":"a"}')
    assert conn.gone
    await conn.send(b'{"id":"a"}')  # and nothing more is tried
    assert sock.sends == 1


class FullSocket:
    """A socket whose client reads nothing: a send waits for room forever."""

    scope: dict = {}

    async def send_data(self, data: str, mode: str) -> None:
        await asyncio.Event().wait()


async def test_a_client_that_takes_no_frame_for_send_timeout_is_given_up() -> None:
    # (its requests held their leases as long as the client stayed connected)
    conn = _Conn(service(0.1), FullSocket())  # type: ignore[arg-type]
    await asyncio.wait_for(conn.send(b'{"id":"a"}'), 2)
    assert conn.gone


class Link:
    """The connection behind a socket (router/server.py ``_WebSocket``)."""

    def __init__(self) -> None:
        self.aborted = False
        self.max_size: int | None = None

    def abort(self) -> None:
        self.aborted = True

    def limit_message_size(self, size: int) -> None:
        self.max_size = size


class StuckSocket(FullSocket):
    """A client that reads nothing: a close frame never goes out either."""

    def __init__(self, link: Link) -> None:
        self.scope = {"extensions": {"fairstream.socket": link}}

    async def close(self, code: int, reason: str) -> None:
        await asyncio.Event().wait()


async def test_a_client_that_stops_reading_has_its_connection_dropped() -> None:
    # Its requests ended, but the socket stayed open for good: uvicorn's close
    # waits for buffers the client never drains (one held max_connections
    # slots, unauthenticated ones locked the router out, shutdown waited
    # shutdown_grace for it)
    link = Link()
    conn = _Conn(service(0.1), StuckSocket(link))  # type: ignore[arg-type]
    await asyncio.wait_for(conn.send(b'{"id":"a"}'), 2)
    assert conn.gone and link.aborted
    link2 = Link()
    closing = _Conn(service(60), StuckSocket(link2))  # type: ignore[arg-type]
    await asyncio.wait_for(closing.close(1012, "router shutting down"), 1 + CLOSE_WAIT)  # (at shutdown)
    assert link2.aborted


def test_socket_messages_are_the_sse_events_with_their_ids_and_a_resumable_end_has_no_number() -> None:
    # A socket's stream is an SSE stream underneath (its events are what the
    # resume buffer keeps): each message carries the event's number and its
    # SSE id, the first names the stream, and an error that leaves the stream
    # resumable (shutdown) has no number, so the client resumes from its last.
    # A chat stream's role-only first chunk (an SSE event without an id, in
    # event 1's bytes) is a message of its own without a number.
    enc = ChunkEncoder(True, "chatcmpl-x", "m", 0)
    frames = SocketFrames("c1", "sid-1")
    role, event = frames.lead(enc.delta("hi", FinishReason.NONE, b"-1-2"))
    role_msg = json.loads(role)
    assert set(role_msg) == {"id", "stream", "chunk"} and role_msg["stream"] == "sid-1", role_msg
    assert role_msg["chunk"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first = json.loads(frames.message(event))
    assert set(first) == {"id", "event", "event_id", "chunk"}, "only the first message names the stream"
    assert (first["id"], first["event"], first["event_id"]) == ("c1", 1, "1-1-2"), first
    assert first["chunk"]["choices"][0]["delta"] == {"content": "hi"}
    assert frames.message(b": waiting for the stream\n") is None  # (a resume's keep-alive: not sent)
    later = enc.delta(" there", FinishReason.NONE, b"-2-8")
    assert frames.lead(later) == (b"", later)
    second = json.loads(frames.message(later))
    assert set(second) == {"id", "event", "event_id", "chunk"} and second["event_id"] == "2-2-8", second
    assert not frames.ended
    notice = json.loads(frames.message(enc.notice(RouterShutdown().body())))
    assert set(notice) == {"id", "error"} and notice["error"]["code"] == "router_shutdown", notice
    assert frames.ended
    assert json.loads(frames.message(enc.done())) == {"id": "c1", "done": True}  # (its SSE id, 3: not sent)
    # a stream that is not resumable: plain numbers, no stream named; its error is numbered
    plain = SocketFrames("c2", None)
    assert set(json.loads(plain.message(enc.delta("x")))) == {"id", "event", "chunk"}
    err = json.loads(plain.message(enc.error(RouterShutdown().body())))
    assert err["event"] == 5 and err["error"]["code"] == "router_shutdown" and plain.ended, err


class SlowSocket:
    """A client that takes frames, each after a moment (a send yields to the loop)."""

    scope: dict = {}

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.frames: list[str] = []

    async def send_data(self, data: str, mode: str) -> None:
        await self.release.wait()
        self.frames.append(data)


async def test_an_abort_after_a_refusal_was_sent_gets_no_answer(monkeypatch) -> None:
    """A request refused before its first chunk ends with its error: an
    abort that comes while that error is being sent finds nothing running
    (it was answered ``aborted`` too, after the error, 3 times in 30)."""
    import router.websocket_stream as ws
    from router.errors import BadRequest

    async def refuse(*a, **kw):
        raise BadRequest("'max_tokens' is too large.", param="max_tokens")

    monkeypatch.setattr(ws, "start_generation", refuse)
    sock = SlowSocket()
    conn = _Conn(service(60), sock)  # type: ignore[arg-type]
    conn.start("r1", run_create(conn, "r1", b"{}", None))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0)  # (the task runs up to the error's send, which waits)
    assert "r1" not in conn.running  # (an abort now: nothing to answer)
    sock.release.set()
    await asyncio.gather(*conn.tasks)
    assert len(sock.frames) == 1 and json.loads(sock.frames[0])["error"]["param"] == "max_tokens"
