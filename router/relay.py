"""Relaying a generation to the client as SSE events.

Each piece becomes one event (pieces that wait for a slow client are merged,
up to the tenant's ``chunk_tokens`` per event). Every event is handed to the resume writer before it is sent,
so a client that misses it can get it back with ``Last-Event-ID``. The
stream ends with ``[DONE]``, or with an explicit error event (stream lost,
timeout) and no ``[DONE]``. On client disconnect the generation is closed,
which aborts it on its replica at once; the resume buffer keeps what was
delivered so the client can continue later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from replicas.logs import SummaryLog
from replicas.protocol import FinishReason
from router.admission import Ticket
from router.deadlines import StreamTimeout
from router.errors import ApiError, GatewayTimeout, RouterShutdown, error_body
from router.generation import Generation, StreamLost
from router.pieces import Piece
from router.sse import END_FINISH, END_USAGE, ChunkEncoder, Usage
from router.tenants import TenantPolicy

__all__ = ["Outcome", "EventStream", "charged_tokens", "relay_stream", "outcome_of", "shutdown_notice", "error_fields", "log_refused",
           "NOT_RESUMABLE", "error_before_output"]

log = logging.getLogger("fairstream.relay")

# the error code that ends a resume buffer where the output lost its token ids
# (router.resume_http recognises that buffer by it)
NOT_RESUMABLE = "not_resumable"
# the longest a stream's ending waits for its ticket's settlement on a shared
# store (``EventStream.release``); then it goes out, the settlement goes on
RELEASE_WAIT = 0.25
_DETACHED = ("cancelled", "shutdown")  # results whose stream stays resumable (_settle)
request_log = SummaryLog("fairstream.request")


class Outcome:
    """Counts one request exactly once, with its tokens and its duration."""

    __slots__ = ("svc", "policy", "endpoint", "started", "done", "request_id", "counted", "client_request_id")

    def __init__(self, svc, policy: TenantPolicy, endpoint: str, started: float, request_id: str = "",
                 counted: tuple[int, int] = (0, 0), client_request_id: str = "") -> None:
        self.svc = svc
        self.policy = policy
        self.endpoint = endpoint
        self.started = started
        self.done = False
        self.request_id = request_id
        # (prompt, completion) tokens an earlier request of this stream already counted
        self.counted = counted
        # the caller's own X-Request-Id (an API gateway's trace id), logged beside ours
        self.client_request_id = client_request_id

    def record(self, outcome: str, gen: Generation | None = None, error: BaseException | None = None,
               *, streamed: bool = False) -> None:
        """Count the request in metrics and log its summary line (once); an
        ``error`` that ended it is named there (code, status, message).
        ``streamed``: the error came as the stream's last event, after the
        response's 200 (or a WebSocket's first message): its ``status`` is 200."""
        if self.done:
            return
        self.done = True
        tenant = self.policy.name
        counts = self.svc.metrics.counts(tenant, self.policy.priority)
        elapsed = time.monotonic() - self.started
        extra = _line_fields(self.request_id, tenant, self.endpoint, outcome, self.client_request_id, error)
        if streamed and error is not None:
            extra["status"] = 200
        extra["priority"] = self.policy.priority
        extra["duration_s"] = round(elapsed, 4)
        if gen is not None:
            # this request's own tokens: a resume's line does not count again
            # what the request it continues counted (sums of lines = the metric)
            prompt = max(0, gen.prompt_tokens - self.counted[0])
            completion = max(0, gen.completion_tokens - self.counted[1])
            counts.generated(self.endpoint, outcome, prompt, completion, elapsed)
            extra.update(prompt_tokens=prompt, completion_tokens=completion, replica=gen.replica,
                         failovers=gen.failovers)
            if self.counted != (0, 0):
                extra.update(stream_prompt_tokens=gen.prompt_tokens, stream_completion_tokens=gen.completion_tokens)
            if self.policy.log_content:
                job = gen.job
                extra["prompt"] = job.messages if job.messages is not None else (
                    job.prompt if job.prompt is not None else job.prompt_token_ids)
                extra["completion"] = "".join(gen.text_parts or ())
        else:
            counts.ended(self.endpoint, outcome)
        request_log.info(f"request {outcome}", extra)


def _line_fields(request_id: str, tenant: str, endpoint: str, outcome: str, client_request_id: str,
                 error: BaseException | None) -> dict[str, object]:
    """The fields every ``fairstream.request`` line has, and the error's."""
    out: dict[str, object] = {"request_id": request_id, "tenant": tenant, "endpoint": endpoint, "outcome": outcome}
    if client_request_id:
        out["client_request_id"] = client_request_id[:128]
    if error is not None:
        out.update(error_fields(error))
    return out


