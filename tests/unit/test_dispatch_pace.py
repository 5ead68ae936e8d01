"""The Retry-After of the scheduler's 429 ``queue_full`` and 503
``queue_timeout`` (``policies.dispatch_pace``), with an injected clock: it
follows the pace at which waiting requests get replicas, not the pace at
which clients came; it grows when dispatches stop while requests wait; in a
steady state it is what the dispatch rate says, bursts of dispatches too."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from policies.batching import AimdSettings
from policies.dispatch_pace import MIN_RETRY_AFTER, DispatchPace
from replicas.pool import LoadHandle, ReplicaPool
from replicas.spec import ReplicaSpec
from router.errors import RateLimited, ServiceUnavailable
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from tests.unit.pools import MODEL, ReadyClient, queueing_policy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(replicas: int, clock: Clock) -> Scheduler:
    """``replicas`` ready replicas that take one request at a time."""
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}", address=f"127.0.0.1:{9 + i}") for i in range(replicas)])
    for slot in pool.slots:
        slot.client = ReadyClient()  # type: ignore[assignment]
        slot.state = "ready"
    return Scheduler(pool, Metrics(), SchedulerSettings(),
                     AimdSettings(enabled=False, initial=1, min_inflight=1, max_inflight=1), clock=clock)


POLICY = queueing_policy("a")  # (queue depth 10)


async def _queue_full_retry_after(sched: Scheduler) -> float:
    """The Retry-After a request gets from the full queue (10 ahead of it)."""
    assert sched.queued("a") == POLICY.queue_depth
    with pytest.raises(RateLimited) as full:
        await sched.acquire(POLICY, 1, MODEL, 8)
    assert full.value.code == "queue_full"
    return float(full.value.headers["retry-after"])


async def _turns() -> None:
    for _ in range(5):  # (a release wakes the queue on the next loop turn)
        await asyncio.sleep(0)


class Backlog:
    """Every replica busy and ``POLICY.queue_depth`` requests queued behind them."""

    def __init__(self, sched: Scheduler, held: list[LoadHandle]) -> None:
        self.sched = sched
        self.running = held
        self.waiting = [asyncio.create_task(sched.acquire(POLICY, 1, MODEL, 8)) for _ in range(POLICY.queue_depth)]

    @classmethod
    async def of(cls, sched: Scheduler) -> Backlog:
        held = [await sched.acquire(POLICY, 1, MODEL, 8) for _ in sched.pool.slots]
        self = cls(sched, held)
        await _turns()
        return self

    async def end(self, n: int) -> None:
        """``n`` running streams end at once; the queue refills behind them."""
        for h in self.running[:n]:
            h.release()
        self.running = self.running[n:]
        await _turns()
        done = [t for t in self.waiting if t.done()]
        assert len(done) == n
        self.waiting = [t for t in self.waiting if not t.done()]
        self.running += [t.result() for t in done]
        self.waiting += [asyncio.create_task(self.sched.acquire(POLICY, 1, MODEL, 8)) for _ in range(n)]
        await _turns()

    async def close(self) -> None:
        for t in self.waiting:
            t.cancel()
        await asyncio.gather(*self.waiting, return_exceptions=True)
        for h in self.running:
            h.release()


async def test_a_cluster_used_lightly_before_does_not_tell_clients_to_wait_for_its_idle_gaps() -> None:
    # (the dispatch rate counted the gaps between requests when nobody
    # waited: one request every 10 s made it 10 s per dispatch, and a full
    # queue's client was told to wait 100 s)
    clock = Clock()
    sched = _scheduler(1, clock)
    for i in range(20):
        clock.now = 10.0 * (i + 1)
        (await sched.acquire(POLICY, 1, MODEL, 8)).release()
    clock.now += 10
    backlog = await Backlog.of(sched)
    clock.now += 0.5
    assert await _queue_full_retry_after(sched) <= 10 * 1.0 + 1, "the idle gaps counted"
    await backlog.close()


async def test_a_queue_timeout_s_retry_after_follows_the_pace_of_waiting_requests() -> None:
    clock = Clock()
    sched = _scheduler(1, clock)
    for i in range(20):
        clock.now = 10.0 * (i + 1)
        (await sched.acquire(POLICY, 1, MODEL, 8)).release()
    backlog = await Backlog.of(sched)
    for _ in range(10):
        clock.now += 0.5
        await backlog.end(1)
    # one more, with queue_wait 20 ms (real time), behind 10 that get a replica every 0.5 s
    short = msgspec.structs.replace(POLICY, queue_depth=11,
                                    limits=msgspec.structs.replace(POLICY.limits, queue_wait=0.02))
    with pytest.raises(ServiceUnavailable) as timed_out:
        await sched.acquire(short, 1, MODEL, 8)
    assert timed_out.value.code == "queue_timeout"
    assert 5 <= int(timed_out.value.headers["retry-after"]) <= 6, timed_out.value.headers  # (10 x 0.5 s, rounded up)
    await backlog.close()


@pytest.mark.parametrize("replicas", [1, 2], ids=["one at a time", "two at once"])
async def test_in_a_steady_state_it_is_what_the_dispatch_rate_says(replicas: int) -> None:
    # one replica freeing every 0.5 s, or two freeing together every 1 s: 2
    # dispatches a second either way, so 10 ahead wait 5 s (the rate average
    # said 5 s for the first and 1 s for the second: its 1/interval of the
    # burst's second dispatch, 0 s after the first, swamped the average)
    clock = Clock()
    sched = _scheduler(replicas, clock)
    backlog = await Backlog.of(sched)
    for _ in range(30):
        clock.now += 0.5 * replicas
        await backlog.end(replicas)
    assert 4.5 <= await _queue_full_retry_after(sched) <= 5.5
    await backlog.close()


async def test_it_grows_when_dispatches_stop_while_requests_wait() -> None:
    clock = Clock()
    sched = _scheduler(1, clock)
    backlog = await Backlog.of(sched)
    for _ in range(30):
        clock.now += 0.5
        await backlog.end(1)
    clock.now += 20  # nothing frees for 20 s (the rate average still said 5 s)
    stalled = await _queue_full_retry_after(sched)
    assert stalled >= 10 * (0.8 * 0.5 + 0.2 * 20) - 0.01, stalled
    clock.now += 0.5  # then a stream ends: the stall is one interval, what the estimate said
    await backlog.end(1)
    assert 45 <= await _queue_full_retry_after(sched) <= 46  # (10 x (0.8 x 0.5 + 0.2 x 20.5), rounded up)
    for _ in range(20):  # and the pace comes back
        clock.now += 0.5
        await backlog.end(1)
    assert await _queue_full_retry_after(sched) <= 6, "a stall is forgotten as the pace comes back"
    await backlog.close()


def test_the_pace_counts_only_time_in_which_requests_waited() -> None:
    pace = DispatchPace()
    assert pace.retry_after(0, 0.0) == MIN_RETRY_AFTER
    assert pace.retry_after(3, 0.0) == 3.0  # (1 s a dispatch until one was measured)
    pace.dispatched(5.0)  # nobody waited: measures nothing
    assert pace.interval is None
    pace.waiting(10.0)
    pace.waiting(11.0)  # (already open)
    pace.dispatched(12.0)
    assert pace.interval == 2.0
    pace.idle()
    pace.waiting(100.0)  # the 88 s nobody waited are not an interval
    pace.dispatched(100.5)
    assert pace.interval == pytest.approx(0.8 * 2.0 + 0.2 * 0.5)
    assert pace.mean_interval(101.0) == pace.interval  # (open 0.5 s: shorter than the mean)
    assert pace.mean_interval(110.5) == pytest.approx(0.8 * pace.interval + 0.2 * 10)


def test_retry_after_is_bounded_after_a_long_stall():
    from policies.dispatch_pace import DispatchPace, MAX_RETRY_AFTER
    p = DispatchPace()
    p.waiting(0.0)
    for i in range(1, 51):
        p.dispatched(i * 0.5)
    t = 25.0
    assert p.retry_after(64, t + 3600) <= MAX_RETRY_AFTER  # (was 46106 s: 12.8 h)
    p.dispatched(t + 3600)
    p.idle()
    p.waiting(t + 86400)  # (the next day: the old stall is still in the average)
    assert p.retry_after(64, t + 86400) <= MAX_RETRY_AFTER
