"""A replica a stream's stall limit caught producing nothing is chosen for
nothing (new requests, failovers) until it answers a ping sent after the
stall (``ReplicaPool.caught_stalling``, ``ReplicaSlot.answered``)."""

from __future__ import annotations

import time

import pytest

from replicas.pool import NoReplica, ReplicaPool, ReplicaSlot
from replicas.spec import ReplicaSpec
from tests.unit.pools import MODEL, ReadyClient


def _pool(n: int) -> ReplicaPool:
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}", address=f"127.0.0.1:{9 + i}") for i in range(n)])
    for slot in pool.slots:
        slot.client = ReadyClient()  # type: ignore[assignment]
        slot.state = "ready"
    return pool


def test_a_stalled_replica_is_chosen_for_nothing_until_it_answers_a_later_ping() -> None:
    pool = _pool(2)
    r0, r1 = pool.slots
    seen: list[ReplicaSlot] = []
    pool.on_stalled = seen.append
    before = time.monotonic()  # (a ping sent before the stall)
    pool.caught_stalling(r0, "no token for 1s")
    assert seen == [r0]
    assert (r0.ready, r0.status) == (False, "stalled")
    for _ in range(20):
        handle = pool.choose(MODEL, 10)
        assert handle.slot is r1
        handle.release()
        # (a failover off r1 does not go back to the stalled one either)
        handle = pool.choose(MODEL, 10, {"r1": None})
        assert handle.slot is r1
        handle.release()
    assert not r0.answered(before)  # (its pong may have been on its way when it froze)
    assert r0.status == "stalled"
    assert r0.answered(time.monotonic())
    assert (r0.ready, r0.status) == (True, "ready")
    assert not r0.answered(time.monotonic())  # (once)


def test_with_every_replica_stalled_none_is_ready() -> None:
    pool = _pool(1)
    (r0,) = pool.slots
    pool.caught_stalling(r0, "no token for 1s")
    with pytest.raises(NoReplica, match="no ready replica"):
        pool.choose(MODEL, 10)
    r0.client.closed = ConnectionError("gone")  # type: ignore[union-attr]
    assert r0.status == "down"  # (a closed connection says more than the stall)