def error_fields(e: BaseException) -> dict[str, object]:
    """What a request log line says of the error that ended the request."""
    if isinstance(e, ApiError):
        out: dict[str, object] = {"status": e.status, "error_code": e.code or e.type, "error": e.message[:300]}
        if e.param:
            out["error_param"] = e.param
        return out
    if isinstance(e, StreamTimeout):  # (ended a stream under way: the client's event says the same)
        return {"error_code": e.code, "error": f"The stream {e}."}
    if isinstance(e, StreamLost):
        return {"error_code": "stream_lost", "error": str(e)[:300]}
    return {}


class _LogBudget:
    """At most ``per_second`` lines a second; the next line allowed says how
    many were left out (``suppressed``)."""

    __slots__ = ("per_second", "second", "used", "suppressed")

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self.second = -1
        self.used = 0
        self.suppressed = 0

    def take(self, now: float) -> int | None:
        """None: leave this line out; else how many were left out before it."""
        second = int(now)
        if second != self.second:
            self.second, self.used = second, 0
        if self.used >= self.per_second:
            self.suppressed += 1
            return None
        self.used += 1
        n, self.suppressed = self.suppressed, 0
        return n


# a flood of bad keys (credential stuffing) must not become a flood of log lines; the metric counts them all
REFUSED_LINES_PER_SECOND = 20
_refused_lines = _LogBudget(REFUSED_LINES_PER_SECOND)


def log_refused(svc, endpoint: str, request_id: str, e: ApiError, client_request_id: str = "") -> None:
    """Count and log a request refused before it had a tenant (a missing,
    unknown or admin key: 401/403): outcome ``unauthorized``, tenant ``""``.
    At most ``REFUSED_LINES_PER_SECOND`` such lines a second; the next one
    says how many were left out. Its ``duration_s`` is 0."""
    m = svc.metrics
    m.child(m.requests, "", endpoint, "unauthorized").inc()
    suppressed = _refused_lines.take(time.monotonic())
    if suppressed is None:
        return
    extra = _line_fields(request_id, "", endpoint, "unauthorized", client_request_id, e)
    # (every caller looks at the key first, before reading a body and with no
    # await before it: the router spent no measurable time on the request)
    extra["duration_s"] = 0.0
    if suppressed:
        extra["suppressed"] = suppressed
    request_log.info("request unauthorized", extra)


def shutdown_error(svc, resumable: bool) -> RouterShutdown:
    """What a stream this router ends because it stops is told: where
    routers share their state (Redis), another router continues it. (Worded
    for SSE and WebSocket alike: a socket's reads ``last_event_id``,
    router/websocket_stream.py ``socket_words``.)"""
    if resumable and svc.store.name != "memory":
        return RouterShutdown("The router is shutting down; reconnect and resume from your Last-Event-ID to "
                              "continue the stream, or retry the request.")
    return RouterShutdown()


def shutdown_notice(svc, enc: ChunkEncoder, resumable: bool) -> bytes:
    """The error event of a stream this router ends because it stops. It
    takes no event number, so a client resumes from the last numbered one."""
    return enc.notice(shutdown_error(svc, resumable).body())


def outcome_of(e: BaseException) -> str:
    """The ``outcome`` label (metrics, request log) of a request that ended with ``e``."""
    if isinstance(e, StreamTimeout):
        return f"timeout_{e.which}"
    if isinstance(e, RouterShutdown):
        return "shutdown"
    if isinstance(e, ApiError):
        if e.status == 429:
            return "rate_limited"
        if e.status in (401, 403):  # (a tenant a reload removed while its request waited)
            return "unauthorized"
        return "client_error" if e.status < 500 else "unavailable"
    if isinstance(e, StreamLost):
        return "lost"
    if isinstance(e, (asyncio.CancelledError, GeneratorExit, ConnectionError)):
        return "cancelled"  # the client left (its request was cancelled, or its connection broke)
    return "error"  # a bug: the client got a 500


