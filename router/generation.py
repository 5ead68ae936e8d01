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

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from replicas.client import ReplicaDead
from replicas.pool import LoadHandle, NoReplica, ReplicaPool
from replicas.protocol import FinishReason, SamplingParams
from router.errors import BadRequest, ReplicaUnavailable
from router.metrics import Metrics

__all__ = ["Job", "Generation", "StreamLost", "Piece"]


class StreamLost(Exception):
    """The stream cannot continue: no replica could take it over."""


class Job:
    """What was asked: the model, the prompt in one of three forms, the params."""

    __slots__ = ("model", "params", "prompt", "messages", "prompt_token_ids")

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
    def __init__(self, pool: ReplicaPool, job: Job, metrics: Metrics, max_failovers: int) -> None:
        self.pool = pool
        self.job = job
        self.metrics = metrics
        self.max_failovers = max_failovers
        self.prompt_token_ids: list[int] | None = job.prompt_token_ids
        self.completion_ids: list[int] = []
        self.text_len = 0
        self.failovers = 0
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
        while True:
            try:
                handle = self.pool.choose(job.model, job.params.max_tokens - len(self.completion_ids), exclude)
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
            except ReplicaDead as e:
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
            while True:
                ids, text, finish = await col.get()
                if self.prompt_token_ids is None and col.prompt_token_ids is not None:
                    self.prompt_token_ids = col.prompt_token_ids
                if finish == FinishReason.ERROR:
                    if not self.completion_ids and not ids:
                        raise BadRequest(col.error or "the replica rejected the request")
                    raise StreamLost(f"replica {slot.name} failed the request: {col.error}")
                if ids:
                    self.completion_ids.extend(ids)
                    handle.produced(len(ids))
                    if died_at is not None:
                        self.metrics.failover_latency.observe(time.monotonic() - died_at)
                        died_at = None
                self.text_len += len(text)
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

