"""A ``/v1/ws`` request's stream: an SSE stream underneath, resumable as one.

A socket's chat completion is started, buffered and settled exactly as a
streamed HTTP request (``start_generation``, ``open_stream``,
``relay_stream``): its events are SSE events, each handed to the resume
buffer before it goes out, and each goes out as one WebSocket message made
from the event's bytes (``SocketFrames``). So the buffer, its retention, the
claims, failover and regeneration, the accounting and the sharing between
routers over Redis are the SSE streams' own, and a socket's stream resumes
as an SSE stream does: ``GET /v1/streams/{id}`` with ``Last-Event-ID``, or
a ``{"type": "resume", "id": ID, "stream": SID, "last_event_id": EID}``
message on any socket of the stream's tenant, which runs the HTTP resume
(router/resume_http.py: the same checks, charge and log line) and sends its
events as that request's messages.

An SSE event ``id: N-T-C`` / ``data: PAYLOAD`` becomes ``{"id": ID, "event":
N, "event_id": "N-T-C", "chunk": PAYLOAD}`` (``"error"`` in place of
``"chunk"`` for an error event); the request's first message also names
the stream (``"stream": SID``, what an SSE response's ``x-request-id``
says). A chat stream's role-only first chunk (vLLM's) has no SSE id, so its
message has no ``event``: ``{"id": ID, "stream": SID, "chunk": PAYLOAD}``.
An error with no SSE id (one that leaves the stream resumable from the
client's last event: a shutdown, a refused continuation) has no
``event``; ``data: [DONE]`` is ``{"id": ID, "done": true}``; SSE comments
(a resume's keep-alives) are not sent. A resume whose events end with
neither (its stream's relay failed, and its buffer was finished there) ends
with a ``stream_lost`` error: its SSE response ends without ``[DONE]``.

The resume path is HTTP's, and its errors name the ``Last-Event-ID``
header; the socket's client sent a resume message's ``last_event_id``, so
its error messages name that (``socket_words``: errors only, not chunks).

A socket that closes ends its streams as an HTTP client's disconnect does:
each generation is aborted on its replica at once and its buffer stays
resumable (router/relay.py); ``{"type": "abort"}`` does the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

import msgspec

from router.completions import new_request_id, open_stream, start_generation
from router.errors import ApiError, ServiceUnavailable
from router.relay import relay_stream
from router.replay_slices import SOCKET_MESSAGES, events_of
from router.resume_http import serve_resume
from router.sse import DONE, lead
from router.state import StoreUnavailable
from router.tenants import TenantPolicy

if TYPE_CHECKING:
    from router.websocket import _Conn

__all__ = ["SocketFrames", "error_message", "run_create", "run_resume", "socket_words"]

log = logging.getLogger("fairstream.websocket")

_enc = msgspec.json.encode
_HEADER, _FIELD = "Last-Event-ID", "last_event_id"


def socket_words(text: str) -> str:
    """An error's text (its message, its ``param``) as a socket's client is
    told it: the resume message's field where HTTP's names its header."""
    return text.replace(_HEADER, _FIELD)


def error_message(cid: str, e: ApiError, request_id: str = "", refused: bool = False) -> bytes:
    """``{"id": cid, "error": ...}`` (with the router's ``request_id`` once
    it has one: the request's log line carries it; and ``retry_after``, the
    seconds an HTTP answer's ``Retry-After`` would say, where it has one).
    ``refused``: the answer to a message the socket did not take, marked
    ``"refused": true`` so that a client can tell it from the last message
    of a stream running under the same id, which goes on."""
    rid = b',"refused":true' if refused else b""
    rid += b',"request_id":"' + request_id.encode() + b'"' if request_id else b""
    retry = e.headers.get("retry-after", "")
    if retry.isdigit():
        rid += b',"retry_after":' + retry.encode()
    return b'{"id":' + _enc(cid) + rid + b',"error":' + e.body()[len(b'{"error":'):-1] + b"}"


class SocketFrames:
    """Makes one request's WebSocket messages of its stream's SSE events."""

    __slots__ = ("_head", "_prefix", "done", "ended", "stream")

    def __init__(self, cid: str, stream: str | None) -> None:
        """``stream``: the stream's id, named in the first message (None: not
        resumable, e.g. an upstream's output without token ids)."""
        self.stream = stream
        self._prefix = b'{"id":' + _enc(cid)
        self._head = self._prefix + (b',"stream":' + _enc(stream) if stream else b"")
        self.done = self._prefix + b',"done":true}'
        self.ended = False  # the request's last message (done, or an error) is made

    def lead(self, event: bytes) -> tuple[bytes, bytes]:
        """``event`` as (the message of the role chunk it leads with, or
        b""; the rest, for ``message``). A chat stream's event 1 carries
        vLLM's role-only first chunk ahead of it in the same bytes, an SSE
        event without an id (router/sse.py): a ``chunk`` message without
        ``event``, the request's first (it names the stream)."""
        cut = lead(event)
        if not cut:
            return b"", event
        head, self._head = self._head, self._prefix
        return head + b',"chunk":' + event[6:cut - 2] + b"}", event[cut:]

    def message(self, frame: bytes) -> bytes | None:
        """The message of one SSE event (None: an SSE comment)."""
        head, self._head = self._head, self._prefix
        if frame[:4] == b"id: ":
            cut = frame.index(b"\n", 4)
            eid = frame[4:cut]
            payload = frame[cut + 7:-2]  # (after "\ndata: ", before the blank line)
            dash = eid.find(b"-")
            if dash < 0:  # (a stream that is not resumable: its ids are the numbers alone)
                head += b',"event":' + eid
            else:
                head += b',"event":' + eid[:dash] + b',"event_id":"' + eid + b'"'
        elif frame[:6] == b"data: ":
            payload = frame[6:-2]
        else:
            self._head = head  # (not sent: the next message is the first)
            return None
        if payload == b"[DONE]":  # (with an id or not: that id, its number alone, is for SSE clients: router/sse.py)
            self.ended = True
            return self.done
        if payload[:9] == b'{"error":':
            self.ended = True
            payload = payload.replace(_HEADER.encode(), _FIELD.encode())  # (socket_words: the field it sent)
            return head + b"," + payload[1:]  # (its member spliced in, not nested)
        return head + b',"chunk":' + payload + b"}"


async def run_create(conn: _Conn, cid: str, body: bytes, policy: TenantPolicy) -> None:
    """A ``chat.completions.create`` message's request, to its last message."""
    svc = conn.svc
    request_id = new_request_id()
    try:
        st = await start_generation(svc, policy, body, True, request_id, "websocket", stream_implied=True)
        es, _ = await open_stream(svc, policy, st, True, request_id)  # (its resume buffer, as HTTP's)
    except ApiError as e:
        await conn.send_last(cid, error_message(cid, e, request_id))  # (an abort meanwhile gets no answer)
        return
    except Exception as e:  # noqa: BLE001 - answer this request, keep the connection's others
        log.exception("websocket request %s failed", request_id, exc_info=e)
        await conn.send_last(cid, error_message(cid, ApiError("Internal server error."), request_id))
        return
    await _relay(conn, cid, request_id, False, SocketFrames(cid, es.sid), relay_stream(es, st.pieces, st.first))


async def run_resume(conn: _Conn, cid: str, sid: str, last_event_id: str, policy: TenantPolicy) -> None:
    """A ``resume`` message's request: the HTTP resume of ``sid`` from
    ``last_event_id`` (its refusals too: an error message, the HTTP
    answer's body, under the refusal's own request id; worded for the
    message's ``last_event_id``). Its request id is the stream's, as the
    resume's log line has it."""
    try:
        resp = await serve_resume(conn.svc, policy, sid, last_event_id or None)
    except ApiError as e:
        e.message = socket_words(e.message)
        e.param = e.param and socket_words(e.param)
        await conn.send_last(cid, error_message(cid, e, e.headers.get("x-request-id", "")))
        return
    except Exception as e:  # noqa: BLE001 - as run_create
        log.exception("websocket resume of %s failed", sid, exc_info=e)
        await conn.send_last(cid, error_message(cid, ApiError("Internal server error."), sid))
        return
    # (a 204: the id was that of the stream's [DONE], router/sse.py: its client has it all; done again)
    await _relay(conn, cid, sid, True, SocketFrames(cid, sid), resp.iterator if resp.status_code != 204 else _done())


async def _done() -> AsyncIterator[bytes]:
    yield DONE


async def _relay(conn: _Conn, cid: str, request_id: str, resuming: bool, frames: SocketFrames,
                 events: AsyncIterator[bytes]) -> None:
    """Send ``events`` as ``cid``'s messages. ``request_id``: the request's
    (its log line's; a stream's id is its first request's); ``resuming``: a
    resume message's, else a create's."""
    try:
        async with aclosing(events) as out:
            async for chunk in out:
                # (a replay's slice holds many events: a message each, with a turn of the loop every
                # SOCKET_MESSAGES of them: router/replay_slices.py; a create's chunk is one event)
                for n, event in enumerate(events_of(chunk) if resuming else (chunk,), 1):
                    role, event = frames.lead(event)
                    if role:
                        await conn.send(role)
                        if conn.gone:
                            return
                    msg = frames.message(event)
                    if msg is None:
                        continue
                    if frames.ended:  # (done, or its error: an abort from now on gets no answer)
                        await conn.send_last(cid, msg)
                    else:
                        await conn.send(msg)
                    if conn.gone:
                        return  # (closing the relay settles the request as cancelled)
                    if frames.ended:
                        conn.ended(cid, asyncio.current_task())  # (out: a draining socket may close now)
                    elif n % SOCKET_MESSAGES == 0:
                        await asyncio.sleep(0)
    except Exception as e:  # noqa: BLE001 - a stream whose store failed (or a bug): say so, keep the socket
        if isinstance(e, StoreUnavailable):
            # (from the last event it has: a resume's client has events past the id it gave)
            then = ("resume again from the last event_id you have" if resuming else
                    f"resume stream {frames.stream} from the last event_id you have" if frames.stream else
                    "retry the request")
            told: ApiError = ServiceUnavailable(f"The stream cannot be read now (the state store is unavailable); "
                                                f"{then}, shortly.", code="resume_unavailable")
        else:
            log.exception("websocket request %s failed mid-stream (message id %r)", request_id, cid, exc_info=e)
            told = ApiError("Internal server error.")
        if not frames.ended and not conn.gone:
            await conn.send_last(cid, error_message(cid, told, request_id))
        return
    if not frames.ended and not conn.gone:
        # A resume whose events had neither [DONE] nor an error: its stream's
        # relay failed (a bug; the client of that request got a cut stream)
        # and its buffer was finished there. Its SSE response ends without
        # [DONE], which an SSE client takes as a stream cut short: not done.
        lost = ApiError(f"Stream {request_id} ended without its end: its generation failed on the router that "
                        "ran it, and it cannot be resumed; retry the request.", code="stream_lost")
        await conn.send_last(cid, error_message(cid, lost, request_id))