def charged_tokens(gen: Generation, counted: tuple[int, int]) -> int:
    """The tokens a request of ``gen``'s stream is charged: the stream's, less
    those an earlier request of it was charged for (``Outcome.counted``)."""
    return max(0, gen.prompt_tokens + gen.completion_tokens - sum(counted))


def error_before_output(metrics, tenant: str, e: BaseException, headers: dict[str, str]) -> BaseException:
    """What the client is told of ``e``, which ended a request before any of
    its output was sent (the response not started): a tenant time limit is a
    504 (counted), a generation lost before its first token a 500
    ``stream_lost``, an ``ApiError`` itself; each carries ``headers`` unless
    it has its own. Anything else (a cancel) is ``e``."""
    if isinstance(e, StreamTimeout):
        metrics.timed_out(tenant, e.which)
        return GatewayTimeout(f"The request {e}.", code=e.code, headers=dict(headers))
    if isinstance(e, StreamLost):
        return ApiError(f"The generation failed before its first token: {e}", code="stream_lost",
                        headers=dict(headers))
    if isinstance(e, ApiError):
        for k, v in headers.items():
            e.headers.setdefault(k, v)
    return e


class EventStream:
    """The per-event work of one relayed stream, shared by the pull relay
    (``relay_stream``) and the push relay (``router.push``): TTFT and
    inter-token metrics, text a resume skips, the event's encoding (once)
    and its copy in the resume buffer; then the stream's tail, its error
    event, and the settlement (outcome, resume buffer, admission ticket).

    ``sid`` names the resume buffer (None: not resumable, its output has no token ids);
    SSE event ids then carry the stream position. ``skip_chars`` drops that
    much text first: a resume regenerating text the client already has.
    ``had_end``: that client also has the stream's finish event (1), and
    its usage event (2) (their ids said so: router/sse.py); a finish left
    with no text after the skip is then not sent again, nor that usage
    event (the buffer holds placeholders for them already). The stream's
    position (``tokens``, ``chars``: what the client has) is its own, not
    the generation's, which may be ahead of what was sent.
    """

    __slots__ = ("svc", "gen", "enc", "include_usage", "usage_each", "policy", "ticket", "outcome", "sid", "writer",
                 "counts", "itl", "last", "tokens", "chars", "sent_ids", "skip_chars", "had_end", "result", "final",
                 "error")

    def __init__(self, svc, gen: Generation, enc: ChunkEncoder, usage: tuple[bool, bool], policy: TenantPolicy,
                 ticket: Ticket | None, outcome: Outcome, sid: str | None, *, skip_chars: int = 0,
                 had_end: int = 0) -> None:
        """``usage``: (a usage event at the end, the usage so far in every
        event too), as ``openai_types.usage_options`` reads them."""
        self.svc = svc
        self.gen = gen
        self.enc = enc
        self.include_usage, self.usage_each = usage
        self.policy = policy
        self.ticket = ticket
        self.outcome = outcome
        self.sid = sid
        self.writer = svc.resume if sid is not None else _NoBuffer()
        self.counts = svc.metrics.counts(policy.name, policy.priority)
        self.itl = self.counts.streaming()  # (the time to first token counted in ``counts``)
        self.last: float | None = None
        self.tokens, self.chars = gen.base  # where the generation started
        self.sent_ids = self.tokens  # token ids handed to the resume buffer
        self.skip_chars = skip_chars
        self.had_end = had_end
        self.result = "cancelled"
        self.final: bytes | None = None
        self.error: BaseException | None = None

    def event(self, text: str, n: int, finish: FinishReason) -> bytes | None:
        """The event for one piece (None: nothing to send)."""
        if self.sid is not None and self.gen.uncounted:
            self._unbuffer()  # (before this piece's text counts: the buffer does not get it)
        if n:
            now = time.monotonic()
            if self.last is None:
                self.counts.first_token(now - self.outcome.started)
            else:
                self.itl.observe((now - self.last) / n)
            self.last = now
            self.tokens += n
        self.chars += len(text)
        if self.skip_chars and text:
            cut = min(self.skip_chars, len(text))
            text = text[cut:]
            self.skip_chars -= cut
        if not text and (finish == FinishReason.NONE or self.had_end):
            if finish != FinishReason.NONE:  # the client has this finish: its tokens only, to the buffer
                self.writer.append(self.sid, None, self.gen.completion_ids[self.sent_ids:self.tokens], self.chars)
                self.sent_ids = self.tokens
            return None
        pos = self._pos() if finish == FinishReason.NONE else self._pos(END_FINISH)
        if self.usage_each:
            prompt = self.gen.prompt_tokens
            event = self.enc.delta(text, finish, pos, Usage(prompt, self.tokens, prompt + self.tokens),
                                   self.gen.stop_reason)
        else:
            event = self.enc.delta(text, finish, pos, stop_reason=self.gen.stop_reason)
        self.writer.append(self.sid, event, self.gen.completion_ids[self.sent_ids:self.tokens], self.chars)
        self.sent_ids = self.tokens
        return event

    def _unbuffer(self) -> None:
        """Output without token ids: nothing could continue this stream
        exactly, so its resume buffer ends here, finished with an error event
        (a resume gets what it missed up to this point, then that error)."""
        sid, self.sid, writer, self.writer = self.sid, None, self.writer, _NoBuffer()
        assert sid is not None
        log.warning("stream %s: output without token ids, so it is no longer resumable", sid)
        final = self.enc.error(error_body(
            "The stream's output has no token ids from here on, so it cannot be resumed; retry the request.",
            "server_error", None, NOT_RESUMABLE))
        self.svc.background(writer.finish(sid, final, self.chars))

    def _pos(self, end: bytes = b"") -> bytes:
        """The stream position appended to a resumable event's id (``-T-C``,
        then ``end``: what of the stream's end the event carries)."""
        return b"-%d-%d%s" % (self.tokens, self.chars, end) if self.sid is not None else b""

    def tail(self) -> list[bytes]:
        """After the last piece: the usage event (if asked) and ``[DONE]``.
        On this process's own store the ticket is settled here, before they
        go out (``Admission.finish_now``; a shared one: ``release``)."""
        self._finish_now()
        out = []
        gen = self.gen
        if self.include_usage and self.had_end < 2:
            event = self.enc.usage(gen.prompt_tokens, gen.completion_tokens, self._pos(END_USAGE))
            self.writer.append(self.sid, event, [], self.chars)
            out.append(event)
        self.final = self.enc.done()
        self.result = "ok"
        out.append(self.final)
        return out

    def failed(self, e: BaseException) -> bytes:
        """The error event that ends a stream that cannot go on (the ticket
        settled first, as in ``tail``)."""
        self._finish_now()
        self.result = outcome_of(e) if isinstance(e, (ApiError, StreamTimeout)) else "lost"
        # (kept for the log line, without its traceback: the relay's frames
        # in it hold this stream, a cycle that would keep the request, its
        # prompt with it, until a cycle collection)
        self.error = e.with_traceback(None)
        if isinstance(e, RouterShutdown):
            # as if the client had left: the resume buffer stays open (the
            # log line names what the client was told: a resume only where
            # one can continue it, not for a buffer found broken)
            self.error = shutdown_error(self.svc, self.sid is not None and self.writer.resumable(self.sid))
            self.final = self.enc.notice(self.error.body())
            return self.final
        if isinstance(e, StreamTimeout):
            self.svc.metrics.timed_out(self.policy.name, e.which)
            body = error_body(f"The stream {e}.", "timeout", None, e.code)
        elif isinstance(e, ApiError):
            body = e.body()
        else:
            log.warning("stream %s lost after %d tokens: %s", self.outcome.request_id, self.gen.completion_tokens, e)
            body = error_body(f"The stream was interrupted and could not be resumed: {e}",
                              "server_error", None, "stream_lost")
        self.final = self.enc.error(body)
        return self.final

    def _finish_now(self) -> None:
        if self.ticket is not None:
            self.svc.admission.finish_now(self.ticket, self._used())

    @property
    def release_first(self) -> bool:
        """Whether the ticket is to be settled before the stream's last bytes
        go out (``release``). On a shared store (Redis) settling is a round
        trip or two, and a client whose next request follows ``[DONE]`` at
        once (the openai SDK, a tenant with ``max_concurrent: 1`` and
        ``on_limit: reject``) would find its lease still held: a 429. An
        in-process store is settled at once as the ending is encoded
        (``tail``, ``failed``), so the last bytes need not wait for it."""
        ticket = self.ticket
        if ticket is None or ticket.done:
            return False
        store = self.svc.admission.store
        return store.shared and store.healthy

    async def release(self) -> None:
        """Settle the ticket now (its usage is final: the last piece is in);
        ``settle`` then leaves it. Call it after encoding the stream's ending
        (``tail`` or ``failed``: a client that leaves meanwhile then still has
        a finished stream) and before sending it. The settlement runs in the
        background (a client leaving does not cut it short) and is waited
        for at most ``RELEASE_WAIT``: a store that hangs does not hold every
        stream's end for its timeout."""
        if self.ticket is not None:
            task = self.svc.background(self.svc.admission.finish(self.ticket, self._used()))
            await asyncio.wait((task,), timeout=RELEASE_WAIT)

    def _used(self) -> int:
        return charged_tokens(self.gen, self.outcome.counted)

    def settle(self) -> None:
        """Count the request once and settle its buffer and ticket (at once
        on an in-process store, else in the background: on disconnect this
        runs where every await is cancelled).
        It counts every token its generation had, those past its events too
        (behind a slow client's paused transport, or arrived as it left): a
        client that never resumes pays for what the replicas made. A stream
        left resumable keeps that count with its buffer, so that a resume's
        continuation, which generates those tokens again, does not count
        them again (``Outcome.counted``, router/continuation.py)."""
        gen = self.gen
        if self.tokens > self.sent_ids:
            self.writer.append(self.sid, None, gen.completion_ids[self.sent_ids:self.tokens], self.chars)
            self.sent_ids = self.tokens
        self.outcome.record(self.result, gen, self.error, streamed=True)
        charged = max(self.outcome.counted[1], gen.completion_tokens)  # (the stream's, as counted so far)
        ticket, writer = self.ticket, self.writer
        if writer.ends_now and (ticket is None or ticket.done or self.svc.admission.in_process):
            # (an in-process store: _settle's work at once, without a task)
            writer.end_now(self.sid or "", self.final, self.chars, self.result in _DETACHED, charged)
            if ticket is not None and not ticket.done:
                self.svc.admission.finish_now(ticket, self._used())
            return
        self.svc.background(_settle(self.svc, writer, self.sid or "", self.result, self.final, self.chars,
                                    ticket, self._used(), charged))


