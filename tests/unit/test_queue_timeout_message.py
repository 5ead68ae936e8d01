"""The scheduler's answer when a wait for a replica ends names the limit
that ended it (``timeouts.queue_wait``, ``timeouts.first_token`` or
``timeouts.total``) with its configured value, and the time the request
really waited, its wait for admission included (``waited``) and how much of
it was in the queue. (It said "the request waited {X}s in the queue, the
limit for tenant ..." with X the first-token or total limit's remainder, the
admission wait counted as queue time, and, when the admission wait had used
up queue_wait already, X over the limit it claimed to be.)"""

from __future__ import annotations

import asyncio
import re

import msgspec
import pytest

from router.deadlines import StreamTimeout
from router.errors import ReplicaUnavailable, ServiceUnavailable
from tests.unit.pools import MODEL, queueing_policy
from tests.unit.test_scheduler_stop import _one_slot


def _with(policy, **timeouts):
    return msgspec.structs.replace(policy, limits=msgspec.structs.replace(policy.limits, **timeouts))


def _waited(message: str) -> tuple[float, float]:
    m = re.search(r"waited ([\d.]+)s, ([\d.]+)s of it in the queue", message)
    assert m, message
    return float(m[1]), float(m[2])


async def test_replicas_down_at_queue_wait_names_queue_wait_and_the_time_waited() -> None:
    pool, _, sched = _one_slot()
    a = _with(queueing_policy("a"), queue_wait=0.3)
    held = await sched.acquire(a, 1, MODEL, 8)
    waiting = asyncio.create_task(sched.acquire(a, 1, MODEL, 8, waited=0.1))
    await asyncio.sleep(0.05)
    pool.slots[0].state = "down"
    with pytest.raises(ReplicaUnavailable) as info:
        await waiting
    msg = info.value.message
    assert "tenant 'a''s timeouts.queue_wait of 0.3s ended the wait" in msg, msg
    total, queued = _waited(msg)
    assert 0.29 <= total <= 0.4 and 0.19 <= queued <= 0.3, msg
    held.release()


@pytest.mark.parametrize("which", ["first_token", "total"])
async def test_replicas_down_when_a_time_limit_ends_the_wait_names_that_limit(which: str) -> None:
    # 0.9 s in admission, then 0.1 s left of a 1 s limit: it waited 1 s, 0.1 s in the queue
    pool, _, sched = _one_slot()
    a = _with(queueing_policy("a"), queue_wait=30.0)
    held = await sched.acquire(a, 1, MODEL, 8)
    waiting = asyncio.create_task(sched.acquire(a, 1, MODEL, 8, waited=0.9,
                                                limit=lambda: (0.1, StreamTimeout(which, 1.0))))
    await asyncio.sleep(0.02)
    pool.slots[0].state = "down"
    with pytest.raises(ReplicaUnavailable) as info:
        await waiting
    msg = info.value.message
    assert f"tenant 'a''s timeouts.{which} of 1s ended the wait" in msg, msg
    assert "queue_wait" not in msg and "30" not in msg, msg
    total, queued = _waited(msg)
    assert 0.99 <= total <= 1.1 and 0.09 <= queued <= 0.2, msg
    held.release()


async def test_an_admission_wait_past_queue_wait_is_not_reported_as_the_limit() -> None:
    # 1.5 s in admission against a queue_wait of 1 s: it said "waited 1.501s, the limit"
    _, _, sched = _one_slot()
    a = _with(queueing_policy("a"), queue_wait=1.0)
    held = await sched.acquire(a, 1, MODEL, 8)
    with pytest.raises(ServiceUnavailable) as info:
        await sched.acquire(a, 1, MODEL, 8, waited=1.5)
    msg = info.value.message
    assert info.value.code == "queue_timeout"
    assert "tenant 'a''s timeouts.queue_wait of 1s ended the wait" in msg, msg
    total, queued = _waited(msg)
    assert 1.5 <= total <= 1.6 and queued <= 0.1, msg
    held.release()
