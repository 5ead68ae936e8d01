"""The Litestar application: routes, error mapping and lifespan."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException

from router.admin import admin_routes
from router.auth import authorization
from router.completions import check_model, new_request_id
from router.config import RouterConfig
from router.cors import cors_config
from router.errors import ApiError, error_body, unknown_path
from router.fastpath import FastPath
from router.relay import log_refused
from router.resume_http import serve_resume
from router.service import RouterService
from router.websocket import chat_socket

__all__ = ["create_app"]

log = logging.getLogger("fairstream.router")

_JSON = "application/json"


def _svc(request: Request) -> RouterService:
    return request.app.state.service


async def _complete(request: Request, chat: bool) -> Response:
    """The Litestar side of the completion endpoints: resumed streams
    (``X-Resume-Request-Id``), and a reconnect that sent only
    ``Last-Event-ID``. Fresh requests never get here: the raw ASGI fast path
    in front (router/fastpath.py) serves them, and sends here only requests
    with one of those headers."""
    svc = _svc(request)
    policy = svc.tenant(authorization(request.headers))
    return await serve_resume(svc, policy, request.headers.get("x-resume-request-id"),
                              request.headers.get("last-event-id"), chat)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    return await _complete(request, True)


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    return await _complete(request, False)


# (path parameters are read from ``request.path_params``: a parameter in the
# handler's signature is Litestar 2.25's deprecated "inferred style", and its
# replacement, ``FromPath``, is not in the Litestar versions this project allows)
@get("/v1/streams/{request_id:str}")
async def resume_stream(request: Request) -> Response:
    """Resume a stream: events after Last-Event-ID, then the rest of it."""
    request_id: str = request.path_params["request_id"]
    svc = _svc(request)
    policy = svc.tenant(authorization(request.headers))
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    return await serve_resume(svc, policy, request_id, raw)


class _Model(msgspec.Struct, omit_defaults=True):
    """A model card as vLLM's ``/v1/models`` makes it (``max_model_len``
    when a ready replica reports it)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int | None = None  # (omitted when unknown)


def _card(svc: RouterService, model: str) -> _Model:
    # (created: when this router started, a stable time for every model it serves)
    return _Model(model, "model", svc.started, "fairstream", model, svc.pool.max_model_len(model))


class _ModelList(msgspec.Struct):
    object: str
    data: list[_Model]


@get("/v1/models")
async def models(request: Request) -> Response:
    svc = _svc(request)
    policy = svc.tenant(authorization(request.headers))
    data = [_card(svc, m) for m in svc.pool.models() if policy.allows_model(m)]
    # (an id as every /v1 response has, OpenAI's too; the SDK reads it as _request_id)
    return Response(msgspec.json.encode(_ModelList("list", data)), media_type=_JSON,
                    headers={"x-request-id": new_request_id()})


@get("/v1/models/{model:path}")
async def model(request: Request) -> Response:
    """One model (``client.models.retrieve``); a model id may contain slashes."""
    model: str = request.path_params["model"]
    svc = _svc(request)
    policy = svc.tenant(authorization(request.headers))
    name = model.removeprefix("/")
    if name not in svc.pool.models() and "/" + name in svc.pool.models():
        # a model id that starts with a slash (a model directory's path, what
        # vLLM and a replica config without served_name report): the SDK asks
        # for /v1/models//abs/dir, whose slashes the router squeezes
        name = "/" + name
    check_model(svc, policy, name)
    return Response(msgspec.json.encode(_card(svc, name)), media_type=_JSON,
                    headers={"x-request-id": new_request_id()})


@get("/health")
async def health() -> Response:
    return Response(b'{"status":"ok"}', media_type=_JSON)


