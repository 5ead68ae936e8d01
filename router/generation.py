"""One generation, run on the pool, surviving replica deaths.

``Generation`` keeps exactly what it needs to resume a stream elsewhere: the
prompt token ids (returned by the replica with the first delta), the
completion token ids delivered so far, the characters of text delivered, and
the sampling parameters. When its replica dies it asks the pool for another
and sends ``prompt + delivered`` with the remaining ``max_tokens``; the new
replica's output processor picks up held-back bytes and stop-string state, so
the spliced text equals the detokenization of all tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING

from replicas.client import ReplicaBusy, ReplicaDead, ReplicaStalled
from replicas.pool import CONTINUES, LoadHandle, NoReplica, ReplicaPool
from replicas.protocol import Delta, FinishReason
from router.deadlines import Deadlines, Stalled, Watchdog
from router.errors import BadRequest, ReplicaUnavailable, RouterShutdown
from router.failover_wait import StreamLost, WaitsForReplica
from router.job import Job
from router.logs import request_id_var
from router.metrics import Metrics
from router.pieces import Piece, PieceQueue

if TYPE_CHECKING:
    from router.scheduler import Scheduler
    from router.tenants import TenantPolicy

log = logging.getLogger("fairstream.generation")

# vLLM's (and OpenAI's) words for a prompt, or prompt and max_tokens, over the model's context
CONTEXT_EXCEEDED = "maximum context length is"

__all__ = ["Generation", "StreamLost"]


class Generation(WaitsForReplica):
    """One generation, driven by its replica's output (push).

    ``start`` waits for the tenant's turn and dispatches; from then on the
    replica connection's reader calls ``on_delta`` for each delta (no task
    wakes up per token), which does the token accounting and hands the
    piece to the consumer's ``sink`` (``piece(text, n, finish)``, the last
    one with a finish, or ``fail(exc)``). Replica death and stalls fail over
    inside ``on_fail`` (``pool.choose`` is synchronous), so a failover costs
    no task switch either; one that finds no replica ready waits for one
    with room (``WaitsForReplica``). ``close`` stops it (abort on the replica).

    Failures the sink gets: ``BadRequest`` (the replica rejected the prompt),
    ``StreamLost`` (no replica can continue what was produced),
    ``ReplicaUnavailable`` (its replicas failed before it produced anything),
    ``StreamTimeout``; ``start`` raises ``ReplicaUnavailable`` when no
    replica can take it at all.
    """

    __slots__ = ("pool", "scheduler", "policy", "rank", "deadlines", "job", "metrics", "max_failovers",
                 "prompt_token_ids", "completion_ids", "text_len", "failovers", "text_parts", "finish", "stop_reason",
                 "replica", "sink", "ended", "_base", "_col", "_client", "_handle", "_dog", "_died_at", "_exclude",
                 "_dispatched", "_charged_prompt", "uncounted", "prompt_count", "_attached_at", "prompt_taken",
                 "_free_retries", "_charged", "request_id", "_straight_back")

    def __init__(self, pool: ReplicaPool, job: Job, metrics: Metrics, max_failovers: int,
                 deadlines: Deadlines | None = None, scheduler: Scheduler | None = None,
                 policy: TenantPolicy | None = None, rank: int = 0, failover_wait: float = 0.0) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.policy = policy
        self.rank = rank
        self.deadlines = deadlines or Deadlines()
        self.job = job
        self.metrics = metrics
        self.max_failovers = max_failovers
        self.prompt_token_ids: list[int] | None = job.prompt_token_ids
        self.completion_ids: list[int] = []
        # output tokens without their ids (an upstream that returns none)
        self.uncounted = 0
        self.prompt_count = 0  # the prompt's tokens, where their ids are not known
        # a replica took the prompt (a delta other than its refusal came): only
        # then is it used, and settled (``used_tokens``); a token-id prompt's
        # count is known before, and was charged for a refused one too
        self.prompt_taken = False
        self.text_len = 0
        self.failovers = 0
        self.text_parts: list[str] | None = [] if policy is not None and policy.log_content else None
        self.finish, self.stop_reason = FinishReason.NONE, None  # (vLLM's stop_reason of the finish)
        self.replica: str | None = None
        self.sink = None
        self.ended = False
        self._base: tuple[int, int] | None = None  # (tokens, characters) delivered before ``start``
        self._col = None
        self._client = None
        self._handle: LoadHandle | None = None
        self._dog: Watchdog | None = None
        self._died_at: float | None = None
        self._exclude: dict[str, None] | None = None  # replicas that failed this generation, the latest last
        self._dispatched = 0.0
        self._attached_at = 0  # completion tokens the stream had when it went to its replica
        self._free_retries = len(pool.slots)  # moves off a replica that gave no token, not charged
        # the stream went at once back to the replica that had just failed it (the only one ready): if
        # that one is still dead, it is the same death, not another failover
        self._straight_back = False
        self._charged = 0  # failovers charged to max_failovers
        self._charged_prompt = False
        # seconds a failover may wait for a replica to become ready when none is (0: none)
        self.failover_wait = failover_wait
        self._waiting: asyncio.TimerHandle | None = None  # waiting for one: its deadline
        self._full: Collection[str] = ()  # (while it waits: ready replicas it found full, failover_wait.py)
        self._until: tuple[float, str] = (0.0, "")  # (while it waits: when the wait ends, and which limit ends it)
        self._on_the_way = False  # (going to the replica it waited for)
        self._ready_wait: asyncio.Future[None] | None = None  # (a continuation waiting for a ready replica)
        # (its failovers are logged from a replica reader, outside the request's context)
        self.request_id = request_id_var.get()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else self.prompt_count

    @property
    def used_tokens(self) -> int:
        """What the request used, to settle its admission with: its output,
        and its prompt once a replica took it (not a prompt it refused)."""
        return (self.prompt_tokens if self.prompt_taken else 0) + self.completion_tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_ids) + self.uncounted

    @property
    def needs(self) -> int:
        """What its replica must take: the request's ``Feature`` bits, and
        once it has tokens, continuing from them (``CONTINUES``)."""
        return self.job.needs | CONTINUES if self.completion_ids else self.job.needs

    @property
    def produced(self) -> bool:
        """Any output so far (tokens or text, from any replica)."""
        return bool(self.completion_ids or self.uncounted or self.text_len)

    @property
    def exact(self) -> bool:
        """Every token so far has its id (with the prompt's): what resuming
        and token-exact failover need."""
        return self.prompt_token_ids is not None and not self.uncounted

    @property
    def base(self) -> tuple[int, int]:
        """(tokens, characters) the generation had when it started (a
        resume's), or has now if it has not started yet."""
        return self._base if self._base is not None else (len(self.completion_ids), self.text_len)

    @property
    def chunk_tokens(self) -> int:
        return self.policy.chunk_tokens if self.policy is not None else 0

    async def stream(self, resumes: bool = False) -> AsyncIterator[Piece]:
        """``start`` and pull: yield pieces until the generation finishes
        (the failures as exceptions). Closing the iterator early aborts the
        request on its replica."""
        q = PieceQueue(self.chunk_tokens)
        try:
            await self.start(q, resumes)
            while True:
                piece = await q.get()
                yield piece
                if piece[2] != FinishReason.NONE:
                    return
        finally:
            self.close()

    async def start(self, sink, resumes: bool = False) -> None:
        """Wait for the tenant's turn in its queue (fair share, caps), then
        dispatch; output goes to ``sink``. ``resumes``: a resume's
        continuation, whose client is mid-stream: with no replica ready
        (all restarting) it waits for one as a failover does (``_until_ready``)."""
        self.sink = sink
        self._base = (len(self.completion_ids), self.text_len)
        wait = None  # (the end of its wait for a ready replica, once it began one)
        off_line = 0.0  # (seconds it waited for a replica: not time in the tenant's line, queue_wait)
        while True:
            try:
                handle = await self._dispatch(off_line)
                break
            except ReplicaUnavailable as e:
                if not (resumes and isinstance(e.__cause__, NoReplica)):
                    raise
                began = time.monotonic()
                wait = await self._until_ready(e, wait)
                off_line += time.monotonic() - began
        if self.ended:  # closed while it waited
            handle.release()
            return
        self._attach(handle)

    async def _dispatch(self, off_line: float = 0.0) -> LoadHandle:
        """A replica from the tenant's line (or the pool's, with no scheduler).
        ``off_line``: seconds since the start spent waiting for a replica to
        come back (a continuation's), which do not count against ``queue_wait``."""
        job = self.job
        remaining = job.params.max_tokens - len(self.completion_ids)
        if self.scheduler is not None and self.policy is not None:
            waited = time.monotonic() - self.deadlines.start - off_line  # e.g. for a rate limit
            return await self.scheduler.acquire(self.policy, self.rank, job.model, remaining, waited,
                                                job.affinity_key(), self.needs, self._wait_limit)
        try:
            return self.pool.choose(job.model, remaining, self._exclude, self.needs)
        except NoReplica as e:
            raise self._no_replica(str(e), ReplicaUnavailable(str(e))) from e

    def _wait_limit(self):
        """The tenant's first-token (or total) limit ends a wait for a replica
        as it would the run: "its waits for limits and a replica included"."""
        return self.deadlines.wait_limit(bool(self.completion_ids))

    def close(self) -> None:
        """Stop: abort on the replica if it is still running there."""
        self.ended = True
        self._stop_waiting()
        self._detach(finished=False)

    def stop(self, exc: BaseException) -> None:
        """End it now with ``exc`` for its consumer (the router is stopping);
        abort on the replica."""
        if not self.ended:
            self._stop_waiting()
            self._detach(finished=False)
            self._end(exc)

    def _attach(self, handle: LoadHandle) -> None:
        sched = self.scheduler
        if sched is not None and sched.stopping:  # (a failover, or a dispatch that raced the stop)
            handle.release()
            self._end(RouterShutdown())
            return
        slot = handle.slot
        client = slot.client
        assert client is not None
        job = self.job
        self.replica = slot.name
        self._attached_at = len(self.completion_ids)  # (before a ReplicaDead from generate: no token there)
        try:
            if self.prompt_token_ids is not None:
                col = client.generate(
                    job.params,
                    prompt_token_ids=self.prompt_token_ids,
                    prefix_token_ids=self.completion_ids,
                    prefix_text_len=self.text_len,
                )
            else:
                col = client.generate(job.params, prompt=job.prompt, messages=job.messages,
                                      chat_template_kwargs=job.template_kwargs, reasoning_effort=job.reasoning_effort)
        except ReplicaDead as e:
            handle.release()
            self._failover(slot.name, e)
            return
        except Exception as e:  # noqa: BLE001 - a bug: this stream ends, its slot is freed
            handle.release()
            self._internal_error(e, "its request")
            return
        col.sink = self
        col.limit = self.chunk_tokens
        self._col = col
        if sched is not None:
            sched.running.add(self)
        self._client = client
        self._handle = handle
        self._dog = Watchdog(self.deadlines, col, bool(self.completion_ids), slot.name)
        self._dispatched = self._dog.last_token
        self._charged_prompt = self.prompt_token_ids is not None and bool(self.completion_ids)

    def _detach(self, finished: bool) -> None:
        col = self._col
        if col is None:
            return
        self._col = None
        if self.scheduler is not None:
            self.scheduler.running.discard(self)
        col.sink = None
        lane, col.lane = col.lane, None
        if self._dog is not None:
            self._dog.cancel()
            self._dog = None
        client = self._client
        if finished:
            client.release(col)
        else:
            client.abort(col)
        self._client = None
        handle = self._handle
        self._handle = None
        if handle is not None:
            handle.release()
        if lane is not None:
            try:
                lane.close()
            except Exception:  # noqa: BLE001 - metrics only: the run is detached all the same
                log.exception("stream on %s: adding its inter-token samples to the histogram failed", self.replica)

    def _end(self, exc: BaseException) -> None:
        self.ended = True
        self.sink.fail(exc)

    def on_delta(self, col, d: Delta) -> None:
        """One delta from the replica (called by its connection's reader)."""
        if col is not self._col:
            return
        try:
            self._delta(col, d)
        except Exception as e:  # noqa: BLE001 - a bug here must end this stream only, not the connection
            self._internal_error(e, "its output")

    def _delta(self, col, d: Delta) -> None:
        ids = d.token_ids
        n = len(ids) + d.count
        text = d.text
        finish = d.finish  # a FinishReason already (msgspec decodes the IntEnum)
        sched = self.scheduler
        handle = self._handle
        assert handle is not None and self._dog is not None
        now = 0.0
        if n:
            now = time.monotonic()
            if sched is not None:
                if self._dog.delivered:
                    sched.observe(handle.slot, itl=(now - self._dog.last_token) / n)
                else:
                    sched.observe(handle.slot, ttft=now - self._dispatched)
        if self.prompt_token_ids is None:
            if col.prompt_token_ids is not None:
                self.prompt_token_ids = col.prompt_token_ids
            elif d.prompt_count:
                self.prompt_count = d.prompt_count
        refused = finish == FinishReason.ERROR and not (self.produced or n or text)
        if not refused:
            self.prompt_taken = True
        policy = self.policy
        if sched is not None and policy is not None and not refused:
            if not self._charged_prompt and (self.prompt_token_ids is not None or self.prompt_count):
                self._charged_prompt = True
                sched.charge(policy, self.prompt_tokens, n)
            elif n:
                sched.charge(policy, 0, n)
        if finish == FinishReason.ERROR:
            name = handle.slot.name
            self._detach(finished=True)
            if not (self.produced or n or text):
                self._end(self._rejected(col.error))
            else:
                self._lose(f"replica {name} failed the request: {col.error}")
            return
        if n:
            if ids:
                self.completion_ids.extend(ids)
            if d.count:
                self.uncounted += d.count
            self._dog.token(now)
            handle.produced(n)
            if self._died_at is not None:
                self.metrics.failover_latency.observe(time.monotonic() - self._died_at)
                self._died_at = None
        self.text_len += len(text)
        if self.text_parts is not None and text:
            self.text_parts.append(text)
        if finish != FinishReason.NONE:
            self.finish, self.stop_reason = finish, d.stop_reason
            self._detach(finished=True)
        self.sink.piece(text, n, finish)
        if finish != FinishReason.NONE:
            self.ended = True  # only now: if the sink failed on it, the guard tells it so
        elif (ids and col.lane is None and len(self.completion_ids) > 1 and self._col is col and sched is not None
              and policy is not None and self._charged_prompt and self._died_at is None and self.text_parts is None):
            # the next plain pieces of this run can take the token lane (router/lane.py); not
            # after the first token: a stream that idles after it (S3) keeps no lane
            offer = getattr(self.sink, "lane", None)
            if offer is not None:
                col.lane = offer(self, handle, self._dog, sched)

    def lane_failed(self, e: Exception) -> None:
        """The token lane failed relaying a piece (a bug): this stream ends."""
        self._internal_error(e, "its output")

    def _rejected(self, error: str) -> BadRequest:
        """A replica's refusal, as the client's 400. A prompt (with
        ``max_tokens``) over the model's context carries OpenAI's code for it,
        which clients look for to shorten a conversation and retry."""
        if CONTEXT_EXCEEDED in error:
            return BadRequest(error, param="messages" if self.job.messages is not None else "prompt",
                              code="context_length_exceeded")
        return BadRequest(error or "the replica rejected the request")

    def on_fail(self, col, exc: BaseException) -> None:
        """The replica died (``ReplicaDead``), stalled or a limit passed."""
        if col is not self._col:
            return
        try:
            self._failed(exc)
        except Exception as e:  # noqa: BLE001 - called from a replica reader's cleanup: end this stream only
            self._internal_error(e, "its replica's failure")

    def _internal_error(self, e: Exception, what: str) -> None:
        log.exception("stream on %s failed handling %s", self.replica, what)
        self._detach(finished=False)
        if not self.ended:
            self._lose(f"internal error relaying the stream: {e!r}")

    def _failed(self, exc: BaseException) -> None:
        name = self.replica or ""
        if isinstance(exc, (Stalled, ReplicaStalled)) and self._handle is not None:  # (chosen for nothing meanwhile)
            self.pool.caught_stalling(self._handle.slot, exc)
        self._detach(finished=False)
        if isinstance(exc, (ReplicaDead, Stalled)):
            self._failover(name, exc)
        else:
            self._end(exc)

    def _failover(self, name: str, e: BaseException) -> None:
        """Continue on another replica with prompt + delivered tokens."""
        if self.ended:
            return
        if (self.text_len or self.uncounted) and not (self.exact and self.completion_ids):
            # Text went out without token ids (an upstream that returns none): no replica
            # can continue it exactly, and starting over would repeat it.
            self._lose(f"replica {name} failed and its output has no token ids to resume from: {e}")
            return
        if (self.completion_ids and len(self.completion_ids) >= self.job.params.max_tokens
                and not self.job.params.stop):
            # All its tokens were out, only the finish was lost (sent alone, as OpenAI does): it ends here.
            # (With stop strings a replica may have held text back, which this would drop: those fail over to
            # a 0-token continuation, which sends that text, then length: replicas.prepare.finish_prefix.)
            log.info("stream on %s failed after its last token (%s); finished with length", name, e,
                     extra={"request_id": self.request_id, "replica": name})
            self.finish = FinishReason.LENGTH
            self.sink.piece("", 0, FinishReason.LENGTH)
            self.ended = True
            return
        self._died_at = time.monotonic()
        if self._exclude is None:
            self._exclude = {}
        self._exclude.pop(name, None)
        self._exclude[name] = None
        straight_back, self._straight_back = self._straight_back, False
        # (dead: a stall there is a replica alive and slow, charged as any other)
        # (a 429/503 is a replica alive that refused: charged, or it was asked 9 times at once)
        freed = (straight_back and isinstance(e, ReplicaDead) and not isinstance(e, ReplicaBusy)
                 and len(self.completion_ids) == self._attached_at)
        if freed:
            # (found still dead: the failover that sent it there is the one this death costs; once per
            # death, since a stream that goes straight back again after this one is not freed again)
            pass
        elif len(self.completion_ids) == self._attached_at and self._free_retries:
            # (it gave this attempt no token: most often found dead when the
            # stream came to it, one of several killed at once. Not charged,
            # up to one per replica: a stream survives max_failovers deaths
            # of the replicas that serve it)
            self._free_retries -= 1
        elif self._charged >= self.max_failovers:
            self._give_up(f"gave up after {self.max_failovers} failovers: {e}",
                          getattr(e, "retry_after", 0.0))
            return
        else:
            self._charged += 1
        try:
            # A failover continues at once, past the queues and caps: its
            # client is mid-stream.
            handle = self._choose_again()
        except NoReplica as e2:
            if not self._wait_for_replica(str(e2), e):
                self._give_up(str(e2))
            return
        self._moved(name)
        self._straight_back = handle.slot.name == name and not freed
        log.info("stream on %s failed after %d tokens (%s); continuing on %s (failover %d)", name,
                 len(self.completion_ids), e, handle.slot.name, self.failovers,
                 extra={"request_id": self.request_id, "replica": name})
        self._attach(handle)

    def _moved(self, name: str) -> None:
        """Count the failover from ``name``, once the stream has a replica to
        move to (one that finds none is lost, or refused, not moved)."""
        self.failovers += 1
        self.metrics.failovers.labels(name).inc()
        self.metrics.resumed_tokens.inc(len(self.completion_ids))

    def _choose_again(self) -> LoadHandle:
        """A replica for the rest of the generation, avoiding those that failed
        it (``NoReplica``: none is ready)."""
        job = self.job
        return self.pool.choose(job.model, job.params.max_tokens - len(self.completion_ids), self._exclude, self.needs)

    def _lose(self, why: str) -> None:
        """End with ``StreamLost``; counted as a lost stream if it had output."""
        if self.produced:
            self.metrics.streams_lost.inc()
        self._end(StreamLost(why))
