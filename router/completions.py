"""``/v1/chat/completions`` and ``/v1/completions``: from request body to response.

Path of one request: decode (400 naming the field) -> tenant checks (model
allowed, max_tokens) -> admission (429 with Retry-After, or a queued wait)
-> generation on a replica. The first piece is awaited before headers are
sent, so "no replica", "prompt too long" and a first-token timeout get a
proper HTTP status. After that the stream relays pieces as SSE events; a
stream that cannot continue ends with an explicit error event and no
``[DONE]``. Closing the response early (client disconnect) closes the
generation, which aborts it on its replica. The admission ticket (lease and
token reservation) is settled in ``finally`` with the real usage.
"""

from __future__ import annotations

import logging
import time
import zlib
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Response

from replicas.protocol import FinishReason, SamplingParams
from router.admission import Ticket
from router.deadlines import Deadlines, StreamTimeout
from router.errors import (ApiError, BadRequest, NotFound, PayloadTooLarge, ReplicaUnavailable,
                           UnsupportedMediaType, clip)
from router.generation import Generation, StreamLost
from router.estimate import base_estimate, messages_estimate
from router.ids import new_id
from router.job import Job
from router.prompt import completion_prompt
from router.openai_types import (
    ChatRequest,
    CompletionRequest,
    chat_message_slices,
    chat_messages,
    chat_template_kwargs,
    decode_request,
    max_tokens_param,
    to_params,
    usage_options,
)
from router.service import RouterService
from router.logs import request_id_var
from router.largebody import SLICE, large
from router.pieces import Piece
from router.push import PushRelay
from router.relay import EventStream, Outcome, error_before_output, outcome_of
from router.resume import ResumeMeta
from router.sse import ChunkEncoder, Usage
from router.tenants import TenantPolicy

__all__ = ["check_model", "start_generation", "open_stream", "respond_whole", "Started",
           "new_request_id", "response_id_of"]

log = logging.getLogger("fairstream.router")

class _ChatMessage(msgspec.Struct):
    role: str
    content: str


class _ChatChoice(msgspec.Struct):
    index: int
    message: _ChatMessage
    logprobs: None
    finish_reason: str | None
    stop_reason: str | int | None  # vLLM's: the stop string or stop token id that ended it


class _TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: str | int | None  # vLLM's: the stop string or stop token id that ended it


class _Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice] | list[_TextChoice]
    usage: Usage


new_request_id = new_id


def response_id_of(chat: bool, request_id: str) -> str:
    """The OpenAI response id of a request: ``chatcmpl-`` or ``cmpl-`` and its request id."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def check_model(svc: RouterService, policy: TenantPolicy, model: str) -> None:
    """Raise OpenAI's 404 unless a replica serves ``model`` and the tenant may use it."""
    if svc.pool.serves(model) and policy.allows_model(model):
        return
    unknown = svc.pool.models_unknown() if policy.allows_model(model) else 0
    if unknown:
        # (a replica not connected yet may serve it: a 503 to retry, not a 404, which clients do not retry;
        # one that refused the router's credentials is the operator's to fix, so the message says so)
        why = "".join(f"; {w}" for w in svc.pool.credentials_refused(""))
        raise ReplicaUnavailable(
            f"no ready replica serves model '{clip(model)}' ({unknown} replica(s) not connected yet "
            f"may serve it{why}); retry shortly.")
    raise NotFound(f"The model '{clip(model)}' does not exist or you do not have access to it.",
                   param="model", code="model_not_found")


# max_tokens of a /v1/completions request that does not set it, as OpenAI's
# legacy completions and vLLM's have it (a chat's is default_max_tokens)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_GZIP_MEMBERS = 16