@get("/ready")
async def ready(request: Request) -> Response:
    svc = _svc(request)
    await svc.store.check()
    replicas = {s.name: s.status for s in svc.pool.slots}
    # (not before the store's first answer: a router that serves meanwhile
    # counts its tenants where no other router sees them, or refuses them)
    connecting = svc.store.connecting
    store_ok = svc.store_healthy or (svc.config.state.on_outage == "open" and not connecting)
    ok = any(s.ready for s in svc.pool.slots) and store_ok
    body = msgspec.json.encode({
        "ready": ok,
        "replicas": replicas,
        "state_store": {"backend": svc.store.name, "healthy": svc.store_healthy, "connecting": connecting},
        "tenants_digest": svc.policy.current.digest,
        # (other routers on the same state store whose tenants.yaml differs: router -> digest)
        "tenants_differ": svc.peers.differ,
    })
    return Response(body, media_type=_JSON, status_code=200 if ok else 503)


@get("/metrics")
async def metrics(request: Request) -> Response:
    svc = _svc(request)
    if svc.config.metrics_require_admin_key:
        svc.check_admin(authorization(request.headers))
    await svc.store.check()  # (so that fairstream_state_store_up drops while the router is idle too)
    return Response(await svc.metrics.expose(svc.pool), media_type="text/plain; version=0.0.4")  # (Litestar adds the charset)


def _endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request to a Litestar route (bounded)."""
    for prefix, name in (("/v1/chat/", "chat"), ("/v1/completions", "completions"), ("/v1/streams/", "resume"),
                         ("/v1/models", "models"), ("/admin/", "admin")):
        if path.startswith(prefix):
            return name
    return "other"


def _api_error(request: Request, exc: ApiError) -> Response:
    # (an error of a request that got no id on its way, a /v1/models one's, has one too)
    request_id = exc.headers.setdefault("x-request-id", new_request_id())
    if exc.status in (401, 403):  # no tenant to count it under: count and log it as unauthorized
        log_refused(_svc(request), _endpoint_of(request.url.path), request_id, exc)
    return Response(exc.body(), status_code=exc.status, headers=exc.headers, media_type=_JSON)


_HTTP_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


def _http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    code = None
    headers = {**(exc.headers or {}), "x-request-id": new_request_id()}
    if status == 404:
        message = unknown_path(request.url.path).message  # (a WebSocket upgrade's too: router/fastpath.py)
    elif status == 405 and request.url.path.rstrip("/") == "/v1/ws":
        # (a GET is the right method there: what is missing is the upgrade)
        message = ("/v1/ws takes WebSocket connections only: a GET with the headers Upgrade: websocket and "
                   "Connection: Upgrade (a WebSocket client sends them).")
    elif status == 405 and request.method == "HEAD" and request.url.path.startswith("/v1/streams/"):
        # (HEAD is served on the other GET routes: router/fastpath.py)
        message = ("HEAD is not served on /v1/streams/{id}: a GET there resumes the stream (it may admit and run "
                   "a generation), which a HEAD would pay for and never see; send GET.")
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    elif status == 413:  # (request_max_body_size: max_body_bytes)
        message = f"The request body is too large (over {_svc(request).config.max_body_bytes} bytes)."
        code = "request_too_large"  # (the rest of the body is not read: FastPath._bounded closes the connection)
    else:
        message = str(exc.detail)
    type_ = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return Response(error_body(message, type_, None, code), status_code=status, headers=headers, media_type=_JSON)


def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return Response(error_body("Internal server error.", "server_error"), status_code=500, media_type=_JSON,
                    headers={"x-request-id": new_request_id()})


def create_app(config: RouterConfig, tenants_path: Path) -> FastPath:
    """The router as one ASGI app: the completion fast path in front of Litestar."""
    service = RouterService(config, tenants_path)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = Litestar(
        route_handlers=[chat_completions, completions, resume_stream, chat_socket, models, model, health, ready, metrics,
                        *admin_routes],
        lifespan=[lifespan],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        request_max_body_size=config.max_body_bytes,
        cors_config=cors_config(config.cors),
        openapi_config=None,
        # logging is the process's (router.logs, set up by the command that
        # runs the app): Litestar's default config replaced its handlers
        logging_config=None,
        debug=False,
    )
    app.state.service = service
    return FastPath(app)
