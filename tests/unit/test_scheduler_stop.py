"""``Scheduler.stop_all`` (the router's shutdown grace is over): queued
requests end with ``RouterShutdown``, their queue bookkeeping is undone, a
waiter cancelled meanwhile stays cancelled, and no new request gets in."""

from __future__ import annotations

import asyncio

import pytest

from policies.batching import AimdSettings
from replicas.pool import ReplicaPool
from replicas.spec import ReplicaSpec
from router.errors import RouterShutdown
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from tests.unit.pools import MODEL, ReadyClient, queueing_policy



def _one_slot() -> tuple[ReplicaPool, Metrics, Scheduler]:
    """A scheduler over one ready replica that takes one request at a time."""
    pool = ReplicaPool([ReplicaSpec(name="r0", address="127.0.0.1:9")])
    pool.slots[0].client = ReadyClient()  # type: ignore[assignment]
    pool.slots[0].state = "ready"
    metrics = Metrics()
    sched = Scheduler(pool, metrics, SchedulerSettings(),
                      AimdSettings(enabled=False, initial=1, min_inflight=1, max_inflight=1))
    return pool, metrics, sched


async def test_stop_all_ends_the_queue_and_refuses_new_requests() -> None:
    pool, metrics, sched = _one_slot()
    a, b = queueing_policy("a"), queueing_policy("b")
    held = await sched.acquire(a, 1, MODEL, 8)  # the one slot
    waiting = asyncio.create_task(sched.acquire(a, 1, MODEL, 8))
    leaving = asyncio.create_task(sched.acquire(b, 1, MODEL, 8))
    await asyncio.sleep(0)
    assert sched.queued("a") == 1 and sched.queued("b") == 1

    assert sched.stop_all() == (0, 2)
    leaving.cancel()  # its client left in the same turn: a cancellation, not the shutdown error
    with pytest.raises(RouterShutdown):
        await waiting
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert sched.queued("a") == sched.queued("b") == 0
    assert metrics.queued.labels("a", "normal")._value.get() == 0
    with pytest.raises(RouterShutdown):
        await sched.acquire(b, 1, MODEL, 8)
    held.release()
    assert pool.slots[0].inflight == 0


async def test_a_request_queued_behind_a_full_replica_goes_to_one_that_becomes_ready() -> None:
    # (a restart, or an upstream chosen again after a refused connect: the
    # supervisor's pool.notify_ready wakes the queue, not only a release)
    pool = ReplicaPool([ReplicaSpec(name="r0", address="127.0.0.1:9"),
                        ReplicaSpec(name="r1", address="127.0.0.1:10")])
    for slot in pool.slots:
        slot.client = ReadyClient()  # type: ignore[assignment]
    pool.slots[0].state = "ready"  # r1 is restarting
    sched = Scheduler(pool, Metrics(), SchedulerSettings(),
                      AimdSettings(enabled=False, initial=1, min_inflight=1, max_inflight=1))
    held = await sched.acquire(queueing_policy("a"), 1, MODEL, 8)  # r0's one slot
    waiting = asyncio.create_task(sched.acquire(queueing_policy("a"), 1, MODEL, 8))
    await asyncio.sleep(0)
    assert sched.queued("a") == 1
    pool.slots[1].state = "ready"
    pool.notify_ready()
    handle = await asyncio.wait_for(waiting, 1)  # without waiting for r0's release
    assert handle.slot.name == "r1" and sched.queued("a") == 0
    handle.release()
    held.release()


async def test_fail_tenant_ends_only_that_tenants_queued_requests() -> None:
    # (a reload that removes a tenant: its queued requests got a replica
    # later and ran, up to queue_wait after the removal)
    from router.errors import Unauthorized

    pool, metrics, sched = _one_slot()
    a, b = queueing_policy("a"), queueing_policy("b")
    held = await sched.acquire(a, 1, MODEL, 8)
    removed = [asyncio.create_task(sched.acquire(a, 1, MODEL, 8)) for _ in range(2)]
    stays = asyncio.create_task(sched.acquire(b, 1, MODEL, 8))
    await asyncio.sleep(0)
    assert sched.fail_tenant("a", lambda: Unauthorized("removed")) == 2
    for task in removed:
        with pytest.raises(Unauthorized):
            await task
    assert sched.queued("a") == 0 and sched.queued("b") == 1
    assert metrics.queued.labels("a", "normal")._value.get() == 0
    with pytest.raises(Unauthorized):  # (one that queues after the reload too)
        await sched.acquire(a, 1, MODEL, 8)
    held.release()
    (await asyncio.wait_for(stays, 1)).release()
    sched.restore(["a"])  # (added back by a later reload)
    (await sched.acquire(a, 1, MODEL, 8)).release()


async def test_a_request_whose_replicas_went_down_while_it_waited_says_so_at_its_queue_limit() -> None:
    # (it said "The cluster is over capacity" with every replica of its model down)
    from msgspec.structs import replace

    from router.errors import ReplicaUnavailable

    pool, _, sched = _one_slot()
    a = queueing_policy("a")
    a = replace(a, limits=replace(a.limits, queue_wait=0.2))
    held = await sched.acquire(a, 1, MODEL, 8)
    waiting = asyncio.create_task(sched.acquire(a, 1, MODEL, 8))
    await asyncio.sleep(0.05)
    pool.slots[0].state = "down"  # its replica died
    with pytest.raises(ReplicaUnavailable) as info:
        await waiting
    assert "timeouts.queue_wait of 0.2s ended the wait" in info.value.message and info.value.code == "no_replica_available"
    held.release()


async def test_a_request_limit_shorter_than_queue_wait_ends_its_wait_and_leaves_the_queue() -> None:
    # (the tenant's first-token limit counts the wait for a replica; it was
    # checked only once dispatched, after the whole wait)
    from router.deadlines import StreamTimeout

    pool, metrics, sched = _one_slot()
    a = queueing_policy("a")
    held = await sched.acquire(a, 1, MODEL, 8)
    asked: list[int] = []

    def limit():
        asked.append(1)
        return 0.05, StreamTimeout("first_token", 1.0)

    with pytest.raises(StreamTimeout):
        await asyncio.wait_for(sched.acquire(a, 1, MODEL, 8, limit=limit), 5)
    assert sched.queued("a") == 0 and metrics.queued.labels("a", "normal")._value.get() == 0
    held.release()
    # a replica with room: the limit is not even asked
    (await sched.acquire(a, 1, MODEL, 8, limit=limit)).release()
    assert asked == [1]


async def test_a_request_limit_that_ends_a_wait_while_the_replicas_are_down_is_no_replica_available() -> None:
    # (a 504 first_token_timeout would tell the client its request was slow,
    # when the model had no replica left: the queue_wait branch's 503)
    from router.deadlines import StreamTimeout
    from router.errors import ReplicaUnavailable

    pool, metrics, sched = _one_slot()
    a = queueing_policy("a")
    held = await sched.acquire(a, 1, MODEL, 8)
    waiting = asyncio.create_task(sched.acquire(a, 1, MODEL, 8, limit=lambda: (0.05, StreamTimeout("total", 1.0))))
    await asyncio.sleep(0)
    pool.slots[0].state = "down"
    with pytest.raises(ReplicaUnavailable):
        await asyncio.wait_for(waiting, 5)
    assert sched.queued("a") == 0
    held.release()
