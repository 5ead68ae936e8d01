"""The scheduler's use of the fair-share counters and of a request's queue
wait, on one replica slot that takes one request at a time.

(A mutation audit: the scheduler's unit tests passed with ``served`` never
reported to the counters, and with the time a request already waited for
admission not counted against its ``queue_wait``.)"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from router.errors import ServiceUnavailable
from router.scheduler import Scheduler
from router.tenants import TenantPolicy
from tests.unit.pools import MODEL, queueing_policy
from tests.unit.test_scheduler_reload import _one_slot


async def _serve_at_once(sched: Scheduler, policy: TenantPolicy) -> None:
    """One request of ``policy``'s tenant dispatched with nothing queued,
    charged 10 prompt and 20 completion tokens (50 weighted), and ended."""
    handle = await sched.acquire(policy, policy.rank, MODEL, 8)
    sched.charge(policy, 10, 20)
    handle.release()


async def test_a_tenant_returning_to_an_empty_queue_is_lifted_to_the_counter_served_last() -> None:
    # (VTC's rule for an empty queue: the tenant that comes back is lifted to
    # the counter of the tenant dispatched last, so its idle time is not
    # banked; without the dispatches reported, b kept its old counter and
    # won every pick against a until it had caught up a's service)
    _, sched = _one_slot()
    a, b = queueing_policy("a"), queueing_policy("b")
    await _serve_at_once(sched, b)
    assert sched.counters.get("b") == 50
    for _ in range(3):  # a alone: dispatched at its counters 0, 50 and 100
        await _serve_at_once(sched, a)
    assert sched.counters.get("a") == 150
    handle = await sched.acquire(b, b.rank, MODEL, 8)
    assert sched.counters.get("b") == 100  # (a's when it was dispatched last)
    handle.release()


@pytest.mark.parametrize("waited, ends_after", [(2.8, 0.2), (3.0, 0.0), (3.5, 0.0)])
async def test_the_wait_for_admission_counts_against_queue_wait(waited: float, ends_after: float) -> None:
    # (queue_wait bounds the whole wait: a request that waited 2.8 s of its
    # 3 s in its tenant's admission line gets 0.2 s more in the queue, not 3 s)
    _, sched = _one_slot()
    a = queueing_policy("a")
    a = msgspec.structs.replace(a, limits=msgspec.structs.replace(a.limits, queue_wait=3.0))
    held = await sched.acquire(a, a.rank, MODEL, 8)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(ServiceUnavailable) as ended:
        await asyncio.wait_for(sched.acquire(a, a.rank, MODEL, 8, waited=waited), 5)
    took = loop.time() - t
    assert ends_after <= took < ends_after + 1.0, took
    assert ended.value.code == "queue_timeout" and "timeouts.queue_wait of 3s" in ended.value.message
    assert sched.queued() == 0
    held.release()
