"""Resuming a stream: replay from the buffer, then tail or continue it.

Two ways in, same behaviour:

* ``GET /v1/streams/{request_id}`` with ``Last-Event-ID`` (what an
  EventSource reconnect sends) or ``?last_event_id=...``;
* re-sending the original POST with ``Last-Event-ID`` and
  ``X-Resume-Request-Id: {request_id}`` headers (the body is not used again).

Only the tenant that started a stream can resume it (others get 404).

Event ids are ``N-T-C`` (event number, completion tokens, text characters;
see router/sse.py), ``N-T-C-1`` for the finish event and ``N-T-C-2`` for the
usage event after it. Usually event N is in the buffer, with those counts, and
the replay starts after it; else the client is placed by its counts
(router/resume_position.py). The buffer is written a few milliseconds behind
the stream, so a router that dies can take the last events with it while its
client already has them: then the client is ahead of the buffer (N > events
stored, and more tokens and text). The resuming router continues generating
from the tokens the buffer has and drops the ``C - stored characters`` of text
the client already holds before sending anything; where the id says the
client has the finish (and the usage event), the regenerated finish is not
sent again (nor the usage event). A resume cut off while it regenerates that
text leaves the buffer level with the client in events but short of it in
text, its last events placeholders (``ahead``): the next resume from that id
drops the text the same way. (Level with a buffer whose event N is a real
one, an id that counts more is not placed: a 400, or, while a live router
stores more of it, a wait.) That regeneration is exact for greedy requests (the
replicas are deterministic); a sampled one there ends with a ``resume_gap`` error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from litestar import Response
from litestar.response import Stream

from router.continuation import continue_stream
from router.errors import ApiError, BadRequest, NotFound, ServiceUnavailable, clip, error_body
from router.ids import new_id
from router.leases import lease_chain
from router.relay import NOT_RESUMABLE, Outcome, outcome_of, shutdown_notice
from router.replay_slices import slices
from router.resume import ResumeMeta, decode_meta
from router.resume_charge import charge_resume
from router.resume_position import AHEAD, WAIT, BufferUnread, Placed, Placer, Position, ahead, mismatch, parse_last_event_id
from router.resume_tail import client_on_placeholder, done_at, error_code, finish_tail, last_event, tail_after
from router.service import RouterService
from router.sse import ChunkEncoder, is_done
from router.state import StoreUnavailable, StreamSnapshot
from router.tenants import TenantPolicy

__all__ = ["serve_resume", "handle_resume", "parse_last_event_id", "Position"]

log = logging.getLogger("fairstream.resume")

TAIL_POLL = 0.02
CATCH_UP = 2.0  # seconds to wait for a live owner's buffer to reach the client
COMMENT_EVERY = 2.0  # seconds without an event after which the resume sends an SSE comment
# That comment: one line, with no blank line after it. A blank line ends an
# event, and the openai SDKs (which keep the last id, as the SSE spec says)
# then dispatched one with empty data and failed to decode it as JSON.
WAITING = b": waiting for the stream\n"
REREAD_GRACE = 5.0  # seconds a resume tries to read its buffer again before it gives up
REREAD_INTERVAL = 0.1
# Resumes of one stream that may run at once on a router; one more ends the
# oldest. A client needs one (two while its old connection is not yet seen
# gone, which a connection dropped without a word can take minutes to be);
# each follower of a live stream reads the buffer every TAIL_POLL, and
# hundreds on one stream took a core. (Counting them against max_concurrent
# would refuse a tenant at its limit the resume of its own stream; refusing
# the newest, a client whose old connections died silently.)
MAX_READERS = 4


class _Reader:
    """One resume of a stream, running; ``superseded``: a newer one ended it;
    ``continuing``: it generates the stream (a newer one never ends it: that
    would stop the generation every other resume follows)."""

    __slots__ = ("superseded", "continuing")

    def __init__(self) -> None:
        self.superseded = self.continuing = False


def _not_found(svc: RouterService, sid: str) -> NotFound:
    causes = ["unknown", "past its retention window"]
    if svc.store.name != "memory":  # (with Redis, a restart without persistence, or a flush, empties every buffer)
        causes.append("lost when the state store restarted without its data")
    if any(s.spec.url is not None and s.spec.token_ids != "yes"  # (no buffer is kept: nothing could continue it)
           and (s.client is None or getattr(s.client, "token_ids", None) is not True) for s in svc.pool.slots):
        causes.append("served by an upstream that returns no token ids, which is never resumable")
    why = ", ".join(causes[:-1]) + ", or " + causes[-1]
    return NotFound(f"No resumable stream {clip(sid)!r} ({why}).", code="stream_not_found")


async def serve_resume(svc: RouterService, policy: TenantPolicy, sid: str | None,
                       last_event_id: str | None, chat: bool | None = None) -> Response:
    """A resume request of ``policy``'s tenant (``sid`` None: a POST with
    ``Last-Event-ID`` and no ``X-Resume-Request-Id``; ``chat``: the POST's
    endpoint, None for ``GET /v1/streams/{id}``). A refusal is counted
    and logged as a request of endpoint ``resume`` (its stream's id is in the
    message) and carries an ``x-request-id`` of its own, as any other."""
    started = time.monotonic()
    try:
        if not sid:  # a reconnect: a new generation would repeat its text
            raise BadRequest("Last-Event-ID resumes a stream: send X-Resume-Request-Id with the stream's "
                             "x-request-id as well, or GET /v1/streams/{id}.", param="X-Resume-Request-Id")
        if await done_at(svc, sid, policy.name, pos := parse_last_event_id(last_event_id)):  # (uncharged)
            return Response(None, status_code=204, headers={"x-request-id": sid})
        await charge_resume(svc, policy)  # (before the lookup: trying ids costs requests too)
        return await handle_resume(svc, policy, sid, pos, chat)
    except ApiError as e:
        request_id = new_id()
        e.headers.setdefault("x-request-id", request_id)
        Outcome(svc, policy, "resume", started, request_id).record(outcome_of(e), error=e)
        raise


async def handle_resume(svc: RouterService, policy: TenantPolicy, sid: str, pos: Position,
                        chat: bool | None = None) -> Response:
    try:
        snap = await svc.store.stream_read(sid, pos.event)
    except StoreUnavailable as e:
        raise _store_down(sid) from e
    if snap is None:
        raise _gone(svc, sid)
    meta = decode_meta(snap.meta)
    if meta.tenant != policy.name:
        raise _not_found(svc, sid)
    if chat is not None and chat != meta.chat:  # (its chunks would be of the other kind: the SDK misreads them)
        raise BadRequest(f"Stream {sid} is a {'chat ' if meta.chat else ''}completion: resume it at POST "
                         f"/v1/{'chat/' if meta.chat else ''}completions, or GET /v1/streams/{sid}.",
                         param="X-Resume-Request-Id", code="resume_wrong_endpoint")
    if snap.broken:
        raise BadRequest(_BROKEN.format(sid), code=NOT_RESUMABLE)
    placer = Placer(sid, pos, meta)
    try:  # (a full id is placed by its counts: router/resume_position.py; a read of None there is a 503)
        placed = await placer.place(lambda after: svc.store.stream_read(sid, after, False))
        if isinstance(placed, Placed):
            pos = placed.pos
            snap = await svc.store.stream_read(sid, pos.event)
    except StoreUnavailable as e:  # (no buffer found: the fallback's answer, or it expired meanwhile)
        raise (_gone(svc, sid) if isinstance(e, BufferUnread) else _store_down(sid)) from e
    if snap is None:
        raise _gone(svc, sid)
    if placed == WAIT and (snap.finished or not (snap.owner or sid in svc.resume.live)):
        raise BadRequest(mismatch(sid, pos), param="Last-Event-ID", code="resume_mismatch")  # (none stores more)
    if b"" in snap.events:  # (before its stream starts: an error event then left an EventSource retrying)
        raise BadRequest(_GAP.format(pos.event + snap.events.index(b"") + 1, sid), param="Last-Event-ID",
                         code="resume_gap")
    last = await last_event(svc, sid, snap) if pos.event >= snap.total_events and snap.finished else None
    if last is not None and f'"code":"{NOT_RESUMABLE}"'.encode() in last:
        # (the buffer's last event is that error, which the client never got:
        # its live events from there on had plain ids, the same numbers or past them)
        raise BadRequest(f"Stream {sid} cannot be resumed after event {snap.total_events - 1}: its output had no "
                         "token ids from there on; retry the request.", param="Last-Event-ID", code=NOT_RESUMABLE)
    if last is not None and not is_done(last) and b'"error"' in last:
        # (it ended with that error, which the client has: there is nothing
        # after it, and an empty 200 left an EventSource reconnecting for good)
        code = error_code(last)
        raise BadRequest(f"Stream {sid} ended with an error ({code}) at event {snap.total_events - 1}; there is "
                         "nothing after it to resume: retry the request.", param="Last-Event-ID",
                         code="stream_ended")
    if pos.event > snap.total_events and (pos.tokens is None or pos.chars is None):
        raise BadRequest(f"Last-Event-ID {pos.event} is past the stream's last stored event "
                         f"({snap.total_events}); send the full id (N-T-C) this router sent.",
                         param="Last-Event-ID", code="resume_mismatch")
    if snap.finished and (pos.event > snap.total_events or (last is not None and is_done(last))):
        # (a full id past the end is a client behind a router that died with its last events; a finished
        # stream has all of them: a wrong id. At [DONE]'s (its number alone), ``done_at``'s 204 came first)
        raise BadRequest(f"Last-Event-ID {pos.event} is past the end of this stream: its last event id is "
                         f"{snap.total_events}.", param="Last-Event-ID", code="resume_mismatch")
    return Stream(_resume(svc, policy, sid, meta, snap, pos, placed, placer), media_type="text/event-stream",
                  headers={"x-request-id": sid, "cache-control": "no-cache", "x-accel-buffering": "no"})


_GAP = ("Events from {} on of stream {} were lost with the router that produced them and cannot be replayed; "
        "retry the request.")
_BROKEN = ("Stream {} cannot be resumed: its buffer misses events written while the state store was unavailable "
           "(a resume would give a wrong text); retry the request.")


def _gone(svc: RouterService, sid: str) -> ApiError:
    """The answer to a read of ``sid`` that found no buffer."""
    if not getattr(svc.store, "healthy", True):  # (fail-open: the answer came from the local fallback)
        return _store_down(sid)
    return _not_found(svc, sid)


def _store_down(sid: str) -> ServiceUnavailable:
    return ServiceUnavailable(f"Stream {sid} cannot be resumed now: the state store is unavailable; retry shortly.",
                              code="state_store_unavailable", headers={"retry-after": "1"})


async def _resume(svc: RouterService, policy: TenantPolicy, sid: str, meta: ResumeMeta,
                  snap: StreamSnapshot, pos: Position, placed: Placed | str | None = None,
                  placer: Placer | None = None) -> AsyncIterator[bytes]:
    """The resume's events. One that continues the generation is counted and
    logged as the continuation's request (endpoint ``resume``); one that
    only replays or follows the buffer as a request of endpoint ``replay``,
    with no tokens of its own. Counted in ``fairstream_stream_resumes_total``
    here, where its line is sure to follow (a client that left before its
    response started is neither)."""
    svc.metrics.child(svc.metrics.resumes, policy.name).inc()
    outcome = Outcome(svc, policy, "replay", time.monotonic(), sid)
    readers = svc.resume.readers.setdefault(sid, [])
    if len(readers) >= MAX_READERS:
        oldest = next((r for r in readers if not r.continuing), None)  # (one continues at most: the claim's)
        if oldest is not None:
            readers.remove(oldest)
            oldest.superseded = True
    reader = _Reader()
    readers.append(reader)
    try:
        async for chunk in _replay(svc, policy, sid, meta, snap, pos, outcome, reader, placed, placer):
            yield chunk
    except BaseException as e:  # (the client left: cancelled; a store that failed: unavailable)
        outcome.record("unavailable" if isinstance(e, StoreUnavailable) else outcome_of(e), error=e)
        raise
    finally:
        if reader in readers:
            readers.remove(reader)
        if not readers and svc.resume.readers.get(sid) is readers:
            del svc.resume.readers[sid]
    outcome.record("ok")  # (once: a continuation recorded its own, and this one is then done)


async def _replay(svc: RouterService, policy: TenantPolicy, sid: str, meta: ResumeMeta,
                  snap: StreamSnapshot, pos: Position, outcome: Outcome, reader: _Reader,
                  placed: Placed | str | None = None, placer: Placer | None = None) -> AsyncIterator[bytes]:
    # (``placed``: ``placer``'s answer for ``pos``; ``AHEAD`` or ``WAIT``: placed again as the buffer grows)
    me = svc.resume.owner
    cursor = pos.event  # events the client has
    unplaced = placed if placed in (AHEAD, WAIT) else None
    placer = placer or Placer(sid, pos, meta)

    def read(after: int):  # (``placer``'s reads, tried again as the others here; None raises there)
        return _reread(svc, sid, after, tokens=False)
    placed_at = snap.total_events
    if isinstance(placed, Placed) and placed.partial:
        yield placed.partial  # (the rest of the stored event the client has part of)
    loop = asyncio.get_running_loop()
    catch_up_until = loop.time() + CATCH_UP
    sent_at = loop.time()
    # the leases of the stream's last generators before this resume (``StreamSnapshot.lease``;
    # not one of this resume's own claims, which a claim given back leaves in the buffer)
    prior: tuple[str, ...] = ()
    ours: set[str] = set()
    while True:
        if snap.lease and snap.lease not in ours:
            prior = tuple(snap.lease.split())
        if reader.superseded:
            # (its client has most likely gone: it came back on another connection)
            ended = ServiceUnavailable(f"A newer resume of stream {sid} ended this one: at most {MAX_READERS} "
                                       "run at once.", code="resume_superseded")
            outcome.record("cancelled", error=ended, streamed=True)
            yield _notice(meta, ended.message, ended.code)
            return
        if unplaced and snap.total_events != placed_at:
            placed_at = snap.total_events
            try:
                again = await placer.place(read)
            except BadRequest as e:
                outcome.record("client_error")
                yield _mismatch(meta, e.message, e.code or "resume_mismatch")
                return
            except StoreUnavailable:
                outcome.record("unavailable")
                yield _cannot_go_on(meta, sid, None)
                return
            unplaced = again if again in (AHEAD, WAIT) else None
            if not unplaced:  # (placed, or its event N came: the events after it, which were not read)
                if isinstance(again, Placed):
                    if again.partial:
                        yield again.partial
                    pos, cursor = again.pos, again.pos.event
                nxt = await _reread(svc, sid, cursor, tokens=False)
                if nxt is None or nxt.broken:
                    outcome.record("unavailable")
                    yield _cannot_go_on(meta, sid, nxt)
                    return
                snap = nxt
                continue  # (from the top: it may have been superseded meanwhile)
        if unplaced == WAIT and (snap.finished or not (sid in svc.resume.live or snap.owner)):
            outcome.record("client_error")  # (its generation ended short of the client's counts: none stores more)
            yield _mismatch(meta, mismatch(sid, pos))
            return
        for piece, count in slices(() if unplaced else snap.events):  # the stored events after ``cursor``
            if not piece:  # a placeholder for events lost with a router (the client that was ahead had them)
                outcome.record("lost")
                yield _notice(meta, _GAP.format(cursor + 1, sid), "resume_gap")
                return
            cursor += count
            yield piece
            sent_at = loop.time()
            await asyncio.sleep(0)  # (a turn of the loop for every other stream: router/replay_slices.py)
        if loop.time() - sent_at >= COMMENT_EVERY:
            # (e.g. up to CLAIM_TTL while a crashed router's claim runs out:
            # an SSE comment, which clients skip, keeps proxies and read timeouts content)
            yield WAITING
            sent_at = loop.time()
        have = snap.total_events
        if snap.finished and have < cursor:  # (ahead of it, followed while it lived: a 400 once it ended)
            outcome.record("client_error")
            yield _mismatch(meta, f"Last-Event-ID {pos.event} is past the end of stream {sid}; resume with an id "
                            "this stream's events carry.")
            return
        if snap.finished and have == cursor:
            return
        if svc.scheduler.stopping:  # this router stops: the client goes on elsewhere
            enc = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created)
            outcome.record("shutdown")
            yield shutdown_notice(svc, enc, svc.resume.resumable(sid))  # (unless it broke since the read)
            return
        behind = have < cursor  # the client has events the buffer lacks
        if behind and not (sid in svc.resume.live or snap.owner) and (
                not snap.lost or (pos.tokens is not None and pos.tokens > meta.params.max_tokens)):
            # (no router died holding it, so nothing was lost past the buffer; or more
            # tokens than the request could have: an id of another stream, or made up.
            # Taken as a client ahead, its placeholders wrecked the stream for its real client)
            outcome.record("client_error")
            yield _mismatch(meta)
            return
        # this router generates it (whatever the stored claim says: a quiet
        # stream's claim can lapse between two renewals)
        mine = sid in svc.resume.live
        live = mine or (snap.owner and snap.owner != me)
        if live and (not behind or loop.time() < catch_up_until):
            await asyncio.sleep(TAIL_POLL)  # a live router (maybe this one) generates it: follow its buffer
        elif not mine and await svc.resume.claim(sid, chain := lease_chain(lease := new_id(), prior)):
            # (never this router's own live stream, however far behind its
            # buffer: claiming it would start a second generation into it)
            try:
                fresh = await _reread(svc, sid, cursor)
            except BaseException:  # the client left: the claim goes back (else it is renewed for good)
                svc.background(svc.resume.release(sid))
                raise
            if fresh is None or fresh.broken:
                await svc.resume.release(sid)
                outcome.record("unavailable")
                yield _cannot_go_on(meta, sid, fresh)
                return
            ours.add(chain)
            if fresh.total_events > have or fresh.finished:
                await svc.resume.release(sid)  # appended meanwhile: replay first
                snap = fresh
                continue
            reader.continuing = True
            # (its lease replaces those of the stream's earlier generators, which may have died holding them)
            leases = (lease, tuple(x for x in dict.fromkeys((*prior, meta.lease)) if x))
            async for chunk in _take_over(svc, policy, sid, meta, fresh, pos, cursor, outcome, leases):
                yield chunk
            return
        else:
            await asyncio.sleep(TAIL_POLL)
        # (a take-over reads them again; an unplaced client is sent none: only those past the last read)
        nxt = await _reread(svc, sid, max(cursor, snap.total_events) if unplaced else cursor, tokens=False)
        if nxt is None or nxt.broken:  # (broken while this client followed it: what it has is right)
            outcome.record("unavailable")
            yield _cannot_go_on(meta, sid, nxt)
            return
        snap = nxt


async def _reread(svc: RouterService, sid: str, after: int, tokens: bool = True) -> StreamSnapshot | None:
    """The buffer again, mid-resume. It was there a moment ago: a read that
    fails (a Redis timeout under load; a fail-open store answers from its
    local fallback, which lacks it) is tried again for ``REREAD_GRACE``
    seconds before the resume gives up (None)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + REREAD_GRACE
    while True:
        try:
            snap = await svc.store.stream_read(sid, after, tokens)
        except StoreUnavailable:
            snap = None
        if snap is not None or loop.time() >= until:
            return snap
        await asyncio.sleep(REREAD_INTERVAL)


