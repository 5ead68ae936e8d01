"""Raw ASGI hot path for the two completion endpoints.

Streaming completions skip Litestar's routing, its ``Stream`` response (an
anyio task group plus a disconnect-listener task per stream and per-event
``send`` wrappers) and its header objects: the body is read from
``receive``, the request goes through the same steps as the Litestar route
(``start_generation``, ``open_stream``), and a streamed request's events are
pushed to the client as the replica produces them (``router.push``).
From the moment the body is read, the client's disconnect cancels the
request task, so a client that leaves while queued, while waiting for its
first token or mid-stream is dropped at once (the generation's ``finally``
aborts it on its replica). On the router's own server the connection's
``connection_lost`` calls back (``router.connection``'s ``lost_callbacks``);
on any other ASGI server one ``receive()`` waiter task per request
watches.
Resume requests (and requests with a ``Last-Event-ID``), other routes,
WebSocket upgrades (but those it refuses: ``FastPath._upgrade``) and the
lifespan go to Litestar; ``HEAD`` on the health, readiness, metrics,
model-list and admin read routes is served as their ``GET`` without the
body, and an ``OPTIONS`` answer gets an ``x-request-id``. With CORS on
(``router.cors``), a request with an ``Origin`` gets the headers Litestar's
CORS middleware would give it, from the same config, and a preflight that
middleware would refuse is refused here, in OpenAI's error shape.

Measured with ``python -m ops.bench`` (docs/perf.md): about 15% less router
CPU per token and 23% less per request than the Litestar route.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from litestar import Litestar
from litestar.routes import WebSocketRoute
from litestar.utils import normalize_path

from router.auth import SEVERAL, header_text
from router.completions import new_request_id, open_stream, respond_whole, start_generation
from router.cors import preflight_refusal, response_headers
from router.errors import ApiError, PayloadTooLarge, RouterShutdown, error_body, unknown_path
from router.handshake import deny
from router.push import ClientTooSlow, TransportWire, bounded, wire_for
from router.relay import Outcome, log_refused, outcome_of
from router.service import RouterService

__all__ = ["FastPath"]

log = logging.getLogger("fairstream.router")

# (with a trailing slash too, which Litestar's router would match: every
# fresh completion takes this one path)
_PATHS = {"/v1/chat/completions": True, "/v1/completions": False,
          "/v1/chat/completions/": True, "/v1/completions/": False}
# GET routes that also answer HEAD (load balancers' health checks), and
# /v1/models/{model}: headers only; every GET route but a resume's
# (/v1/streams/{id}: its GET admits and runs a generation, which a HEAD
# would pay for and never see: a 405 that says so, router.app) and /v1/ws
_HEAD_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/models", "/admin/tenants", "/admin/replicas"})
_JSON = (b"content-type", b"application/json")
_SLASHES = re.compile("//+")


class FastPath:
    """ASGI app: completions handled here, everything else by ``app``."""

    def __init__(self, app: Litestar) -> None:
        self.app = app
        self.svc: RouterService = app.state.service
        self.cors = app.cors_config
        # the paths of Litestar's WebSocket routes (an upgrade to any other is
        # refused here); matched as Litestar's router matches them, after
        # normalize_path, so none may have path parameters
        self.ws_paths = frozenset(r.path for r in app.routes if isinstance(r, WebSocketRoute))
        if any("{" in p for p in self.ws_paths):
            raise ValueError(f"FastPath matches WebSocket routes by their whole path: {sorted(self.ws_paths)}")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = _PATHS.get(scope["path"])
            if chat is None and "//" in scope["path"]:  # (Litestar's router squeezes them too)
                chat = _PATHS.get(_SLASHES.sub("/", scope["path"]))
            if chat is not None:
                auth = origin = encoding = length = None
                client_rid = ""
                for k, v in scope["headers"]:
                    if k == b"authorization":
                        auth = header_text(v) if auth is None else SEVERAL
                    elif k == b"origin":
                        origin = v.decode("latin-1")
                    elif k == b"content-encoding":  # (several headers: one list)
                        encoding = v.decode("latin-1") if encoding is None else f"{encoding}, {v.decode('latin-1')}"
                    elif k == b"x-request-id":
                        client_rid = v.decode("latin-1")
                    elif k == b"content-length":
                        length = int(v) if v.isdigit() else None  # (else the body's own length counts)
                    elif (k == b"x-resume-request-id" or k == b"last-event-id") and v:
                        return await self.app(scope, receive, self._bounded(send, scope))
                cors = response_headers(self.cors, origin) if origin is not None and self.cors is not None else []
                return await self._completion(receive, send, chat, auth, scope["path"], cors, encoding, client_rid,
                                              length)
        elif scope["type"] == "http" and scope["method"] == "HEAD" and (
                scope["path"] in _HEAD_PATHS or scope["path"].startswith("/v1/models/")):
            return await self.app({**scope, "method": "GET"}, receive, _headers_only(send))
        elif scope["type"] == "http" and scope["method"] == "OPTIONS" and self.cors is not None:
            refusal = preflight_refusal(self.cors, scope["headers"])
            if refusal is not None:  # (Litestar answers the allowed ones)
                return await _error(send, [], refusal.status, refusal.body(),
                                    {"x-request-id": new_request_id(), **_close_unless_read(send)})
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            send = _with_request_id(send)  # (Litestar's 204 has none: every answer of the API has one)
        elif scope["type"] == "websocket":
            return await self._upgrade(scope, receive, send)
        if scope["type"] == "http":
            send = self._bounded(send, scope)
        return await self.app(scope, receive, send)

    async def _upgrade(self, scope, receive, send) -> None:
        """A WebSocket upgrade: to Litestar's WebSocket route, except one to a
        path with no WebSocket route (a 404, with the body an HTTP request to
        that path gets, where Litestar would close it unaccepted: uvicorn's
        empty 403) and one that comes while the router shuts down (a 503,
        ``router_shutdown``, where the route would accept it and close it at
        once with 1012). Both are counted as refused connections. On a server
        without ASGI's denial response, Litestar answers them as before."""
        if normalize_path(scope["path"]) not in self.ws_paths:
            error, reason = unknown_path(scope["path"]), "websocket_not_found"
        elif self.svc.draining:
            error, reason = RouterShutdown(), "shutdown"
        else:
            return await self.app(scope, receive, send)
        if not await deny(scope, receive, send, error):
            return await self.app(scope, receive, send)
        self.svc.metrics.connections_refused.labels(reason).inc()

    def _bounded(self, send, scope):
        """``send`` for a response the router's own routes make (a resume's
        stream, a model list, metrics): a message the client takes none of
        for ``send_timeout`` seconds (its connection's buffers full: it
        stopped reading) closes the connection, as a completion's stream
        does. The route then ends as on a disconnect (the server sees the
        connection lost). An error answered before the request's body was
        read (a refused key) closes the connection after it, as the fast
        path's refusals do: uvicorn would read the rest of the body, however
        long, to find the next request."""
        timeout = self.svc.config.send_timeout
        cycle = getattr(send, "__self__", None)
        transport = getattr(cycle, "transport", None)
        if transport is None:
            return send

        http10 = scope.get("http_version") == "1.0"
        wire: TransportWire | None = None
        held = None  # an error's start, answered with its body by _answer_unread (the request's body unread)

        async def deliver(message) -> None:
            nonlocal wire
            if http10 and wire is None and message["type"] == "http.response.start":
                wire = _http10_stream(send, message, timeout)
                if wire is not None:
                    return
            if wire is not None:  # (a body message of that stream)
                await _wire_body(wire, message, timeout, scope)
                return
            if not timeout:
                return await send(message)
            try:
                await bounded(send(message), timeout)
            except ClientTooSlow as e:
                log.warning("%s %s: %s; closing its connection", scope["method"], scope["path"][:200], e)
                # (uvicorn marks only the connection's latest request gone: a
                # pipelined one may follow this; its later sends are dropped)
                cycle.disconnected = True
                transport.abort()

        # (two closures, not one that calls itself: that one was in a
        # reference cycle with its own cell, the request's cycle with it)
        async def bounded_send(message) -> None:
            nonlocal held
            if held is not None:
                start, held = held, None
                if not message.get("more_body", False) and _answer_unread(
                        send, start["status"], list(start.get("headers", ())), message.get("body", b"")):
                    return
                await deliver(start)
            elif message["type"] == "http.response.start" and message.get("status", 200) >= 400:
                close = _close_unless_read(send)
                if close and not any(k.lower() == b"connection" for k, _ in message.get("headers", ())):
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
                    if _answer_unread_possible(send):
                        held = message  # (its body comes next: both go in one write, then a lingering close)
                        return
            await deliver(message)

        return bounded_send

    async def _completion(self, receive, send, chat: bool, auth: str | None, path: str,
                          cors: list[tuple[bytes, bytes]], encoding: str | None = None,
                          client_rid: str = "", length: int | None = None) -> None:
        svc = self.svc
        request_id = new_request_id()
        endpoint = "chat" if chat else "completions"
        # The key and the declared size are checked before the body is read
        # (and before a client that sent ``Expect: 100-continue`` is told to
        # send it): a refusal then closes the connection, so that a body
        # nobody will read is not taken in.
        try:
            policy = svc.tenant(auth)
        except ApiError as e:
            e.headers.setdefault("x-request-id", request_id)
            log_refused(svc, endpoint, request_id, e, client_rid)
            await _error(send, cors, e.status, e.body(), {**e.headers, **_close_unless_read(send)})
            return
        limit = svc.config.max_body_bytes
        if length is not None and length > limit:
            await _too_large(send, cors, limit, Outcome(svc, policy, endpoint, time.monotonic(), request_id,
                                                        client_request_id=client_rid))
            return
        parts: list[bytes] = []  # (joined once: adding each piece copied a 4 MB body ~60 times)
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            parts.append(part)
            size += len(part)
            if size > limit:
                await _too_large(send, cors, limit, Outcome(svc, policy, endpoint, time.monotonic(), request_id,
                                                            client_request_id=client_rid))
                return
            if not msg.get("more_body", False):
                break
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        del parts
        task = asyncio.current_task()
        assert task is not None
        gone = False
        cycle = getattr(send, "__self__", None)
        callbacks: list | None = getattr(cycle, "lost_callbacks", None)
        listener: asyncio.Task | None = None

        def lost() -> None:
            nonlocal gone
            if not cycle.response_complete and not gone:  # (not a connection lost after this response)
                # (uvicorn marks only the connection's latest request: a
                # pipelined one may have followed this)
                cycle.disconnected = True
                gone = True
                task.cancel()

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        if callbacks is not None:
            callbacks.append(lost)
            # A body over uvicorn's high-water mark paused reading, and only
            # receive() resumes it: unpaused, the client's close is read.
            if cycle.flow.read_paused:  # (as resume_reading checks: no call for the others)
                cycle.flow.resume_reading()
        else:
            listener = asyncio.get_running_loop().create_task(listen())
        st = es = relay = None
        try:
            try:
                st = await start_generation(svc, policy, body, chat, request_id, endpoint,
                                            push=True, client_request_id=client_rid, content_encoding=encoding)
                if st.relay is not None:
                    es, sse_headers = await open_stream(svc, policy, st, chat, request_id)
                else:
                    resp = await respond_whole(svc, policy, st, chat, request_id)
            except ApiError as e:
                await _error(send, cors, e.status, e.body(), e.headers)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - answer 500 and keep serving
                log.exception("unhandled error on %s", path, exc_info=e)
                await _error(send, cors, 500, error_body("Internal server error.", "server_error"),
                             {"x-request-id": request_id})
                return
            if es is None:
                out = resp.content if isinstance(resp.content, bytes) else bytes(resp.content)
                headers = [_JSON, (b"content-length", str(len(out)).encode()), *_header_list(resp.headers), *cors]
                await send({"type": "http.response.start", "status": resp.status_code or 200, "headers": headers})
                await send({"type": "http.response.body", "body": out, "more_body": False})
                return
            wire = TransportWire.open(send, sse_headers, cors, svc.config.send_timeout)
            if wire is None:
                await _start_sse(send, cors, sse_headers)
                wire = wire_for(send, svc.config.send_timeout)
            # this frame lives as long as the stream: keep only what it needs
            # (the decoded request and its body go)
            relay = st.relay
            body = msg = part = sse_headers = policy = st = None
            try:
                await relay.run(es, wire)
                await wire.end(send)
            except ClientTooSlow as e:
                log.warning("stream %s: %s; closing its connection", request_id, e)
                wire.abort()
                return  # (settled below as a disconnect: the stream stays resumable)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: a normal end for this request
        except OSError:
            pass  # the connection broke while writing
        finally:
            if listener is not None:
                listener.cancel()
            else:
                callbacks.remove(lost)  # type: ignore[union-attr]
            if es is not None:
                es.gen.close()  # aborts on the replica unless it finished
                es.settle()
            if relay is not None:
                # (relay -> its event stream -> the generation -> relay: cut,
                # they go with their last reference, not at the cycle
                # collector's next run)
                relay.events = None