def decoded_body(body: bytes, encoding: str, limit: int) -> bytes:
    """A request body sent with ``Content-Encoding`` (gzip or deflate, as
    clients behind compressing proxies send them), decompressed to at most
    ``limit`` bytes."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip().lower() not in ("", "identity")]
    if not codings:
        return body
    if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {clip(repr(encoding))} is not supported; send the body as is, "
                                   "or compressed with gzip or deflate.")
    # gzip; deflate as RFC 9110 means it (zlib-wrapped), raw deflate too (what some clients send)
    if codings[0] != "deflate":
        wbits = 16 + zlib.MAX_WBITS
    else:
        wbits = zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS
    out: list[bytes] = []
    size = 0
    rest = body
    for _ in range(MAX_GZIP_MEMBERS):  # (gzip: one member after another; a few, not thousands)
        d = zlib.decompressobj(wbits)
        try:
            part = d.decompress(rest, limit + 1 - size)
        except zlib.error as e:
            raise BadRequest(f"The request body is not valid {codings[0]} data: {e}.", code="invalid_body") from e
        out.append(part)
        size += len(part)
        if size > limit:
            raise PayloadTooLarge("The request body is too large (decompressed).")
        if not d.eof:
            raise BadRequest(f"The request body's {codings[0]} data is truncated.", code="invalid_body")
        rest = d.unused_data
        if not rest:
            return b"".join(out)
        if wbits != 16 + zlib.MAX_WBITS:
            break
    raise BadRequest(f"The request body has data after its {codings[0]} stream.", code="invalid_body")


def _decode(body: bytes, chat: bool, stream_implied: bool) -> ChatRequest | CompletionRequest:
    """The request, decoded and checked on its own (no tenant, no replica)."""
    req = decode_request(body, ChatRequest if chat else CompletionRequest)
    if req.stream_options is not None and not (req.stream or stream_implied):  # (as OpenAI and vLLM answer)
        raise BadRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return req


def _params(req: ChatRequest | CompletionRequest, default: int, cap: int) -> SamplingParams:
    """The request's sampling parameters; ``default`` and ``cap``: the
    ``max_tokens`` it gets when unset and the most it may ask for."""
    params = to_params(req, default)
    if cap and params.max_tokens > cap:
        name = max_tokens_param(req, default)
        raise BadRequest(
            f"'{name}' is {params.max_tokens}; this tenant may ask for at most {cap}.",
            param=name, code="max_tokens_exceeded",
        )
    return params


def _check_context(svc: RouterService, req: ChatRequest | CompletionRequest, params: SamplingParams) -> None:
    """A ``max_tokens`` over the model's whole context (as its ready replicas
    report it; the largest, if they differ) can never run: the 400 vLLM
    gives, before the tenant's limits, whose 429 would say to wait or to ask
    for less of a budget the request could never use. Where no ready
    replica says, the replica's own check refuses it (``replicas.prepare``).
    An unset ``max_tokens`` is never refused: its replica lowers the default
    to what the context leaves, as vLLM's server does; a ``min_tokens`` the
    client sent over the whole context is."""
    if params.max_tokens_default:
        name, asked = "min_tokens", params.min_tokens
    else:  # (the client set it: the default is not needed to name its field)
        name, asked = max_tokens_param(req, params.max_tokens), params.max_tokens
    limit = svc.pool.max_model_len(req.model, largest=True)
    if limit is not None and asked > limit:
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked} tokens in the completion ({name}={asked} cannot be greater "
            f"than max_model_len={limit}). Please reduce {name}.",
            param=name, code="context_length_exceeded",
        )


def _build(req: ChatRequest | CompletionRequest, params: SamplingParams,
           checked: tuple[dict[str, Any] | None, list[dict[str, str]], int] | None = None) -> tuple[Job, int]:
    """The job of a decoded request whose model and parameters were checked,
    and its prompt's base estimate (``PromptEstimates.estimate``); a chat's
    ``checked`` template kwargs, messages and messages' estimate where a
    large body's slices checked them already (``_sliced``). A chat's
    template kwargs are checked first: that is cheap, as ``decode_request``
    let through at most 16 KiB of them."""
    if isinstance(req, ChatRequest):
        if checked is None:
            kwargs = chat_template_kwargs(req)
            checked = kwargs, chat_messages(req), None
        kwargs, messages, counted = checked
        job = Job(req.model, params, messages=messages, template_kwargs=kwargs, reasoning_effort=req.reasoning_effort)
        return job, base_estimate(job, counted)
    prompt = completion_prompt(req)
    if isinstance(prompt, list):
        job = Job(req.model, params, prompt_token_ids=prompt)
    else:
        job = Job(req.model, params, prompt=prompt)
    return job, base_estimate(job)


async def _sliced(svc: RouterService, policy: TenantPolicy, body: bytes, chat: bool, stream_implied: bool,
                  default: int, cap: int, deadlines: Deadlines | None
                  ) -> tuple[ChatRequest | CompletionRequest, Job, int]:
    """``_build`` of a large body, in slices with a loop turn between two,
    one large body at a time, the turns going round the tenants
    (``router.largebody``; the tenant is known: the key was checked before
    the body was read): the same checks in the
    same order, so the same first error. The wait for its turn ends at the
    request's first-token or total limit (``deadlines``) with that timeout."""
    turn = svc.large_bodies.turn
    async with svc.large_bodies.turn_for(policy.name, deadlines.wait_limit(False) if deadlines is not None else None):
        req = _decode(body, chat, stream_implied)
        await turn()
        check_model(svc, policy, req.model)
        params = _params(req, default, cap)
        if not isinstance(req, ChatRequest):
            return req, *_build(req, params)
        kwargs = chat_template_kwargs(req)
        messages: list[dict[str, str]] = []
        counted = 0
        for n, part in enumerate(chat_message_slices(req, SLICE)):
            if n:
                await turn()
            messages += part
            counted += messages_estimate(part)
        return req, *_build(req, params, (kwargs, messages, counted))


