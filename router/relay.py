"""Relaying a generation to the client as SSE events.

Each piece becomes one event (the replica client's single-slot collector
merges tokens while the client is slow, up to the tenant's ``chunk_tokens``
per event). Every event is handed to the resume writer before it is sent,
so a client that misses it can get it back with ``Last-Event-ID``. The
stream ends with ``[DONE]``, or with an explicit error event (stream lost,
timeout) and no ``[DONE]``. On client disconnect the generation is closed,
which aborts it on its replica at once; the resume buffer keeps what was
delivered so the client can continue later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from replicas.protocol import FinishReason
from router.admission import Ticket
from router.errors import error_body
from router.generation import Generation, Piece, StreamLost, StreamTimeout
from router.sse import ChunkEncoder
from router.tenants import TenantPolicy

__all__ = ["Outcome", "relay_stream"]

log = logging.getLogger("fairstream.relay")
request_log = logging.getLogger("fairstream.request")


class Outcome:
    """Counts one request exactly once, with its tokens and its duration."""

    __slots__ = ("svc", "policy", "endpoint", "started", "done", "request_id", "counted")

    def __init__(self, svc, policy: TenantPolicy, endpoint: str, started: float, request_id: str = "",
                 counted: tuple[int, int] = (0, 0)) -> None:
        self.svc = svc
        self.policy = policy
        self.endpoint = endpoint
        self.started = started
        self.done = False
        self.request_id = request_id
        # (prompt, completion) tokens an earlier request of this stream already counted
        self.counted = counted

    def record(self, outcome: str, gen: Generation | None = None) -> None:
        """Count the request in metrics and log its summary line (once)."""
        if self.done:
            return
        self.done = True
        m = self.svc.metrics
        tenant = self.policy.name
        m.requests.labels(tenant, self.endpoint, outcome).inc()
        elapsed = time.monotonic() - self.started
        extra: dict[str, object] = {
            "request_id": self.request_id,
            "tenant": tenant,
            "priority": self.policy.priority,
            "endpoint": self.endpoint,
            "outcome": outcome,
            "duration_s": round(elapsed, 4),
        }
        if gen is not None:
            m.tokens.labels(tenant, "prompt").inc(max(0, gen.prompt_tokens - self.counted[0]))
            m.tokens.labels(tenant, "completion").inc(max(0, gen.completion_tokens - self.counted[1]))
            m.e2e.labels(tenant, self.policy.priority).observe(elapsed)
            extra.update(
                prompt_tokens=gen.prompt_tokens,
                completion_tokens=gen.completion_tokens,
                replica=gen.replica,
                failovers=gen.failovers,
            )
            if self.policy.log_content:
                job = gen.job
                extra["prompt"] = job.messages if job.messages is not None else (
                    job.prompt if job.prompt is not None else job.prompt_token_ids)
                extra["completion"] = "".join(gen.text_parts or ())
        request_log.info("request %s", outcome, extra=extra)


async def relay_stream(
    svc,
    gen: Generation,
    pieces: AsyncIterator[Piece],
    first: Piece | None,
    enc: ChunkEncoder,
    include_usage: bool,
    policy: TenantPolicy,
    ticket: Ticket | None,
    outcome: Outcome,
    sid: str | None,
    skip_chars: int = 0,
) -> AsyncIterator[bytes]:
    """Event bytes of ``gen`` starting with ``first`` (None: pull it first).

    ``sid`` names the resume buffer (None: not resumable, e.g. WebSocket);
    SSE event ids then carry the stream position. ``skip_chars`` drops that
    much text first: a resume regenerating text the client already has.
    """
    m = svc.metrics
    writer = svc.resume if sid is not None else _NoBuffer()
    ttft = m.ttft.labels(policy.name, policy.priority)
    itl = m.itl.labels(policy.name, policy.priority)
    result = "cancelled"
    last = None
    sent_ids = len(gen.completion_ids) - (first[1] if first is not None else 0)
    final: bytes | None = None
    try:
        async with aclosing(pieces):  # type: ignore[type-var]
            piece: Piece | None = first if first is not None else await pieces.__anext__()
            while piece is not None:
                text, n, finish = piece
                if n:
                    now = time.monotonic()
                    if last is None:
                        ttft.observe(now - outcome.started)
                    else:
                        itl.observe((now - last) / n)
                    last = now
                if skip_chars and text:
                    cut = min(skip_chars, len(text))
                    text = text[cut:]
                    skip_chars -= cut
                if text or finish != FinishReason.NONE:
                    ids = gen.completion_ids
                    pos = b"-%d-%d" % (len(ids), gen.text_len) if sid is not None else b""
                    event = enc.delta(text, finish, pos)
                    writer.append(sid, event, ids[sent_ids:], gen.text_len)
                    sent_ids = len(ids)
                    yield event
                if finish != FinishReason.NONE:
                    break
                piece = await pieces.__anext__()
            if include_usage:
                pos = b"-%d-%d" % (gen.completion_tokens, gen.text_len) if sid is not None else b""
                event = enc.usage(gen.prompt_tokens, gen.completion_tokens, pos)
                writer.append(sid, event, [], gen.text_len)
                yield event
            final = enc.done()
            result = "ok"
            yield final
    except StreamLost as e:
        result = "lost"
        log.warning("stream %s lost after %d tokens: %s", sid, gen.completion_tokens, e)
        final = enc.error(error_body(f"The stream was interrupted and could not be resumed: {e}",
                                     "server_error", None, "stream_lost"))
        yield final
    except StreamTimeout as e:
        result = f"timeout_{e.which}"
        m.timeouts.labels(policy.name, e.which).inc()
        final = enc.error(error_body(f"The stream hit the tenant's {e}.", "timeout", None, f"{e.which}_timeout"))
        yield final
    finally:
        ids = gen.completion_ids
        if len(ids) > sent_ids:
            writer.append(sid, None, ids[sent_ids:], gen.text_len)
        outcome.record(result, gen)
        # On disconnect this code runs inside a cancelled scope where every
        # await is cancelled again, so the store work runs as a task the
        # service owns (and awaits on shutdown).
        # tokens an earlier request of this stream was already charged for
        used = gen.prompt_tokens + gen.completion_tokens - sum(outcome.counted)
        svc.background(_settle(svc, writer, sid or "", result, final, gen, ticket, used))


async def _settle(svc, writer, sid: str, result: str, final: bytes | None, gen: Generation,
                  ticket: Ticket | None, used: int) -> None:
    if result == "cancelled":
        # The client left: keep what was delivered so a resume can continue it.
        await writer.detach(sid, gen.text_len)
    else:
        await writer.finish(sid, final, gen.text_len)
    if ticket is not None:
        await svc.admission.finish(ticket, max(0, used))


class _NoBuffer:
    """Stand-in resume writer for streams that are not resumable."""

    def append(self, sid, event, token_ids, text_len) -> None:
        pass

    async def detach(self, sid, text_len) -> None:
        pass

    async def finish(self, sid, final, text_len) -> None:
        pass