def _http10_stream(send, start, timeout: float) -> TransportWire | None:
    """The wire for a stream (a resume's) answered to an HTTP/1.0 request:
    its events as they are, ended by the connection's close. uvicorn's
    ``send`` chunks every body without a length, whatever the request's
    version, and HTTP/1.0 has no chunked encoding (RFC 9112). None for any
    other response (those have a length), or when the transport cannot
    take the head now (uvicorn's ``send`` then)."""
    headers = start.get("headers", ())
    if start.get("status", 200) != 200 or any(k.lower() == b"content-length" for k, _ in headers):
        return None
    if not any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
        return None
    return TransportWire.open(send, {}, [(k, v) for k, v in headers if k.lower() != b"content-type"], timeout)


async def _wire_body(wire: TransportWire, message, timeout: float, scope) -> None:
    body = message.get("body", b"")
    try:
        if message.get("more_body", False):
            if body:
                await wire.send(body)
        else:
            await wire.send_last(body or None)
    except ClientTooSlow as e:
        log.warning("%s %s: %s; closing its connection", scope["method"], scope["path"][:200], e)
        wire.abort()


def _answer_unread(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """Answer a request whose body has not been read, on the router's own
    connection protocol (``HttpConnection.answer_unread``: a lingering
    close, not a reset under a client still sending its body). False on
    another server, or when that cannot be done: answer through ``send``."""
    cycle = getattr(send, "__self__", None)
    answer = getattr(cycle, "answer_unread", None)
    return answer is not None and bool(cycle.more_body) and answer(cycle, status, headers, body)


def _answer_unread_possible(send) -> bool:
    return getattr(getattr(send, "__self__", None), "answer_unread", None) is not None


def _close_unless_read(send) -> dict[str, str]:
    """``connection: close`` for a response to a request whose body uvicorn
    has not read to its end (it then closes the connection after the
    response instead of reading the rest to find the next request). Empty on
    another server, which keeps its own connections (HTTP/2 forbids the
    header)."""
    cycle = getattr(send, "__self__", None)
    return {"connection": "close"} if getattr(cycle, "more_body", False) else {}


async def _too_large(send, cors: list[tuple[bytes, bytes]], limit: int, outcome: Outcome) -> None:
    """A 413 for a body over ``max_body_bytes``, counted and logged as the
    tenant's request (outcome ``client_error``), as every other refusal."""
    e = PayloadTooLarge(f"The request body is too large (over {limit} bytes).")
    outcome.record(outcome_of(e), error=e)
    await _error(send, cors, 413, e.body(), {"x-request-id": outcome.request_id, **_close_unless_read(send)})


def _with_request_id(send):
    """``send`` that gives a response an ``x-request-id`` if it has none."""
    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start" and not any(
                k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"x-request-id", new_request_id().encode())]}
        await send(message)

    return send_with_id


def _headers_only(send):
    """``send`` for a HEAD request served as GET: the response's head (its
    content-length included), no body. (uvicorn drops a HEAD response's body
    itself; this keeps it so on any ASGI server.)"""

    async def head_send(message) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)

    return head_send


def _header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]


async def _start_sse(send, cors: list[tuple[bytes, bytes]], sse_headers: dict[str, str]) -> None:
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), *_header_list(sse_headers), *cors]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def _error(send, cors: list[tuple[bytes, bytes]], status: int, body: bytes,
                 headers: dict[str, str] | None = None) -> None:
    hs = [_JSON, (b"content-length", str(len(body)).encode()), *_header_list(headers or {}), *cors]
    if headers and headers.get("connection") == "close" and _answer_unread(send, status, hs, body):
        return
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body, "more_body": False})