async def _job(svc: RouterService, policy: TenantPolicy, body: bytes, chat: bool, stream_implied: bool,
               content_encoding: str | None, deadlines: Deadlines | None = None
               ) -> tuple[ChatRequest | CompletionRequest, Job, int]:
    """Decode and check the request; return it, its job and its prompt's base
    estimate. A large body's work is sliced (``_sliced``); ``deadlines``
    end its wait for its turn."""
    if content_encoding is not None:  # (zlib, at most max_body_bytes out: a few ms)
        body = decoded_body(body, content_encoding, svc.config.max_body_bytes)
    cap = policy.limits.max_tokens
    default = svc.config.default_max_tokens
    if not chat:  # (OpenAI's and vLLM's default for a completions request)
        default = min(default, COMPLETIONS_DEFAULT_MAX_TOKENS)
    if cap:
        default = min(default, cap)
    if large(len(body)):
        return await _sliced(svc, policy, body, chat, stream_implied, default, cap, deadlines)
    req = _decode(body, chat, stream_implied)
    check_model(svc, policy, req.model)
    return req, *_build(req, _params(req, default, cap))


class Started:
    """A request past admission with its first piece in hand: in ``first``
    (pulled from ``pieces``), or waiting in ``relay`` (pushed)."""

    __slots__ = ("req", "job", "ticket", "gen", "pieces", "first", "relay", "outcome", "created")

    def __init__(self, req, job, ticket, gen, pieces, first, relay, outcome) -> None:
        self.req = req
        self.job = job
        self.ticket = ticket
        self.gen = gen
        self.pieces = pieces
        self.first = first
        self.relay = relay
        self.outcome = outcome
        self.created = int(time.time())

    async def close(self) -> None:
        """Stop the generation (abort on its replica)."""
        if self.pieces is not None:
            await self.pieces.aclose()
        else:
            self.gen.close()


