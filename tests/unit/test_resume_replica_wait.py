"""A resume's continuation that waited for a replica (``_until_ready``, up to
``failover_wait``) then goes through the tenant's queue with its whole
``queue_wait``: the time it waited for a replica to come back is not time in
the line."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from policies.batching import AimdSettings
from replicas.pool import ReplicaPool
from replicas.protocol import SamplingParams
from replicas.spec import ReplicaSpec
from router.deadlines import Deadlines
from router.generation import Generation
from router.job import Job
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from tests.unit.generations import Client
from tests.unit.pools import MODEL, ReadyClient, queueing_policy


class _Replica(ReadyClient, Client):
    """A ready replica connection that also takes generations."""

    def __init__(self) -> None:
        ReadyClient.__init__(self)
        Client.__init__(self)


async def test_a_continuation_that_waited_for_a_replica_still_has_its_queue_wait() -> None:
    pool = ReplicaPool([ReplicaSpec(name="r0", address="127.0.0.1:9", max_concurrency=1)])
    (slot,) = pool.slots
    slot.client = _Replica()  # type: ignore[assignment]
    slot.state = "down"  # (restarting)
    metrics = Metrics()
    sched = Scheduler(pool, metrics, SchedulerSettings(), AimdSettings(enabled=False))
    base = queueing_policy("a")
    policy = msgspec.structs.replace(base, limits=msgspec.structs.replace(base.limits, queue_wait=0.3))
    gen = Generation(pool, Job(MODEL, SamplingParams(max_tokens=8), prompt="p"), metrics, 0, Deadlines(),
                     scheduler=sched, policy=policy, rank=policy.rank, failover_wait=5.0)
    gen.completion_ids = [1, 2]  # (mid-stream: what the client had)
    pieces = gen.stream(resumes=True)
    first = asyncio.ensure_future(pieces.__anext__())
    await asyncio.sleep(0.5)  # the replica restarts, longer than queue_wait
    slot.state = "ready"
    held = pool.choose(MODEL, 8)  # and is full at once (another request got there first)
    pool.notify_ready()
    await asyncio.sleep(0.1)  # the continuation now waits in the line for room
    assert not first.done(), first.exception() if first.done() else None
    held.release()  # room 0.1 s later
    await asyncio.sleep(0.1)
    assert gen.replica == "r0" and not first.done()  # dispatched there: not refused as over capacity
    assert metrics.rate_limited.labels("a", "queue_wait")._value.get() == 0
    first.cancel()  # (the client leaves: the generator's close releases the replica)
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await pieces.aclose()
    assert slot.inflight == 0
