"""Resuming a stream: replay from the buffer, then tail or continue it.

Two ways in, same behaviour:

* ``GET /v1/streams/{request_id}`` with ``Last-Event-ID`` (what an
  EventSource reconnect sends) or ``?last_event_id=N``;
* re-sending the original POST with ``Last-Event-ID`` and
  ``X-Resume-Request-Id: {request_id}`` headers (the body is not used again).

Only the tenant that started a stream can resume it (others get 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from litestar import Response
from litestar.response import Stream

from router.errors import ApiError, BadRequest, NotFound
from router.generation import Deadlines, Generation, Job
from router.relay import Outcome, relay_stream
from router.resume import decode_meta
from router.service import RouterService
from router.sse import ChunkEncoder
from router.state import StoreUnavailable
from router.tenants import TenantPolicy

__all__ = ["handle_resume", "parse_last_event_id"]

log = logging.getLogger("fairstream.resume")

TAIL_POLL = 0.02


def parse_last_event_id(value: str | None) -> int:
    if value is None or value == "":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise BadRequest(f"Last-Event-ID must be an event number; got {value!r}.", param="Last-Event-ID") from None
    if n < 0:
        raise BadRequest("Last-Event-ID must not be negative.", param="Last-Event-ID")
    return n


async def handle_resume(svc: RouterService, policy: TenantPolicy, sid: str, last_id: int) -> Response:
    try:
        snap = await svc.store.stream_read(sid, last_id)
    except StoreUnavailable as e:
        raise NotFound(f"Stream {sid} cannot be resumed now: the state store is unavailable.",
                       code="stream_not_found") from e
    if snap is None:
        raise NotFound(f"No resumable stream {sid!r} (unknown, or past its retention window).",
                       code="stream_not_found")
    meta = decode_meta(snap.meta)
    if meta.tenant != policy.name:
        raise NotFound(f"No resumable stream {sid!r} (unknown, or past its retention window).",
                       code="stream_not_found")
    if last_id > snap.total_events:
        raise BadRequest(f"Last-Event-ID {last_id} is past the stream's last event ({snap.total_events}).",
                         param="Last-Event-ID")
    svc.metrics.resumes.labels(policy.name).inc()
    headers = {"x-request-id": sid, "cache-control": "no-cache", "x-accel-buffering": "no"}
    return Stream(_resume(svc, policy, sid, meta, snap), media_type="text/event-stream", headers=headers)


async def _resume(svc: RouterService, policy: TenantPolicy, sid: str, meta, snap) -> AsyncIterator[bytes]:
    for event in snap.events:
        yield event
    cursor = snap.total_events
    finished = snap.finished
    owner = snap.owner
    # Someone is still generating it: follow the buffer until it ends or its
    # owner goes away (then take over).
    while not finished:
        if owner and owner != svc.resume.owner:
            await asyncio.sleep(TAIL_POLL)
            nxt = await svc.store.stream_read(sid, cursor)
            if nxt is None:
                return
            for event in nxt.events:
                yield event
            cursor = nxt.total_events
            finished = nxt.finished
            owner = nxt.owner
            snap = nxt
            continue
        if not await svc.resume.claim(sid):
            owner = "?"  # lost the race to another router: follow it
            nxt = await svc.store.stream_read(sid, cursor)
            if nxt is None:
                return
            owner = nxt.owner or "?"
            continue
        # Ours now: continue the generation from the delivered tokens.
        fresh = await svc.store.stream_read(sid, cursor)
        if fresh is None:
            return
        for event in fresh.events:
            yield event
        cursor = fresh.total_events
        if fresh.finished:
            return
        try:
            async for chunk in _continue(svc, policy, sid, meta, fresh, cursor):
                yield chunk
        except ApiError as e:
            await svc.store.stream_release(sid, svc.resume.owner)
            yield ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created,
                               event_id=cursor).error(e.body())
        return


async def _continue(svc: RouterService, policy: TenantPolicy, sid: str, meta, snap, cursor: int):
    started = time.monotonic()
    lim = policy.limits
    job = Job(meta.model, meta.params, prompt_token_ids=meta.prompt_token_ids)
    gen = Generation(
        svc.pool, job, svc.metrics, svc.config.max_failovers,
        Deadlines(lim.first_token, lim.stall, lim.total, start=started),
        scheduler=svc.scheduler, policy=policy, rank=svc.rank(policy),
    )
    gen.completion_ids = list(snap.token_ids)
    gen.text_len = snap.text_len
    enc = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created, event_id=cursor,
                       role_sent=bool(snap.token_ids))
    outcome = Outcome(svc, policy, "resume", started, sid)
    remaining = meta.params.max_tokens - len(snap.token_ids)
    ticket = await svc.admission.admit(policy, max(1, remaining), count_request=False)
    log.info("resuming stream %s at %d tokens on this router", sid, len(snap.token_ids))
    async for chunk in relay_stream(svc, gen, gen.stream(), None, enc, meta.include_usage, policy,
                                    ticket, outcome, sid):
        yield chunk