async def start_generation(
    svc: RouterService, policy: TenantPolicy, body: bytes, chat: bool, request_id: str, endpoint: str,
    push: bool = False, stream_implied: bool = False, client_request_id: str = "",
    content_encoding: str | None = None,
) -> Started:
    """Decode, admit, queue and dispatch; return once the first piece arrived.

    ``push``: a streamed request's output goes to a ``PushRelay`` (the
    caller runs it); otherwise it is pulled from ``Started.pieces``.
    ``stream_implied``: the endpoint streams whatever the body says (WebSocket).
    ``client_request_id``: the caller's ``X-Request-Id``, for the log line.
    ``content_encoding``: the body's ``Content-Encoding`` (gzip, deflate). Every
    failure up to here is an ``ApiError`` with its HTTP status, and leaves
    nothing behind (lease released, replica request aborted).
    """
    started = time.monotonic()
    request_id_var.set(request_id)
    outcome = Outcome(svc, policy, endpoint, started, request_id, client_request_id=client_request_id)
    lim = policy.limits
    deadlines = Deadlines(lim.first_token, lim.stall, lim.total, start=started)
    try:
        req, job, base = await _job(svc, policy, body, chat, stream_implied, content_encoding, deadlines)
        _check_context(svc, req, job.params)
        prompt_estimate = svc.estimates.estimate(job, base)[0]
        # (a stream's reservation is kept for a continuation to take over if this router dies)
        hold = svc.resume.retention if req.stream or stream_implied else 0.0
        ticket = await svc.admission.admit(policy, prompt_estimate + job.params.max_tokens,
                                           prompt_tokens=prompt_estimate, deadlines=deadlines, hold=hold)
    except BaseException as e:
        # (a wait for the tenant's limits that its first-token or total limit ended: that 504)
        told = error_before_output(svc.metrics, policy.name, e, {"x-request-id": request_id})
        outcome.record(outcome_of(e), error=told)
        try:
            if told is e:
                raise
            raise told from e
        finally:
            # (this frame is in told's traceback: holding told too, it would
            # be a cycle, and keep the frames' locals, the request's body and
            # its decoded copy, until a cycle collection, which the router
            # makes rare: router.service. A refused request of 4 MB kept
            # 4-40 MB that way, and refused ones piled up to gigabytes.)
            del told
    gen = Generation(
        svc.pool, job, svc.metrics, svc.config.max_failovers, deadlines,
        scheduler=svc.scheduler, policy=policy, rank=policy.rank, failover_wait=svc.config.failover_wait,
    )
    relay = PushRelay(gen.chunk_tokens) if push and req.stream else None
    pieces = gen.stream() if relay is None else None
    first = None
    prompt_refused = False  # (max_prompt_tokens: takes nothing, as any refusal by the tenant's limits)
    try:
        if pieces is not None:
            first = await pieces.__anext__()
        else:
            await gen.start(relay)
            await relay.first()
        # (on the ids: a count from an upstream's usage chunk comes after the output)
        if gen.prompt_token_ids is not None:
            svc.estimates.learn(job, base, gen.prompt_tokens)
        if lim.max_prompt_tokens and gen.prompt_token_ids is not None and gen.prompt_tokens > lim.max_prompt_tokens:
            prompt_refused = True
            raise BadRequest(
                f"The prompt has {gen.prompt_tokens} tokens; this tenant's limit is {lim.max_prompt_tokens}.",
                param="messages" if chat else "prompt", code="prompt_too_long",
            )
    except BaseException as e:
        if pieces is not None:
            await pieces.aclose()
        else:
            gen.close()
        await svc.admission.finish(ticket, 0 if prompt_refused else gen.used_tokens)
        told = error_before_output(svc.metrics, policy.name, e, {"x-request-id": request_id, **ticket.headers})
        outcome.record(outcome_of(e), error=told)  # (its line has the status the client gets)
        try:
            if told is e:
                raise
            raise told from e
        finally:
            del told  # (a cycle otherwise: see the first handler above)
    return Started(req, job, ticket, gen, pieces, first, relay, outcome)


