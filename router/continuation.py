"""A resumed stream's continuation: admitted again, generated from the
tokens its buffer holds, relayed after them, and counted once.

The continuation regenerates what the buffer lacks: the tokens past the
events its client had. Those a request of the stream already counted (a
request whose client left counts every token its generation had, some
that never went out in an event: behind a slow client's paused transport,
or arriving as it left) are not counted again: the count starts from what
was charged, kept with the buffer as its router let go of the stream
(``StreamSnapshot.charged``), or from the buffer's tokens where more (a
router that died charged nothing for the tokens it stored). So a stream
that is never resumed pays for all its replicas made, and a resumed one
for each of its tokens once. A continuation that ends short of the count
charged counts nothing, and leaves the count as it was for the next.

Cost: an integer in the buffer's record, written with the release of its
claim (no extra round trip), nothing per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from router.deadlines import Deadlines
from router.errors import ApiError
from router.generation import Generation
from router.job import Job
from router.logs import request_id_var
from router.relay import EventStream, Outcome, charged_tokens, error_before_output, outcome_of, relay_stream
from router.resume import ResumeMeta
from router.service import RouterService
from router.sse import ChunkEncoder
from router.tenants import TenantPolicy

__all__ = ["continue_stream", "counted"]

log = logging.getLogger("fairstream.resume")


def counted(meta: ResumeMeta, tokens: list[int], charged: int) -> tuple[int, int]:
    """The (prompt, completion) tokens of the stream that its earlier
    requests counted, which a continuation from ``tokens`` does not count
    again (``Outcome.counted``): the prompt, and the completion tokens
    charged (``charged``) or delivered, whichever are more."""
    return len(meta.prompt_token_ids), max(len(tokens), charged)


async def continue_stream(svc: RouterService, policy: TenantPolicy, sid: str, meta: ResumeMeta, tokens: list[int],
                          text_len: int, cursor: int, skip_chars: int, leases: tuple[str, tuple[str, ...]], pad: int,
                          charged: int, had_end: int = 0) -> AsyncIterator[bytes]:
    """The continuation of a claimed stream, from the buffer's ``tokens``.
    ``leases``: its admission lease's id (named in the claim) and the leases
    it replaces; ``pad``: the events the client has that the buffer lacks
    (lost with a router), for which it gets placeholders once the
    continuation runs; ``charged``: the completion tokens the stream's
    earlier requests counted and charged (``StreamSnapshot.charged``);
    ``had_end``: of those events, the stream's finish (1), and its usage
    event (2), which it does not send again (``EventStream``)."""
    started = time.monotonic()
    # its log lines (its failovers', which the Generation names from this)
    # carry the stream's id: the resume's x-request-id and its request line's id
    request_id_var.set(sid)
    lim = policy.limits
    job = Job(meta.model, meta.params, prompt_token_ids=meta.prompt_token_ids)
    gen = Generation(
        svc.pool, job, svc.metrics, svc.config.max_failovers,
        Deadlines(lim.first_token, lim.stall, lim.total, start=started),
        scheduler=svc.scheduler, policy=policy, rank=policy.rank, failover_wait=svc.config.failover_wait,
    )
    gen.completion_ids, gen.text_len = tokens, text_len
    enc = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created, event_id=cursor,
                       role_sent=cursor > 0)  # (a client has the role chunk iff it has event 1)
    outcome = Outcome(svc, policy, "resume", started, sid, counted=counted(meta, tokens, charged))
    ticket = pieces = None
    try:  # (it takes over the reservations its dead generators left unsettled: AdmitRequest.hold)
        ticket = await svc.admission.admit(
            policy, max(1, meta.params.max_tokens - len(tokens)), count_request=False, lease_id=leases[0],
            replaces=leases[1], deadlines=gen.deadlines, delivered=bool(tokens), hold=svc.resume.retention,
            base=sum(outcome.counted))
        log.info("resuming stream %s at %d tokens on this router", sid, len(tokens))
        pieces = gen.stream(resumes=True)  # (no replica ready: it waits for one, as a failover does)
        first = await pieces.__anext__()
    except BaseException as e:
        # Refused (a limit, no replica for now, a time limit) or the client
        # left: nothing was relayed, so the buffer stays as it was and the
        # stream stays resumable.
        if pieces is not None:
            await pieces.aclose()
        if ticket is not None:
            await svc.admission.finish(ticket, charged_tokens(gen, outcome.counted))
        told = error_before_output(svc.metrics, policy.name, e, {})
        # (the resume's 200 is out: an error reaches the client as an event)
        outcome.record(outcome_of(e), gen, told, streamed=isinstance(told, ApiError))
        svc.background(svc.resume.release(sid))
        try:
            if told is e:
                raise
            raise told from e
        finally:
            del told  # (a cycle otherwise: see completions.start_generation)
    if pad:
        # keep the buffer's numbering aligned with the client's event ids, now
        # that this continuation appends after them (padded before a refusal,
        # the next continuation took the placeholders for the events the client
        # had, and sent their text again)
        svc.resume.pad(sid, pad)
    es = EventStream(svc, gen, enc, (meta.include_usage, meta.continuous_usage), policy, ticket, outcome, sid,
                     skip_chars=skip_chars, had_end=had_end)
    async for chunk in relay_stream(es, pieces, first):
        yield chunk
