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
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from replicas.client import ReplicaDead
from replicas.pool import LoadHandle, NoReplica, ReplicaPool
from replicas.protocol import FinishReason, SamplingParams
from router.errors import BadRequest, ReplicaUnavailable
from router.metrics import Metrics

if TYPE_CHECKING:
    from router.scheduler import Scheduler
    from router.tenants import TenantPolicy

__all__ = ["Job", "Generation", "StreamLost", "StreamTimeout", "Deadlines", "Piece"]


class StreamLost(Exception):
    """The stream cannot continue: no replica could take it over."""


class StreamTimeout(Exception):
    """A tenant time limit passed (``which``: first_token, total)."""

    def __init__(self, which: str, seconds: float) -> None:
        super().__init__(f"{which.replace('_', ' ')} timeout of {seconds:g}s exceeded")
        self.which = which
        self.seconds = seconds


class _Stalled(Exception):
    """No token within the stall limit while the replica should be producing."""


class Deadlines:
    """Tenant time limits for one generation (0 = none), from its start."""

    __slots__ = ("first_token", "stall", "total", "start")

    def __init__(self, first_token: float = 0.0, stall: float = 0.0, total: float = 0.0,
                 start: float | None = None) -> None:
        self.first_token = first_token
        self.stall = stall
        self.total = total
        self.start = time.monotonic() if start is None else start


AFFINITY_PREFIX = 512  # characters (or tokens) of the prompt that key prefix affinity


class Job:
    """What was asked: the model, the prompt in one of three forms, the params."""

    __slots__ = ("model", "params", "prompt", "messages", "prompt_token_ids")

    def affinity_key(self) -> int | None:
        """Hash of the prompt's first AFFINITY_PREFIX characters (or token
        ids): requests sharing it prefer the replica that served it last,
        whose prefix cache may still hold it. None for short prompts."""
        if self.messages is not None:
            text = "\x00".join(f"{m.get('role')}:{m.get('content')}" for m in self.messages)
            return hash(text[:AFFINITY_PREFIX]) if len(text) >= AFFINITY_PREFIX else None
        if self.prompt is not None:
            return hash(self.prompt[:AFFINITY_PREFIX]) if len(self.prompt) >= AFFINITY_PREFIX else None
        ids = self.prompt_token_ids or []
        return hash(tuple(ids[:AFFINITY_PREFIX])) if len(ids) >= AFFINITY_PREFIX else None

    def __init__(
        self,
        model: str,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.prompt = prompt
        self.messages = messages
        self.prompt_token_ids = prompt_token_ids


Piece = tuple[str, int, FinishReason]  # text, new tokens, finish


class Generation:
    __slots__ = ("pool", "scheduler", "policy", "rank", "deadlines", "job", "metrics", "max_failovers",
                 "prompt_token_ids", "completion_ids", "text_len", "failovers", "text_parts", "finish", "replica")

    def __init__(self, pool: ReplicaPool, job: Job, metrics: Metrics, max_failovers: int,
                 deadlines: Deadlines | None = None, scheduler: Scheduler | None = None,
                 policy: TenantPolicy | None = None, rank: int = 0) -> None:
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
        self.text_len = 0
        self.failovers = 0
        self.text_parts: list[str] | None = [] if policy is not None and policy.log_content else None
        self.finish = FinishReason.NONE
        self.replica: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids or ())

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_ids)

    async def stream(self) -> AsyncIterator[Piece]:
        """Yield pieces until the generation finishes.

        Before any token: ``ReplicaUnavailable`` (no replica) or ``BadRequest``
        (the replica rejected the prompt). After tokens were delivered:
        ``StreamLost`` when no replica can continue. Closing the iterator early
        aborts the request on its replica.
        """
        job = self.job
        exclude: set[str] = set()
        died_at: float | None = None
        first = True
        while True:
            try:
                remaining = job.params.max_tokens - len(self.completion_ids)
                if first and self.scheduler is not None and self.policy is not None:
                    # Wait for our turn in the tenant's queue (fair share, caps).
                    waited = time.monotonic() - self.deadlines.start  # e.g. for a rate limit
                    handle = await self.scheduler.acquire(self.policy, self.rank, job.model, remaining, waited,
                                                          job.affinity_key())
                else:
                    # A failover continues at once, past the queues and caps:
                    # its client is mid-stream.
                    handle = self.pool.choose(job.model, remaining, exclude)
                first = False
            except NoReplica as e:
                if self.completion_ids or self.failovers:
                    self.metrics.streams_lost.inc()
                    raise StreamLost(str(e)) from e
                raise ReplicaUnavailable(str(e)) from e
            try:
                # aclosing: an early close of this stream must abort on the
                # replica now, not when the inner generator is collected.
                async with aclosing(self._run_on(handle, died_at)) as pieces:
                    async for piece in pieces:
                        died_at = None
                        yield piece
                return
            except (ReplicaDead, _Stalled) as e:
                if self.text_len and (self.prompt_token_ids is None or not self.completion_ids):
                    # Text went out without token ids (an upstream that returns
                    # none): no replica can continue it exactly, and starting
                    # over would repeat it.
                    self.metrics.streams_lost.inc()
                    raise StreamLost(
                        f"replica {handle.slot.name} failed and its output has no token ids to resume from: {e}"
                    ) from e
                died_at = time.monotonic()
                exclude.add(handle.slot.name)
                self.failovers += 1
                self.metrics.failovers.labels(handle.slot.name).inc()
                if self.failovers > self.max_failovers:
                    self.metrics.streams_lost.inc()
                    raise StreamLost(f"gave up after {self.max_failovers} failovers: {e}") from e
                self.metrics.resumed_tokens.inc(len(self.completion_ids))

    async def _run_on(self, handle: LoadHandle, died_at: float | None) -> AsyncIterator[Piece]:
        slot = handle.slot
        client = slot.client
        assert client is not None
        job = self.job
        self.replica = slot.name
        col = None
        dog = None
        try:
            if self.prompt_token_ids is not None:
                col = client.generate(
                    job.params,
                    prompt_token_ids=self.prompt_token_ids,
                    prefix_token_ids=self.completion_ids,
                    prefix_text_len=self.text_len,
                )
            else:
                col = client.generate(job.params, prompt=job.prompt, messages=job.messages)
            dog = _Watchdog(self.deadlines, col, self.completion_ids, slot.name)
            dispatched = dog.last_token
            sched = self.scheduler
            policy = self.policy
            charged_prompt = self.prompt_token_ids is not None and self.completion_ids
            chunk = policy.chunk_tokens if policy is not None else 0
            while True:
                ids, text, finish = await col.get(chunk)
                if ids:
                    now = time.monotonic()
                    if sched is not None:
                        if self.completion_ids:
                            sched.observe(slot, itl=(now - dog.last_token) / len(ids))
                        else:
                            sched.observe(slot, ttft=now - dispatched)
                if self.prompt_token_ids is None and col.prompt_token_ids is not None:
                    self.prompt_token_ids = col.prompt_token_ids
                if sched is not None and policy is not None:
                    if not charged_prompt and self.prompt_token_ids is not None:
                        charged_prompt = True
                        sched.charge(policy, len(self.prompt_token_ids), len(ids))
                    elif ids:
                        sched.charge(policy, 0, len(ids))
                if finish == FinishReason.ERROR:
                    if not self.completion_ids and not ids and not self.text_len and not text:
                        raise BadRequest(col.error or "the replica rejected the request")
                    raise StreamLost(f"replica {slot.name} failed the request: {col.error}")
                if ids:
                    self.completion_ids.extend(ids)
                    dog.token(now)
                    handle.produced(len(ids))
                    if died_at is not None:
                        self.metrics.failover_latency.observe(time.monotonic() - died_at)
                        died_at = None
                self.text_len += len(text)
                if self.text_parts is not None and text:
                    self.text_parts.append(text)
                if finish != FinishReason.NONE:
                    self.finish = finish
                    client.release(col)
                    col = None
                yield text, len(ids), finish
                if finish != FinishReason.NONE:
                    return
        finally:
            if dog is not None:
                dog.cancel()
            if col is not None:
                client.abort(col)
            handle.release()