async def open_stream(svc: RouterService, policy: TenantPolicy, st: Started, chat: bool,
                      request_id: str) -> tuple[EventStream, dict[str, str]]:
    """A started streamed request's resume buffer, its ``EventStream`` and
    its response headers (the caller then relays it).

    A stream whose output comes without token ids (an upstream that returns
    none) gets no resume buffer: nothing could continue it exactly, so a
    resume of it is a 404 rather than a wrong continuation."""
    req, gen = st.req, st.gen
    response_id = response_id_of(chat, request_id)
    usage = usage_options(req)
    enc = ChunkEncoder(chat, response_id, req.model, st.created)
    resumable = gen.exact
    if resumable:
        try:
            await svc.resume.open(request_id, ResumeMeta(
                policy.name, chat, req.model, response_id, st.created, usage[0], st.job.params,
                gen.prompt_token_ids or [], usage[1], st.ticket.lease_id,
            ))
        except BaseException as e:
            await st.close()
            await svc.admission.finish(st.ticket, gen.prompt_tokens + gen.completion_tokens)
            await svc.resume.release(request_id)
            st.outcome.record(outcome_of(e), gen, e)
            raise
    es = EventStream(svc, gen, enc, usage, policy, st.ticket, st.outcome,
                     request_id if resumable else None)
    headers = {"x-request-id": request_id, **st.ticket.headers, "cache-control": "no-cache",
               "x-accel-buffering": "no"}
    return es, headers


async def respond_whole(svc: RouterService, policy: TenantPolicy, st: Started, chat: bool,
                        request_id: str) -> Response:
    """The response of a started request that did not ask to stream."""
    response_id = response_id_of(chat, request_id)
    headers = {"x-request-id": request_id, **st.ticket.headers}
    return await _collect(svc, st.gen, st.pieces, st.first, st.req.model, chat, response_id, st.created, headers,
                          policy, st.ticket, st.outcome)


async def _collect(svc, gen: Generation, pieces, first: Piece, model: str, chat: bool, response_id: str,
                   created: int, headers: dict[str, str], policy: TenantPolicy, ticket: Ticket,
                   outcome: Outcome) -> Response:
    m = svc.metrics
    text_parts: list[str] = []
    result = "cancelled"
    error: BaseException | None = None
    try:
        async with aclosing(pieces):
            piece: Piece | None = first
            if gen.completion_tokens:
                m.counts(policy.name, policy.priority).first_token(time.monotonic() - outcome.started)
            while piece is not None:
                text, n, finish = piece
                text_parts.append(text)
                piece = None if finish != FinishReason.NONE else await pieces.__anext__()
        result = "ok"
    # (each error carries the response's headers: its id and the rate limits as of its admission)
    except StreamLost as e:
        result, error = "lost", ApiError(f"The generation failed and could not be resumed: {e}", code="stream_lost",
                                         headers=dict(headers))
        raise error from e
    except StreamTimeout as e:
        result, error = f"timeout_{e.which}", error_before_output(m, policy.name, e, headers)
        if e.which == "total":
            # (the generation ran all of the tenant's total limit: the same
            # request would again, so the SDK is told not to retry it, and
            # pay for the tokens of a response it would not get, twice more)
            error.headers["x-should-retry"] = "false"
        raise error from e
    except ApiError as e:
        result, error = outcome_of(e), error_before_output(m, policy.name, e, headers)
        raise
    finally:
        try:
            await svc.admission.finish(ticket, gen.prompt_tokens + gen.completion_tokens)
            outcome.record(result, gen, error)
        finally:
            del error  # (raised, it has this frame in its traceback: a cycle, as in start_generation)
    text = "".join(text_parts)
    finish_reason = gen.finish.openai
    if chat:
        choices: list = [_ChatChoice(0, _ChatMessage("assistant", text), None, finish_reason, gen.stop_reason)]
    else:
        choices = [_TextChoice(0, text, None, finish_reason, gen.stop_reason)]
    usage = Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)
    obj = "chat.completion" if chat else "text_completion"
    body_out = msgspec.json.encode(_Completion(response_id, obj, created, model, choices, usage))
    return Response(body_out, media_type="application/json", headers=headers)
