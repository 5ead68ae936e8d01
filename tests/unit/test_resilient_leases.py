"""ResilientStore in fail-open: an outage that begins while a call is on its
way to Redis still leaves the fallback counting this router's streams (the
contract tests, tests/contract/test_resilient_store.py, kill a real Redis;
these races need a store that answers when the test says)."""

from __future__ import annotations

import asyncio
import uuid

from router.state import AdmitRequest, ResilientStore, StoreUnavailable
from router.state.memory import MemoryStore


class Flaky(MemoryStore):
    """A primary that is ``down`` when told, and whose ``admit`` or ``renew``
    waits for ``hold`` (a call on its way when the outage begins)."""

    name = "redis"
    shared = True

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.hold_admit: asyncio.Event | None = None
        self.hold_renew: asyncio.Event | None = None

    async def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("down")

    async def admit(self, tenant, req):
        if self.hold_admit is not None:
            await self.hold_admit.wait()
        elif self.down:
            raise StoreUnavailable("down")
        return await super().admit(tenant, req)

    async def renew(self, tenant, lease_ids, ttl):
        if self.hold_renew is not None:
            await self.hold_renew.wait()
        return await super().renew(tenant, lease_ids, ttl)


def req(lease: str = "") -> AdmitRequest:
    return AdmitRequest(rpm=0, tpm=0, max_concurrent=2, cost_tokens=0, lease_id=lease or uuid.uuid4().hex,
                        lease_ttl=30.0)


async def _back(store: ResilientStore) -> None:
    while not store.healthy:
        await asyncio.sleep(0.01)


async def test_a_lease_moving_to_redis_as_an_outage_begins_stays_counted_in_the_fallback() -> None:
    # (the renewal's success took it out of the fallback: in the second
    # outage the fallback admitted a third stream for a limit of 2)
    primary = Flaky()
    store = ResilientStore(primary, fail_open=True, probe_interval=0.02)
    primary.down = True
    assert (await store.admit("t", req("A"))).ok  # outage 1: the fallback takes A
    primary.down = False
    await _back(store)
    primary.hold_renew = asyncio.Event()
    moving = asyncio.create_task(store.renew("t", ["A"], 30.0))  # the lease keeper moves A to Redis
    await asyncio.sleep(0.01)
    primary.down = True
    assert (await store.admit("t", req())).ok  # outage 2 begins: the fallback's second stream
    primary.hold_renew.set()
    await moving
    assert store.healthy is False
    d = await store.admit("t", req())
    assert (d.ok, d.reason) == (False, "concurrency"), d
    await store.close()


async def test_a_lease_redis_took_as_an_outage_began_is_counted_in_the_fallback() -> None:
    primary = Flaky()
    store = ResilientStore(primary, fail_open=True, probe_interval=10.0)
    primary.hold_admit = asyncio.Event()
    taking = asyncio.create_task(store.admit("t", req("A")))  # on its way to Redis
    await asyncio.sleep(0.01)
    primary.down = True
    await store.check()  # the outage begins: the fallback holds what Redis counts for this router so far
    assert store.healthy is False
    primary.hold_admit.set()
    assert (await taking).ok  # Redis took A after all
    assert (await store.admit("t", req())).ok
    d = await store.admit("t", req())
    assert (d.ok, d.reason) == (False, "concurrency"), d
    await store.close()


async def test_a_probe_that_fails_unexpectedly_tries_again() -> None:
    # (anything but StoreUnavailable ended the probe for good, and only the
    # start of an outage starts one: the router stayed on local limits)
    primary = Flaky()
    store = ResilientStore(primary, fail_open=True, probe_interval=0.02)
    primary.down = True
    assert (await store.admit("t", req())).ok  # (the outage begins)
    pings = 0

    async def ping() -> None:
        nonlocal pings
        pings += 1
        if pings == 1:
            raise RuntimeError("a bug")

    primary.down = False
    primary.ping = ping  # type: ignore[method-assign]
    await asyncio.wait_for(_back(store), 5.0)
    assert pings >= 2
    await store.close()
