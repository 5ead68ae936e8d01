"""ResilientStore undoes an admission Redis ran late (``undo_admit``) once,
even when the undo itself is made twice with different ``keep_lease``: its
reply lost in a second hang, and the stream ended before it was made again
(the contract tests, tests/contract/test_late_admission.py, stop a real
Redis; this race needs a store whose replies are lost when the test says)."""

from __future__ import annotations

import asyncio
import uuid

from router.state import AdmitRequest, ResilientStore, StoreUnavailable
from router.state.memory import MemoryStore


class LateRedis(MemoryStore):
    """A primary whose ``admit`` / ``undo_admit`` run, then lose their reply
    (a hang past the timeout) while listed in ``late``; ``down`` fails pings.
    An undo whose reply is lost leaves it down (the second hang goes on)."""

    name = "redis"
    shared = True

    def __init__(self) -> None:
        super().__init__()
        self.late: set[str] = set()
        self.down = False

    async def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("down")

    async def admit(self, tenant, req):
        decision = await super().admit(tenant, req)
        if "admit" in self.late:
            raise StoreUnavailable("timed out (ran all the same)")
        return decision

    async def undo_admit(self, tenant, req, *, keep_lease=False):
        await super().undo_admit(tenant, req, keep_lease=keep_lease)
        if "undo" in self.late:
            self.late.discard("undo")
            self.down = True
            raise StoreUnavailable("timed out (ran all the same)")


def req(cost: int) -> AdmitRequest:
    return AdmitRequest(rpm=6, tpm=1000, max_concurrent=0, cost_tokens=cost, lease_id=uuid.uuid4().hex,
                        lease_ttl=30.0)


async def _until(cond) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_an_undo_made_again_after_its_stream_ended_gives_the_charge_back_once() -> None:
    primary = LateRedis()
    store = ResilientStore(primary, fail_open=True, probe_interval=0.05)
    try:
        t = "acme"
        assert (await store.admit(t, req(200))).ok  # (a stream that runs on: 5 requests, 800 tokens left)
        r = req(300)
        primary.late = {"admit", "undo"}
        primary.down = True
        assert (await store.admit(t, r)).ok  # (timed out on Redis, which ran it: 4, 500; the fallback admits)
        primary.late.discard("admit")
        primary.down = False  # (Redis wakes: the probe undoes it, keeping its lease, and that reply is lost)
        await _until(lambda: "undo" not in primary.late)
        assert not store.healthy
        # its stream ends meanwhile, on the fallback: the undo made again now ends the lease
        await store.settle(t, tpm=1000, reserved=300, used=10, lease_id=r.lease_id)
        await store.release(t, r.lease_id)
        primary.down = False
        await _until(lambda: store.healthy)
        u = await primary.usage(t, rpm=6, tpm=1000)
        assert u.active_streams == 1, u
        assert 4.99 < u.requests_available < 5.1 and 799 < u.tokens_available < 810, u  # (r's charge back once)
    finally:
        await store.close()
