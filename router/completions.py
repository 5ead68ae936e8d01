"""``/v1/chat/completions`` and ``/v1/completions``: from request body to response.

The first piece of a generation is awaited before headers are sent, so "no
replica", "prompt too long" and friends get a proper HTTP status. After that
the stream relays pieces as SSE events; a stream that cannot continue ends
with an explicit error event and no ``[DONE]``. Closing the response early
(client disconnect) closes the generation, which aborts it on its replica.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from litestar import Response
from litestar.response import Stream

from replicas.protocol import FinishReason
from router.errors import ApiError, BadRequest, NotFound, error_body
from router.generation import Generation, Job, Piece, StreamLost
from router.openai_types import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    completion_prompt,
    decode_request,
    to_params,
)
from router.service import RouterService
from router.sse import DONE, ChunkEncoder, Usage

__all__ = ["handle_completion"]

log = logging.getLogger("fairstream.router")


class _ChatMessage(msgspec.Struct):
    role: str
    content: str


class _ChatChoice(msgspec.Struct):
    index: int
    message: _ChatMessage
    logprobs: None
    finish_reason: str | None


class _TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class _Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice] | list[_TextChoice]
    usage: Usage


def _job(svc: RouterService, body: bytes, chat: bool) -> tuple[ChatRequest | CompletionRequest, Job]:
    req = decode_request(body, ChatRequest if chat else CompletionRequest)
    if req.model not in svc.pool.models():
        raise NotFound(f"The model '{req.model}' does not exist.", param="model", code="model_not_found")
    params = to_params(req, svc.config.default_max_tokens)
    if isinstance(req, ChatRequest):
        return req, Job(req.model, params, messages=chat_messages(req))
    prompt = completion_prompt(req)
    if isinstance(prompt, list):
        return req, Job(req.model, params, prompt_token_ids=prompt)
    return req, Job(req.model, params, prompt=prompt)


async def handle_completion(svc: RouterService, body: bytes, tenant: str, chat: bool, request_id: str) -> Response:
    endpoint = "chat" if chat else "completions"
    started = time.monotonic()
    m = svc.metrics
    priority = svc.priority(tenant)
    try:
        req, job = _job(svc, body, chat)
    except ApiError:
        m.requests.labels(tenant, endpoint, "client_error").inc()
        raise
    gen = Generation(svc.pool, job, m, svc.config.max_failovers)
    pieces = gen.stream()
    try:
        first = await pieces.__anext__()
    except ApiError as e:
        await pieces.aclose()
        m.requests.labels(tenant, endpoint, "client_error" if e.status < 500 else "unavailable").inc()
        raise
    except BaseException:
        await pieces.aclose()
        m.requests.labels(tenant, endpoint, "cancelled").inc()
        raise
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    created = int(time.time())
    headers = {"x-request-id": request_id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        enc = ChunkEncoder(chat, response_id, req.model, created)
        relay = _relay(svc, gen, pieces, first, enc, include_usage, tenant, priority, endpoint, started)
        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        return Stream(relay, media_type="text/event-stream", headers=headers)
    text_parts: list[str] = []
    try:
        async with aclosing(pieces):
            piece: Piece | None = first
            ttft_seen = False
            while piece is not None:
                text, n, finish = piece
                if n and not ttft_seen:
                    ttft_seen = True
                    m.ttft.labels(tenant, priority).observe(time.monotonic() - started)
                text_parts.append(text)
                piece = None if finish != FinishReason.NONE else await pieces.__anext__()
    except StreamLost as e:
        m.requests.labels(tenant, endpoint, "lost").inc()
        raise ApiError(f"The generation failed and could not be resumed: {e}", code="stream_lost") from e
    except BaseException:
        m.requests.labels(tenant, endpoint, "cancelled").inc()
        raise
    _account(svc, gen, tenant, priority, endpoint, started, "ok")
    text = "".join(text_parts)
    finish_reason = gen.finish.openai
    if chat:
        choices: list = [_ChatChoice(0, _ChatMessage("assistant", text), None, finish_reason)]
    else:
        choices = [_TextChoice(0, text, None, finish_reason)]
    usage = Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)
    obj = "chat.completion" if chat else "text_completion"
    body_out = msgspec.json.encode(_Completion(response_id, obj, created, req.model, choices, usage))
    return Response(body_out, media_type="application/json", headers=headers)


def _account(svc: RouterService, gen: Generation, tenant: str, priority: str, endpoint: str,
             started: float, outcome: str) -> None:
    m = svc.metrics
    m.requests.labels(tenant, endpoint, outcome).inc()
    m.tokens.labels(tenant, "prompt").inc(gen.prompt_tokens)
    m.tokens.labels(tenant, "completion").inc(gen.completion_tokens)
    m.e2e.labels(tenant, priority).observe(time.monotonic() - started)


async def _relay(
    svc: RouterService,
    gen: Generation,
    pieces: AsyncIterator[Piece],
    first: Piece,
    enc: ChunkEncoder,
    include_usage: bool,
    tenant: str,
    priority: str,
    endpoint: str,
    started: float,
) -> AsyncIterator[bytes]:
    m = svc.metrics
    ttft = m.ttft.labels(tenant, priority)
    itl = m.itl.labels(tenant, priority)
    outcome = "cancelled"
    last = None
    try:
        async with aclosing(pieces):  # type: ignore[type-var]
            piece: Piece | None = first
            while piece is not None:
                text, n, finish = piece
                if n:
                    now = time.monotonic()
                    if last is None:
                        ttft.observe(now - started)
                    else:
                        itl.observe((now - last) / n)
                    last = now
                if text or finish != FinishReason.NONE:
                    yield enc.delta(text, finish)
                if finish != FinishReason.NONE:
                    break
                piece = await pieces.__anext__()
            if include_usage:
                yield enc.usage(gen.prompt_tokens, gen.completion_tokens)
            yield DONE
            outcome = "ok"
    except StreamLost as e:
        outcome = "lost"
        log.warning("stream lost after %d tokens: %s", gen.completion_tokens, e)
        yield enc.error(
            error_body(f"The stream was interrupted and could not be resumed: {e}", "server_error",
                       None, "stream_lost")
        )
    finally:
        if outcome == "cancelled":
            m.requests.labels(tenant, endpoint, outcome).inc()
        else:
            _account(svc, gen, tenant, priority, endpoint, started, outcome)


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]
