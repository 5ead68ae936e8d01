"""Replica features (``replicas.protocol.Feature``): a request whose fields
an older replica would drop goes only to replicas that announced them, and
gets a 503 naming them where none did; other requests go anywhere."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from policies.batching import AimdSettings
from replicas.pool import NoReplica, ReplicaPool
from replicas.protocol import (
    FEATURES,
    Feature,
    Ready,
    SamplingParams,
    encode_frame,
    replica_decoder,
    required_features,
)
from replicas.spec import ReplicaSpec
from router.errors import ReplicaUnavailable
from router.job import Job
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from tests.unit.pools import MODEL, ReadyClient, queueing_policy



def _pool(*features: int) -> ReplicaPool:
    """Ready replicas r0, r1, ... announcing ``features`` each, one request at a time."""
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}", address=f"127.0.0.1:{9 + i}") for i in range(len(features))])
    for slot, f in zip(pool.slots, features):
        slot.client = ReadyClient(f)  # type: ignore[assignment]
        slot.state = "ready"
    return pool


def _scheduler(pool: ReplicaPool) -> Scheduler:
    return Scheduler(pool, Metrics(), SchedulerSettings(),
                     AimdSettings(enabled=False, initial=1, min_inflight=1, max_inflight=1))


def test_a_ready_frame_from_before_features_reads_as_none_and_ours_carries_them() -> None:
    old = msgspec.msgpack.encode([10, 1, MODEL, "sim", 4096, 7])  # (Ready's tag, then its five old fields)
    assert msgspec.msgpack.decode(old, type=Ready).features == 0
    ours = replica_decoder().decode(encode_frame(Ready(1, MODEL, "sim", 4096, 7, int(FEATURES)))[4:])
    assert Feature(ours.features) == FEATURES


def test_what_a_request_needs() -> None:
    assert required_features(SamplingParams(), None) == 0
    assert required_features(SamplingParams(), {}) == 0  # (no variables: nothing to lose)
    assert required_features(SamplingParams(min_p=0.1), None) == Feature.MIN_P
    assert required_features(SamplingParams(include_stop_str_in_output=True), {"x": 1}) == (
        Feature.INCLUDE_STOP_STR | Feature.TEMPLATE_KWARGS)
    job = Job(MODEL, SamplingParams(include_stop_str_in_output=True), prompt="p")
    assert job.needs == Feature.INCLUDE_STOP_STR
    assert Feature(job.needs).names() == "include_stop_str_in_output"


def test_the_pool_sends_a_request_only_where_its_fields_are_taken() -> None:
    pool = _pool(0, int(FEATURES))  # r0: an older replica
    needs = int(Feature.TEMPLATE_KWARGS)
    for _ in range(20):
        h = pool.choose(MODEL, 8, needs=needs)
        assert h.slot.name == "r1"
        h.release()
        h = pool.try_choose(MODEL, 8, needs=needs)
        assert h is not None and h.slot.name == "r1"
        h.release()
    # a failover that excludes the only replica taking them still goes there (as without features)
    h = pool.choose(MODEL, 8, exclude={"r1": None}, needs=needs)
    assert h.slot.name == "r1"
    h.release()
    # requests that need nothing go to either
    held = [pool.choose(MODEL, 8), pool.choose(MODEL, 8)]
    assert {h.slot.name for h in held} == {"r0", "r1"}
    for h in held:
        h.release()


def test_no_replica_taking_the_fields_is_said_so() -> None:
    pool = _pool(0, int(Feature.MIN_P))
    with pytest.raises(NoReplica, match="no ready replica of model 'm' takes include_stop_str_in_output: .*older"):
        pool.choose(MODEL, 8, needs=int(Feature.INCLUDE_STOP_STR | Feature.MIN_P))  # (r1 takes min_p)
    both = _pool(int(Feature.MIN_P), int(Feature.INCLUDE_STOP_STR))  # (each takes one: neither both)
    with pytest.raises(NoReplica, match="takes min_p, include_stop_str_in_output: "):
        both.choose(MODEL, 8, needs=int(Feature.INCLUDE_STOP_STR | Feature.MIN_P))
    with pytest.raises(NoReplica, match="no ready replica serves model 'other'"):
        pool.choose("other", 8, needs=int(Feature.MIN_P))
    assert pool.choose(MODEL, 8, needs=int(Feature.MIN_P)).slot.name == "r1"


async def test_the_scheduler_refuses_with_503_where_no_replica_takes_the_fields() -> None:
    sched = _scheduler(_pool(0))
    with pytest.raises(ReplicaUnavailable, match="takes min_p"):
        await sched.acquire(queueing_policy("a"), 1, MODEL, 8, needs=int(Feature.MIN_P))
    held = await sched.acquire(queueing_policy("a"), 1, MODEL, 8)  # (the queue's path too)
    with pytest.raises(ReplicaUnavailable, match="takes min_p"):
        await sched.acquire(queueing_policy("b"), 1, MODEL, 8, needs=int(Feature.MIN_P))
    assert sched.queued("b") == 0
    held.release()


async def test_a_queued_request_waiting_for_a_replica_with_its_fields_does_not_hold_back_the_others() -> None:
    pool = _pool(0, int(FEATURES))  # r0 old, r1 new; one request each at a time
    sched = _scheduler(pool)
    a, b = queueing_policy("a"), queueing_policy("b")
    on_new = await sched.acquire(a, 1, MODEL, 8, needs=int(Feature.MIN_P))
    on_old = await sched.acquire(a, 1, MODEL, 8)
    assert (on_new.slot.name, on_old.slot.name) == ("r1", "r0")
    # both full: a's next needs r1, b's next needs nothing; a queued first
    needing = asyncio.create_task(sched.acquire(a, 1, MODEL, 8, needs=int(Feature.MIN_P)))
    await asyncio.sleep(0)
    plain = asyncio.create_task(sched.acquire(b, 1, MODEL, 8))
    await asyncio.sleep(0)
    on_old.release()  # r0 has room: b's request takes it, a's keeps waiting for r1
    await asyncio.sleep(0.05)
    assert plain.done() and plain.result().slot.name == "r0"
    assert not needing.done() and sched.queued("a") == 1
    on_new.release()
    handle = await asyncio.wait_for(needing, 1)
    assert handle.slot.name == "r1" and sched.queued("a") == 0
    handle.release()
    plain.result().release()


async def test_a_model_with_no_room_has_none_for_requests_that_need_features_either() -> None:
    pool = _pool(int(FEATURES))
    sched = _scheduler(pool)
    held = await sched.acquire(queueing_policy("a"), 1, MODEL, 8)
    first = asyncio.create_task(sched.acquire(queueing_policy("a"), 1, MODEL, 8))
    second = asyncio.create_task(sched.acquire(queueing_policy("b"), 1, MODEL, 8, needs=int(Feature.MIN_P)))
    await asyncio.sleep(0)
    assert sched.queued("a") == sched.queued("b") == 1
    held.release()
    await asyncio.sleep(0.05)
    assert first.done() != second.done()  # one of them got the slot; the other waits
    (first if first.done() else second).result().release()
    for t in (first, second):
        (await asyncio.wait_for(t, 1)).release()


class OtherModel(ReadyClient):
    """A ready replica of another model."""

    model = "other"

    def __init__(self) -> None:
        super().__init__()
        self.ready = Ready(1, "other", "sim", 4096, 1, int(FEATURES))


async def test_a_dispatch_pass_tries_a_full_model_once_whatever_its_requests_need() -> None:
    # (every replica of MODEL full: a request of it that needs features would
    # find none either, so the pass that found one of MODEL without needs
    # full ends there; the other model's free replica keeps the cluster "with
    # room", so without that the pass tried the request that needs features too)
    pool = _pool(int(FEATURES), 0)
    pool.slots[1].client = OtherModel()  # type: ignore[assignment]
    sched = _scheduler(pool)
    a, b = queueing_policy("a"), queueing_policy("b")
    held = await sched.acquire(a, 1, MODEL, 8)
    plain = asyncio.create_task(sched.acquire(a, 1, MODEL, 8))
    await asyncio.sleep(0)
    tries = []
    try_choose = pool.try_choose

    def counted(model: str, *args):
        tries.append(model)
        return try_choose(model, *args)

    pool.try_choose = counted  # type: ignore[method-assign]
    needing = asyncio.create_task(sched.acquire(b, 1, MODEL, 8, needs=int(Feature.MIN_P)))
    await asyncio.sleep(0)
    assert sched.queued() == 2 and tries == [MODEL]  # (a's head, queued first; b's not tried)
    held.release()
    for task in (plain, needing):
        (await asyncio.wait_for(task, 1)).release()
