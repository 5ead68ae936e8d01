"""``/v1/ws``: streams over one WebSocket, several at a time: chat
completions started on it, and resumes of any stream of its tenant (a
``/v1/completions`` one too).

Auth: an ``Authorization: Bearer KEY`` header on the upgrade, or (browsers
cannot set headers) a first message ``{"type": "auth", "api_key": KEY}``,
within ``header_timeout`` seconds of the upgrade (else the socket is closed,
code 1008), answered ``{"type": "auth", "ok": true}``. The key is checked
again against the tenant policy in force at every request: a key revoked by
a reload refuses the socket's next request (its error, ``invalid_api_key``)
and every one after it; the requests already running go on, as HTTP streams
do, and the socket closes (code 4401) once they have ended. A reload's new
limits apply to the socket's next requests. An authenticated socket with no
request running that sends nothing for ``ws_idle_timeout`` seconds is closed
(code 1000, ``idle``); a tenant's ``max_sockets`` caps its open sockets
(one more is closed at authentication, code 4429). Then, any number of times:

* ``{"type": "chat.completions.create", "id": ID, "body": {...}}`` starts a
  chat completion (the body is the HTTP request body; ``stream`` is implied).
  The server answers with ``{"id": ID, "event": N, "event_id": "N-T-C",
  "chunk": {...}}`` messages (the same ``chat.completion.chunk`` objects and
  event ids as SSE; the first also has ``"stream": SID``, and is the
  role-only chunk, without ``event``: SSE's has no id either), then
  ``{"id": ID, "done": true}``; or ``{"id": ID, "error": {...}}`` in OpenAI's
  error shape (a rejected request); a stream that fails midway (lost, timed
  out) ends with ``{"id": ID, "event": N, "error": {...}}``.
* ``{"type": "resume", "id": ID, "stream": SID, "last_event_id": EID}``
  resumes stream SID (a dropped socket's, or an SSE stream's) after event
  EID, as ``GET /v1/streams/{SID}`` does: the missed events, then the rest,
  as request ID's messages (router/websocket_stream.py), in the messages
  above: their chunks are the stream's own, ``text_completion`` objects for
  a ``/v1/completions`` stream. Its errors are HTTP's, naming
  ``last_event_id`` where HTTP's name the ``Last-Event-ID`` header.
* ``{"type": "abort", "id": ID}`` stops that generation at once (aborted on
  its replica); the server confirms with ``{"id": ID, "aborted": true}``.

A message the socket refuses (an unknown type, an id in use, an envelope
it cannot read, ...) starts nothing and is answered ``{"id": ID,
"refused": true, "error": {...}}``: never the last message of a request
running under the same id, which goes on.

Same auth, limits, queues, failover and resume buffer as HTTP. Closing the
socket (or an abort) ends what runs on it as an HTTP client's disconnect
does: each generation is aborted on its replica, and its stream stays
resumable. Each request is a task owned by the connection handler.

When the router shuts down (SIGTERM), a socket takes no new requests (each
gets ``router_shutdown``), its running ones get ``shutdown_grace`` like HTTP
streams (then end with a ``router_shutdown`` error message), and the router
closes it with code 1012 (service restart) once none is left: at once if it
was idle. router/server.py keeps uvicorn from closing it earlier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import msgspec
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from router.auth import authorization
from router.completions import new_request_id
from router.errors import ApiError, BadRequest, PayloadTooLarge, RateLimited, RouterShutdown, clip, error_body
from router.json_parity import TRUNCATED, lone_at, lone_surrogate
from router.push import ClientTooSlow, bounded
from router.relay import log_refused
from router.server import SOCKET_EXTENSION, ws_max_message
from router.service import RouterService
from router.websocket_stream import error_message as _err
from router.websocket_stream import run_create, run_resume

__all__ = ["chat_socket"]

log = logging.getLogger("fairstream.websocket")

MAX_PARALLEL = 64  # generations one socket may run at once
AUTH_MESSAGE_SIZE = 16 * 1024  # the largest message before authentication (an auth message is small)
CLOSE_WAIT = 1.0  # seconds a close frame may wait for a client that reads nothing; then the connection is dropped
MAX_ID = 128  # characters of a request's id (it is repeated in every message)


class _Msg(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    id: str = ""
    body: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))
    api_key: str = ""
    stream: str = ""  # a resume's: the stream to resume
    last_event_id: str = ""  # a resume's: the last event_id the client has


_decode = msgspec.json.Decoder(_Msg).decode


class _IdOnly(msgspec.Struct):
    id: Any = ""


_decode_id = msgspec.json.Decoder(_IdOnly).decode
_ID_RETRIES = 4  # (decodes of a refused message for its id: unpaired surrogate escapes set aside)


def _refused(cid: str, e: ApiError) -> bytes:
    """The answer to a message the socket refused (it started nothing, and
    ends nothing running under ``cid``): ``{"id": cid, "refused": true,
    "error": ...}``."""
    return _err(cid, e, refused=True)


def _id_of(raw: str) -> str:
    """The ``id`` of a message ``_read`` refused (a field too many, a wrong
    type elsewhere), to answer it under: "" when it has none that could be one.
    An unpaired surrogate escape (a browser's ``JSON.stringify`` of text cut
    inside an emoji) is set aside (U+FFFD in its place) to read the id past
    it, a few times at most."""
    data = raw.encode()
    for tries in range(_ID_RETRIES):
        try:
            cid = _decode_id(data).id
            if tries and isinstance(cid, str) and "\ufffd" in cid:
                return ""  # (the id held one: not the client's id as sent)
            break
        except (msgspec.DecodeError, RecursionError) as e:
            at = lone_at(data, str(e), skipped=True) if isinstance(e, msgspec.DecodeError) else None
            if at is None:
                return ""
            data = data[:at] + b"\\ufffd" + data[at + 6:]
    else:
        return ""
    return cid if isinstance(cid, str) and len(cid) <= MAX_ID else ""


class _Conn:
    def __init__(self, svc: RouterService, sock: WebSocket) -> None:
        self.svc = svc
        self.sock = sock
        # its connection (router/server.py _WebSocket; None on another server)
        self.link = sock.scope.get("extensions", {}).get(SOCKET_EXTENSION)
        self.auth: str | None = None  # the socket's key, as an Authorization header value
        self.tenant = ""  # its tenant, once authenticated
        self.active = asyncio.get_running_loop().time()  # its last message, or its last request's end
        self.running: dict[str, asyncio.Task[None]] = {}  # by the client's id, until its last message is out
        self.tasks: set[asyncio.Task[None]] = set()  # every generation's task, until it ends
        self._send_lock = asyncio.Lock()
        self.draining = False
        self.revoked: ApiError | None = None
        self._close_code = (1012, "router shutting down")
        self.gone = False
        self.closing: asyncio.Task[None] | None = None
        self.finals = 0  # last messages unlisted and not sent yet: a draining socket closes after them

    def drain(self) -> None:
        """The router is shutting down: take no new requests, and close the
        socket (1012) once the running ones have ended."""
        self.draining = True
        if not self.running and not self.finals:
            self._close_soon()

    def revoke(self, e: ApiError) -> None:
        """A reload revoked the socket's key (``e``: the refusal): new
        requests get ``e``; the running ones go on, as HTTP streams do, and
        the socket closes (4401) once they have ended."""
        # (without its traceback: the handler's frames in it hold this
        # connection, and the message it refused; a cycle kept until a
        # cycle collection)
        self.revoked = e.with_traceback(None)
        self.draining = True
        self._close_code = (4000 + e.status if e.status in (401, 403) else 4400, e.message[:120])
        if not self.running and not self.finals:
            self._close_soon()

    def recheck(self) -> None:
        """A reload changed the tenant policy: a socket whose key it revoked
        (or whose tenant it removed) takes no new request and closes (4401)
        once its running ones have ended, whether or not its client sends
        another request; it stops counting against ``max_sockets`` then."""
        if self.auth is None or self.revoked is not None:
            return
        try:
            policy = self.svc.tenant(self.auth)
        except ApiError as e:
            self.revoke(e)
            return
        self.tenant = policy.name  # (a key moved to another tenant: the socket is that tenant's now)

    def start(self, cid: str, request: Coroutine[Any, Any, None]) -> None:
        """Run ``cid``'s request (router/websocket_stream.py) in a task of its own."""
        task = asyncio.get_running_loop().create_task(request)
        self.running[cid] = task
        self.tasks.add(task)
        task.add_done_callback(lambda t: self.ended(cid, t))

    def _unlist(self, cid: str, task: asyncio.Task[None] | None) -> None:
        """``cid``'s last message is being sent: an abort of it gets no
        answer from now on, its id may run again."""
        if self.running.get(cid) is task:  # (an aborted one's id may run again already)
            del self.running[cid]
            self.active = asyncio.get_running_loop().time()

    async def send_last(self, cid: str, frame: bytes) -> None:
        """Send ``cid``'s last message, unlisted first (an abort meanwhile
        gets no answer); a draining socket closes only after it is out."""
        self._unlist(cid, asyncio.current_task())
        self.finals += 1
        try:
            await self.send(frame)
        finally:
            self.finals -= 1

    def ended(self, cid: str, task: asyncio.Task[None]) -> None:
        """``cid``'s last message is out (or its task ended)."""
        if task.done():
            self.tasks.discard(task)
        self._unlist(cid, task)
        if self.draining and not self.running and not self.finals:
            self._close_soon()

    def authenticated(self, auth: str) -> None:
        """``auth`` is a key of a tenant with room for one more socket (else
        ``ApiError``): the socket is that tenant's, and takes messages up to
        a request body's limit."""
        policy = self.svc.tenant(auth)
        cap = policy.limits.max_sockets
        if cap and sum(c.tenant == policy.name for c in self.svc.sockets) >= cap:
            raise RateLimited(f"Tenant {policy.name!r} has {cap} WebSockets open on this router, its limit; close "
                              "one first.", retry_after=1.0, code="too_many_sockets")
        self.auth = auth
        self.tenant = policy.name
        if self.link is not None:
            self.link.limit_message_size(ws_max_message(self.svc.config.max_body_bytes))

    async def close(self, code: int, reason: str) -> None:
        """Close with ``code``; a client that takes no frame for
        ``CLOSE_WAIT`` seconds has its connection dropped (a close waits for
        the buffers to drain, which a client that stopped reading never
        lets happen)."""
        try:
            await bounded(self.sock.close(code=code, reason=reason), CLOSE_WAIT)
        except ClientTooSlow:
            self.abort()
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client went first
            pass

    def abort(self) -> None:
        self.gone = True
        if self.link is not None:
            self.link.abort()

    def _close_soon(self) -> None:
        if self.closing is None:
            self.closing = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        async with self._send_lock:
            await self.close(*self._close_code)

    async def send(self, data: bytes) -> None:
        """Send a frame; nothing if the socket is closed or the client gone
        (``gone`` then says so; ``chat_socket``'s receive loop ends the rest)."""
        async with self._send_lock:
            if self.closing is not None or self.gone:  # (closed by the router at shutdown)
                return
            try:
                await bounded(self.sock.send_data(data.decode("utf-8"), mode="text"), self.svc.config.send_timeout)
            except (WebSocketDisconnect, RuntimeError, OSError):  # the client went mid-send
                self.gone = True
            except ClientTooSlow as e:
                # its requests end (their leases free), and its connection is
                # dropped: a close would wait for buffers it does not read
                log.warning("websocket: %s; ending its requests and dropping the connection", e)
                self.abort()