def _notice(meta: ResumeMeta, message: str, code: str, kind: str = "server_error",
            param: str | None = None) -> bytes:
    """An error event that ends a resume, with no id of its own: the client
    keeps the last one it has (one past the buffer would make its next
    resume a 400)."""
    enc = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created)
    return enc.notice(error_body(message, kind, param, code))


def _mismatch(meta: ResumeMeta, message: str = "Last-Event-ID does not match this stream.",
              code: str = "resume_mismatch") -> bytes:
    return _notice(meta, message, code, "invalid_request_error", "Last-Event-ID")


def _cannot_go_on(meta: ResumeMeta, sid: str, snap: StreamSnapshot | None) -> bytes:
    """The error event that ends a resume whose buffer could not be read
    again (None: resume again later) or was found broken."""
    if snap is None:
        return _notice(meta, f"Stream {sid} cannot be read now (the state store is unavailable, or the stream's "
                       "buffer expired); resume again from your Last-Event-ID.", "resume_unavailable")
    return _notice(meta, _BROKEN.format(sid), NOT_RESUMABLE)


async def _take_over(svc: RouterService, policy: TenantPolicy, sid: str, meta: ResumeMeta, snap: StreamSnapshot,
                     pos: Position, cursor: int, outcome: Outcome,
                     leases: tuple[str, tuple[str, ...]]) -> AsyncIterator[bytes]:
    enc_error = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created, event_id=cursor)
    skip_chars = had_end = 0  # (what the client has past the buffer: text, and the end's events)
    tokens, text_len = list(snap.token_ids), snap.text_len
    try:  # (its router may have died with the end of the stream half stored)
        tail = await _reread(svc, sid, tail_after(snap), False)
        if tail is None:  # (a stream whose end is unknown is not continued)
            raise StoreUnavailable(f"stream {sid}: its last events cannot be read")
        padded = client_on_placeholder(snap, tail, pos, cursor)
        end = await finish_tail(svc, sid, meta, snap, tail, pos, cursor, padded, leases[1])
    except BaseException as e:  # (the client left, or the buffer cannot be read: the claim goes back)
        svc.background(svc.resume.release(sid))
        if not isinstance(e, StoreUnavailable):
            raise
        outcome.record("unavailable")
        yield _cannot_go_on(meta, sid, None)
        return
    if end is not None:
        if not end:
            outcome.record("client_error")
        for event in end or (_mismatch(meta),):
            yield event
        return
    svc.resume.continue_at(sid, snap.total_events)  # (what this router appends follows the buffer's events)
    if ahead(snap, pos, cursor, padded):
        # The client is ahead of the buffer: regenerate what it has, silently.
        assert pos.tokens is not None and pos.chars is not None
        if meta.params.temperature > 0:
            await svc.resume.release(sid)
            outcome.record("lost")
            yield _notice(meta, "Events of this stream were lost with the router that produced them, and a sampled "
                          "(temperature > 0) generation cannot be regenerated exactly; retry the request.", "resume_gap")
            return
        skip_chars = pos.chars - text_len
        if (skip_chars < 0 or pos.tokens < len(tokens) or pos.tokens > meta.params.max_tokens
                or (pos.end == 2 and not meta.include_usage)):
            await svc.resume.release(sid)
            outcome.record("client_error")
            yield _mismatch(meta)
            return
        had_end = pos.end
        log.warning("stream %s: client is %d events, %d tokens ahead of the buffer (lost with a router, or "
                    "with a resume cut off); regenerating %d characters it already has", sid,
                    cursor - snap.total_events, pos.tokens - len(tokens), skip_chars)
    outcome.done = True  # (the continuation is the request: its own line and count)
    try:
        async with aclosing(continue_stream(svc, policy, sid, meta, tokens, text_len, cursor, skip_chars,
                                            leases, max(0, cursor - snap.total_events), snap.charged,
                                            had_end)) as chunks:
            async for chunk in _waiting_until_first(chunks):
                yield chunk
    except ApiError as e:  # (refused before any output: ``continue_stream`` gave the claim back)
        # no id of its own: the stream stays resumable from the client's last
        # one (a numbered error made that resume a 400, one past the buffer)
        yield enc_error.notice(e.body())


async def _waiting_until_first(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks``, with ``WAITING`` every ``COMMENT_EVERY`` seconds until the
    first one comes. A continuation waits for the tenant's limits and for a
    first token (up to ``queue_wait`` and ``first_token``) on a response whose
    head is sent; the comments keep proxies' read timeouts content. The first
    chunk is awaited in a task of its own (so the wait can be timed without
    cancelling it); the rest in the caller's."""
    first = asyncio.ensure_future(anext(chunks))
    try:
        while not (await asyncio.wait((first,), timeout=COMMENT_EVERY))[0]:
            yield WAITING
    except BaseException:  # the client left, or this task is cancelled
        first.cancel()
        while not first.done():  # (its cleanup runs in it: wait for it to end)
            try:
                await asyncio.wait((first,))
            except asyncio.CancelledError:
                continue  # anyio (Litestar's Stream) cancels again on every loop turn
        if not first.cancelled():
            first.exception()  # (retrieved: it ends with the cancel, or with what interrupted it)
        raise
    try:
        chunk = first.result()
    except StopAsyncIteration:
        return
    finally:
        del first  # (its failure, raised here, has this frame in its traceback: a cycle that held the request)
    yield chunk
    async for chunk in chunks:
        yield chunk