class _Watchdog:
    """The first-token, stall and total limits of one run on a replica, as one
    lazily re-armed timer (not a timer per awaited token).

    A token only moves ``last_token``. When the timer fires before the limit
    that now applies, it re-arms for that limit; when the limit has passed
    and no output is waiting, it fails the collector with ``_Stalled`` or
    ``StreamTimeout``, which the pending ``get`` raises. While output waits
    unread (the client reads slowly) it looks again every ``_RECHECK`` s:
    the limits measure the replica, not the client.
    """

    __slots__ = ("dl", "col", "delivered", "replica", "last_token", "_handle", "_which", "_loop", "_offset")

    _RECHECK = 0.05

    def __init__(self, dl: Deadlines, col, delivered: list[int], replica: str) -> None:
        self.dl = dl
        self.col = col
        self.delivered = delivered  # the generation's completion ids (all replicas)
        self.replica = replica
        self.last_token = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._offset = self._loop.time() - self.last_token
        self._handle: asyncio.TimerHandle | None = None
        self._which = ""
        self._arm()

    def token(self, now: float) -> None:
        """Tokens were delivered at ``now``. Only the first one can bring a
        limit forward (first token -> stall); later ones move it back, which
        the timer learns when it fires."""
        self.last_token = now
        if self._handle is None or self._which == "first_token":
            self.cancel()
            self._arm()

    def _limit(self) -> tuple[float | None, str]:
        dl = self.dl
        if self.delivered:
            at, which = (self.last_token + dl.stall if dl.stall else None), "stall"
        else:
            at, which = (dl.start + dl.first_token if dl.first_token else None), "first_token"
        if dl.total:
            total_at = dl.start + dl.total
            if at is None or total_at <= at:
                at, which = total_at, "total"
        return at, which

    def _arm(self, at: float | None = None) -> None:
        if at is None:
            at, self._which = self._limit()
        if at is not None:
            self._handle = self._loop.call_at(at + self._offset, self._fire)

    def _fire(self) -> None:
        self._handle = None
        at, which = self._limit()
        self._which = which
        if at is None:
            return
        now = time.monotonic()
        if now < at:
            self._arm(at)
        elif self.col.ready:
            self._arm(now + self._RECHECK)
        elif which == "stall":
            self.col.fail(_Stalled(f"replica {self.replica} produced no token for {self.dl.stall:g}s"))
        else:
            self.col.fail(StreamTimeout(which, getattr(self.dl, which)))

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

