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
            dl = self.deadlines
            loop = asyncio.get_running_loop()
            mono_to_loop = loop.time() - time.monotonic()
            total_at = dl.start + dl.total if dl.total else None
            last_token = dispatched = time.monotonic()
            sched = self.scheduler
            policy = self.policy
            charged_prompt = self.prompt_token_ids is not None and self.completion_ids
            chunk = policy.chunk_tokens if policy is not None else 0
            while True:
                if self.completion_ids:
                    limit_at = last_token + dl.stall if dl.stall else None
                    which = "stall"
                else:
                    limit_at = dl.start + dl.first_token if dl.first_token else None
                    which = "first_token"
                if total_at is not None and (limit_at is None or total_at <= limit_at):
                    limit_at, which = total_at, "total"
                if limit_at is None or col.ready:
                    # output already waiting: no timer to arm (the common case under load)
                    ids, text, finish = await col.get(chunk)
                else:
                    try:
                        async with asyncio.timeout_at(limit_at + mono_to_loop):
                            ids, text, finish = await col.get(chunk)
                    except TimeoutError:
                        if which == "stall":
                            raise _Stalled(f"replica {slot.name} produced no token for {dl.stall:g}s") from None
                        raise StreamTimeout(which, getattr(dl, which)) from None
                if ids:
                    now = time.monotonic()
                    if sched is not None:
                        if self.completion_ids:
                            sched.observe(slot, itl=(now - last_token) / len(ids))
                        else:
                            sched.observe(slot, ttft=now - dispatched)
                    last_token = now
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
            if col is not None:
                client.abort(col)
            handle.release()