async def relay_stream(es: EventStream, pieces: AsyncIterator[Piece], first: Piece | None) -> AsyncIterator[bytes]:
    """Event bytes of ``es.gen``'s pieces, starting with ``first`` (None:
    pull it first). The stream ends with ``[DONE]`` or an error event."""
    try:
        async with aclosing(pieces):  # type: ignore[type-var]
            piece: Piece | None = first if first is not None else await pieces.__anext__()
            while piece is not None:
                event = es.event(*piece)
                if event is not None:
                    yield event
                if piece[2] != FinishReason.NONE:
                    break
                piece = await pieces.__anext__()
            release = es.release_first
            tail = es.tail()  # (the stream is done from here on, whatever happens to the client)
            if release:
                await es.release()
            for event in tail:
                yield event
    except (StreamLost, StreamTimeout, ApiError) as e:
        release = es.release_first
        event = es.failed(e)
        if release:
            await es.release()
        yield event
    finally:
        es.settle()


async def _settle(svc, writer, sid: str, result: str, final: bytes | None, chars: int,
                  ticket: Ticket | None, used: int, charged: int) -> None:
    try:
        if result in _DETACHED:
            # The client left (or this router stops): keep what was delivered so
            # a resume can continue it, and what its tokens were charged.
            await writer.detach(sid, chars, charged)
        else:
            await writer.finish(sid, final, chars)
    finally:  # (a writer that fails unexpectedly, too: else the lease keeper renewed its lease for good)
        if ticket is not None:
            await svc.admission.finish(ticket, used)  # (once: a no-op after ``EventStream.release``)


class _NoBuffer:
    """Stand-in resume writer for streams that are not resumable."""

    ends_now = True

    def end_now(self, sid, final, text_len, detach, charged=0) -> None:
        pass

    def append(self, sid, event, token_ids, text_len) -> None:
        pass

    def appender(self, sid):
        return None

    async def detach(self, sid, text_len, charged=0) -> None:
        pass

    async def finish(self, sid, final, text_len) -> None:
        pass
