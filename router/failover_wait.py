"""A failover that waits: no replica of the stream's model was ready when its
replica failed (its only one, or every one, restarting).

``WaitsForReplica`` is the part of ``router.generation.Generation`` that
waits, up to ``failover_wait`` and never past the tenant's time limits, for
a ready replica *with room* under its in-flight cap (``max_concurrency``,
the adaptive cap): the streams that waited do not all pile onto the first
replica back. ``ReplicaPool.when_ready`` calls them, in the order they
began to wait, when a replica becomes ready or a ready one has room again
(a stream on it ended), before the scheduler's queue gets that room. When
``failover_wait`` runs out while a ready replica is full, the stream goes
there past its cap rather than being lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

from replicas.client import CredentialsRefused
from replicas.pool import LoadHandle, NoReplica
from router.deadlines import StreamTimeout
from router.errors import ReplicaUnavailable, retry_after_header
from router.logs import request_id_var

log = logging.getLogger("fairstream.generation")

__all__ = ["StreamLost", "WaitsForReplica"]


class StreamLost(Exception):
    """The stream cannot continue: no replica could take it over."""


class WaitsForReplica:
    """Waiting for a replica to continue on, or giving up (a mixin of
    ``Generation``, whose attributes and ``_choose_again``, ``_moved``,
    ``_attach`` and ``_end`` it uses)."""

    __slots__ = ("failover_wait", "_waiting", "_full", "_until", "_on_the_way", "_ready_wait")

    def _wait_for_replica(self, why: str, failure: BaseException) -> bool:
        """No replica can take the stream over now (its only replica, or
        every one, is restarting): wait for one to become ready and have
        room, at most ``failover_wait`` seconds and never past the tenant's
        time limits. True: waiting (``_replica_ready`` continues it,
        ``_waited`` ends the wait)."""
        sched = self.scheduler
        if self.failover_wait <= 0 or (sched is not None and sched.stopping):
            return False
        if isinstance(failure, CredentialsRefused) and not self.produced:
            # (an upstream that refused the router's key does not come back by itself: the client,
            # sent nothing yet, gets the 503 naming it now, not after failover_wait)
            return False
        now = time.monotonic()
        # (the replica it waited for failed it on the way there: the same
        # wait goes on, to the same end, in its place in line)
        until, limit = self._until if self._on_the_way else self._wait_end()
        if until <= now:
            return False
        # (what every failover's line says: the replica, the tokens so far, why; then why it waits)
        log.info("stream on %s failed after %d tokens (%s); no replica is ready to continue it (%s); waiting "
                 "up to %.1fs for one", self.replica, len(self.completion_ids), failure, why, until - now,
                 extra={"request_id": self.request_id, "replica": self.replica})
        self._full = ()  # (ready replicas it found full)
        self._until = (until, limit)
        self._waiting = asyncio.get_running_loop().call_at(until, self._waited, why, limit)
        self.pool.when_ready(self._replica_ready, self.job.model, self.needs)
        if sched is not None:
            sched.running.add(self)  # (a router that stops ends it: stop_all)
        return True

    def _wait_end(self) -> tuple[float, str]:
        """When a wait for a replica that begins now ends (time.monotonic()):
        ``failover_wait`` from now, or the tenant's first-token (while
        nothing was produced) or total limit where sooner; and that limit's
        name ("" for ``failover_wait``)."""
        dl = self.deadlines
        until, limit = time.monotonic() + self.failover_wait, ""
        if dl.first_token and not self.produced and dl.start + dl.first_token < until:
            until, limit = dl.start + dl.first_token, "first_token"
        if dl.total and dl.start + dl.total < until:
            until, limit = dl.start + dl.total, "total"
        return until, limit

    async def _until_ready(self, e: ReplicaUnavailable, wait: tuple[float, str] | None) -> tuple[float, str]:
        """A resume's continuation found no replica of its model ready (its
        only one, or every one, restarting; ``e``): wait for one to become
        ready as a failover does, up to ``failover_wait`` and never past the
        tenant's time limits, then go through the queue as before. Its
        client is mid-stream, like a failover's; ``queue_wait`` is for
        replicas that are busy, not gone. ``wait``: the end of the wait it
        began (a replica that became ready and was gone again by its turn).
        Raises ``e`` (or the limit's timeout) when none became ready."""
        until, limit = wait or self._wait_end()
        delay = until - time.monotonic()
        if self.failover_wait <= 0 or delay <= 0 or self.pool.credentials_refused(self.job.model):
            raise e
        log.info("no replica is ready to continue the stream at %d tokens (%s); waiting up to %.1fs for one",
                 len(self.completion_ids), e, delay)
        became_ready = self._ready_wait = asyncio.get_running_loop().create_future()

        def ready() -> bool:
            if not self.pool.ready_slots(self.job.model, needs=self.needs):
                return True  # (another model's)
            if not became_ready.done():
                became_ready.set_result(None)
            return False

        self.pool.when_ready(ready)  # (any model's: called when any replica becomes ready)
        sched = self.scheduler
        if sched is not None:
            sched.running.add(self)  # (a router that stops wakes it, to end with RouterShutdown: stop_all)
        try:
            await asyncio.wait_for(became_ready, delay)
        except TimeoutError:
            if limit:
                raise StreamTimeout(limit, getattr(self.deadlines, limit)) from None
            raise e from e.__cause__
        finally:
            self.pool.forget(ready)
            self._ready_wait = None
            if sched is not None:
                sched.running.discard(self)
        return until, limit

    def _stop_waiting(self, keep_place: bool = False) -> None:
        if self._ready_wait is not None and not self._ready_wait.done():
            self._ready_wait.set_result(None)  # (a continuation's wait: it tries again, and is refused)
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        waiting.cancel()
        if not keep_place:  # (the pool forgets it when ``_replica_ready`` returns other than True)
            self.pool.forget(self._replica_ready)
        if self.scheduler is not None:
            self.scheduler.running.discard(self)

    def _replica_ready(self) -> bool:
        """A replica became ready, or a ready one may have room, while this
        stream waited: continue there if one has room. True: still waiting."""
        if self._waiting is None or self.ended:
            return False
        job = self.job
        try:
            handle = self.pool.choose_room(job.model, job.params.max_tokens - len(self.completion_ids),
                                           self._exclude, self.needs)
        except NoReplica:
            return True  # (one for another model)
        if handle is None:  # (ready ones, all full: waits for room, or past the cap at failover_wait)
            self._full = {s.name for s in self.pool.ready_slots(job.model)}
            return True
        self._stop_waiting(keep_place=True)
        self._moved(self.replica or "")
        log.info("stream on %s continues on %s, %s", self.replica, handle.slot.name,
                 "which has room now" if handle.slot.name in self._full else "which became ready",
                 extra={"request_id": self.request_id})
        self._on_the_way = True
        try:
            self._attach_as_own(handle)
        finally:
            self._on_the_way = False
        return self._waiting is not None  # (found dead on the way, and waiting again)

    def _attach_as_own(self, handle: LoadHandle) -> None:
        """``_attach`` under this stream's request id: it runs in whatever
        called (another request's ``try_choose``, a stream's end), and the
        timers it starts log under the id they find."""
        token = request_id_var.set(self.request_id)
        try:
            self._attach(handle)
        finally:
            request_id_var.reset(token)

    def _waited(self, why: str, limit: str) -> None:
        """The wait ran out: ``failover_wait`` passed, and the stream goes on
        a ready replica past its cap, or is lost if none is ready; or the
        tenant's time limit ``limit`` passed (which ends it as a timeout)."""
        self._stop_waiting()
        if self.ended:
            return
        if limit:
            self._end(StreamTimeout(limit, getattr(self.deadlines, limit)))
            return
        try:
            handle: LoadHandle = self._choose_again()  # (past the caps, as a failover at once goes)
        except NoReplica:
            self._give_up(f"{why}, and none became ready within {self.failover_wait:g}s")
            return
        self._moved(self.replica or "")
        log.info("stream on %s continues on %s past its in-flight cap: no ready replica had room within %gs",
                 self.replica, handle.slot.name, self.failover_wait, extra={"request_id": self.request_id})
        self._attach_as_own(handle)

    def _give_up(self, why: str, retry_after: float = 0.0) -> None:
        """No replica can go on after the request's replica failed
        (``retry_after``: the pause the last one asked for, if it said)."""
        self._end(self._no_replica(why, ReplicaUnavailable(
            f"The request's replica failed before its first token and no other replica could take it: {why}",
            headers={"retry-after": retry_after_header(retry_after)},
        )))

    def _no_replica(self, why: str, unavailable: ReplicaUnavailable) -> Exception:
        """What no replica to run on means: a lost stream (counted) if
        anything was produced; otherwise ``unavailable``, since nothing
        reached the client, which may simply retry (503)."""
        if self.produced:
            self.metrics.streams_lost.inc()
            return StreamLost(why)
        return unavailable