def _read(raw: str) -> _Msg | ApiError:
    """The message in ``raw``, or the error that answers it."""
    if not raw:  # (a binary frame reads as empty text)
        return BadRequest("Bad message: send each message as a JSON object in a text frame "
                          "(this one was empty or binary).", code="invalid_json")
    try:
        msg = _decode(raw)
    except msgspec.DecodeError as e:
        lone = lone_surrogate(raw.encode(), str(e), skipped=True) if "surrogate" in str(e) or "escape" in str(e) \
            or str(e) == TRUNCATED else None  # (as a request body's: router.json_parity; no copy for other errors)
        if lone is not None:
            text, param = lone
            return BadRequest("Bad message: " + text.removeprefix("The request body is not valid JSON: "),
                              param=param, code="invalid_json")
        return BadRequest(f"Bad message: {e}", code="invalid_json")
    except RecursionError:
        return BadRequest("Bad message: nested too deeply.", code="invalid_json")
    for name in ("id", "stream", "last_event_id"):
        if len(getattr(msg, name)) > MAX_ID:
            return BadRequest(f"An '{name}' is at most {MAX_ID} characters.", param=name)
    return msg


def _refusal(conn: _Conn, msg: _Msg) -> ApiError | None:
    """Why a request message (a create or a resume) is refused before it
    starts; None: it is not."""
    if conn.revoked is not None:
        return conn.revoked
    if conn.draining:
        return RouterShutdown("The router is shutting down; send new requests on a new connection.")
    if not msg.id:
        return BadRequest("Each request needs an 'id' not in use on this socket.", param="id", code="missing_id")
    if msg.id in conn.running:
        return BadRequest(f"The id {clip(repr(msg.id))} is in use on this socket (its request is running); each "
                          "request needs an 'id' not in use.", param="id", code="id_in_use")
    if len(conn.running) >= MAX_PARALLEL:
        return BadRequest(f"At most {MAX_PARALLEL} requests at once per socket.", code="too_many_parallel_requests")
    if msg.type == "resume":
        if bytes(msg.body):
            return BadRequest("A resume takes no 'body': it continues the stream as it was asked for.", param="body")
        if not msg.stream:
            return BadRequest("A resume needs the 'stream' to resume (the 'stream' of the request's first message, "
                              "or an HTTP stream's x-request-id).", param="stream")
        return None
    if msg.stream or msg.last_event_id:
        name = "stream" if msg.stream else "last_event_id"
        return BadRequest(f"'{name}' belongs to a resume message; a chat.completions.create takes its request in "
                          "'body'.", param=name)
    if not bytes(msg.body):
        return BadRequest("Missing 'body'.", param="body")
    limit = conn.svc.config.max_body_bytes
    if len(msg.body) > limit:  # (as an HTTP body over it: a 413)
        return PayloadTooLarge(f"The request body is too large (over {limit} bytes).", param="body")
    return None


async def _authenticate(conn: _Conn, raw: str) -> None:
    """A message before authentication: the auth message, or an error."""
    msg = _read(raw)
    if isinstance(msg, ApiError):
        await conn.send(_refused(_id_of(raw), msg))
    elif msg.type != "auth":
        await conn.send(_refused(msg.id, BadRequest('Authenticate first: send {"type": "auth", "api_key": KEY}.',
                                                    code="missing_api_key")))
    else:
        conn.authenticated(f"Bearer {msg.api_key}")  # (a bad key: refused now)
        await conn.send(b'{"type":"auth","ok":true}')


@websocket("/v1/ws")
async def chat_socket(socket: WebSocket) -> None:
    svc: RouterService = socket.app.state.service
    conn = _Conn(svc, socket)
    if conn.link is not None:  # (until it authenticates, a client sends small messages or none)
        conn.link.limit_message_size(AUTH_MESSAGE_SIZE)
    await socket.accept()
    svc.sockets.add(conn)
    if svc.draining:
        conn.drain()
    auth = authorization(socket.headers)
    # one deadline for authenticating, from the upgrade, over the reads and
    # the answers alike (not per message: a client sending junk now and then,
    # or not reading the answers, would keep it open for good)
    auth_by = asyncio.get_running_loop().time() + svc.config.header_timeout if svc.config.header_timeout else None
    try:
        if auth:
            conn.authenticated(auth)  # (a bad key: refused now)
        idle = svc.config.ws_idle_timeout
        loop = asyncio.get_running_loop()
        while not conn.gone:  # (gone: it took no frame for send_timeout; nothing more is started for it)
            try:
                # (idle: checked again when the time is up, a request may have run meanwhile)
                until = auth_by if conn.auth is None else conn.active + idle if idle else None
                async with asyncio.timeout_at(until):
                    raw = await socket.receive_data(mode="text")
                    conn.active = loop.time()
                    if conn.auth is None:
                        await _authenticate(conn, raw)
                        continue
            except TimeoutError:
                if conn.auth is None:  # (no auth message: as an HTTP connection that sends no request head)
                    svc.metrics.connections_refused.labels("header_timeout").inc()
                    await conn.close(1008, f"no auth message within {svc.config.header_timeout:g}s")
                    return
                if conn.running:  # (idle from now at the soonest: its next check comes in ``idle``)
                    conn.active = loop.time()
                    continue
                if loop.time() < conn.active + idle:
                    continue
                await conn.close(1000, "idle")
                return
            msg = _read(raw)
            if isinstance(msg, ApiError):
                await conn.send(_refused(_id_of(raw) if raw else "", msg))
                continue
            if msg.type in ("chat.completions.create", "resume"):
                refused = _refusal(conn, msg)
                if refused is not None:
                    await conn.send(_refused(msg.id, refused))
                    continue
                # the policy in force now: a reload may have revoked the key
                # or changed the tenant's limits
                try:
                    policy = svc.tenant(conn.auth)
                except ApiError as e:
                    log_refused(svc, "websocket", new_request_id(), e)
                    await conn.send(_refused(msg.id, e))
                    conn.revoke(e)
                    continue
                if msg.type == "resume":
                    conn.start(msg.id, run_resume(conn, msg.id, msg.stream, msg.last_event_id, policy))
                else:
                    conn.start(msg.id, run_create(conn, msg.id, bytes(msg.body), policy))
            elif msg.type == "abort":
                task = conn.running.pop(msg.id, None)
                if task is not None:
                    task.cancel()
                    await conn.send(b'{"id":' + msgspec.json.encode(msg.id) + b',"aborted":true}')
            elif msg.type == "auth":
                await conn.send(_refused(msg.id, BadRequest("This socket is authenticated already; its key is the "
                                                            "one it authenticated with.", param="type",
                                                            code="already_authenticated")))
            else:
                await conn.send(_refused(msg.id, BadRequest(f"Unknown message type {clip(repr(msg.type))}.",
                                                            param="type", code="unknown_message_type")))
    except ApiError as e:  # bad key: say why, then close
        log_refused(svc, "websocket", new_request_id(), e)
        await conn.send(error_body(e.message, e.type, e.param, e.code))
        await conn.close(4000 + e.status if e.status in (401, 403, 429) else 4400, e.message[:120])
    except WebSocketDisconnect:
        pass
    finally:
        try:
            svc.sockets.discard(conn)
            tasks = [*conn.tasks, *([conn.closing] if conn.closing else [])]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)
        finally:
            # Litestar's receive and send are closures over its WebSocket,
            # which holds them: a reference cycle that kept the socket's
            # objects (uvicorn's and websockets' with them) until a
            # collection. (A task past the wait hears a disconnect.)
            socket.receive = socket.send = _gone  # type: ignore[method-assign]


async def _gone(*_: Any) -> Any:
    raise WebSocketDisconnect(detail="The socket has closed.")
