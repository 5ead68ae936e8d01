"""The lease keeper (router/leases.py) on a ``MemoryStore``: how often it
renews, what it does with a lease whose stream ended while a renewal was on
its way, and the lease chain a resume's claim records.

Before these, only long integration tests touched the keeper and
``lease_chain`` (a mutation audit: renewing every ``LEASE_TTL`` instead of
every third of it, or leaving an ended stream's lease renewed, passed them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router import leases
from router.leases import LEASE_CHAIN, LeaseKeeper, lease_chain
from router.state.memory import MemoryStore
from tests.helpers import apoll


class RecordingStore(MemoryStore):
    """Records when each renewal came (loop time) and the TTL it gave."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals: list[tuple[float, float]] = []

    async def renew(self, tenant, lease_ids, ttl) -> None:
        self.renewals.append((asyncio.get_running_loop().time(), ttl))
        await super().renew(tenant, lease_ids, ttl)


async def test_live_leases_are_renewed_every_third_of_their_ttl(monkeypatch) -> None:
    # (a renewal every TTL would let a lease expire between two whenever one
    # came a little late: the tenant's stream no longer counted against
    # max_concurrent on any router. Scaled down: TTL 0.9 s, renewals every 0.3 s)
    monkeypatch.setattr(leases, "LEASE_TTL", 0.9)
    monkeypatch.setattr(leases, "GENERATION_INTERVAL", 0.02)
    store = RecordingStore()
    keeper = LeaseKeeper(store, {"L": SimpleNamespace(tenant="t")})  # type: ignore[arg-type]
    keeper.start()
    try:
        await apoll(lambda: len(store.renewals) >= 4, 10, what="four renewals")
    finally:
        await keeper.close()
    times = [at for at, _ in store.renewals]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(ttl == 0.9 for _, ttl in store.renewals), store.renewals
    # the first when the keeper first looks, then one every 0.3 s: never sooner; later
    # only by a look's interval and a loaded machine's delays (every TTL: 2.7 s for three)
    assert min(gaps) >= 0.3 - 0.01, gaps
    assert times[3] - times[0] < 1.8, gaps


class FlushedStore(MemoryStore):
    """A store whose generation the test sets (``flush``), counting the looks."""

    def __init__(self) -> None:
        super().__init__()
        self.gen, self.looks, self.renewals = "g1", 0, 0

    async def generation(self) -> str:
        self.looks += 1
        return self.gen

    async def renew(self, tenant, lease_ids, ttl) -> None:
        self.renewals += 1
        await super().renew(tenant, lease_ids, ttl)


async def test_a_store_that_lost_its_data_just_after_a_lease_was_taken_is_seen(monkeypatch, caplog) -> None:
    # (the keeper looked only while leases were live: a flush between a
    # lease's taking and the first look after it went unseen, that look
    # taking the new generation for the first one; nothing said the store
    # had lost the stream's lease. A CI run of the shutdown test that
    # flushes Redis mid-stream met it)
    monkeypatch.setattr(leases, "GENERATION_INTERVAL", 0.02)
    store = FlushedStore()
    live: dict[str, SimpleNamespace] = {}
    keeper = LeaseKeeper(store, live)  # type: ignore[arg-type]
    keeper.start()
    try:
        await apoll(lambda: store.looks >= 2, 5, what="looks while no lease is live")
        assert store.renewals == 0
        live["L"] = SimpleNamespace(tenant="t")
        store.gen = "g2"  # (flushed before the keeper's next look)
        await apoll(lambda: store.renewals, 5, what="the lease added back")
    finally:
        await keeper.close()
    assert any("lost the leases" in r.getMessage() for r in caplog.records), caplog.text


class GatedStore(MemoryStore):
    """A store whose renewals wait for ``go``, as a Redis call takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.renewing = asyncio.Event()

    async def renew(self, tenant, lease_ids, ttl) -> None:
        self.renewing.set()
        await self.go.wait()
        await super().renew(tenant, lease_ids, ttl)


async def test_a_lease_released_while_its_renewal_was_on_its_way_does_not_come_back() -> None:
    # (the renewal adds back a lease the store lacks: one whose stream ended
    # and was released meanwhile came back for the TTL, 30 s, and a tenant
    # with max_concurrent: 1 was refused all that time)
    store = GatedStore()
    live = {"L": SimpleNamespace(tenant="t")}
    store.hold("t", ["L"], 30.0)
    renewing = asyncio.create_task(LeaseKeeper(store, live).renew())  # type: ignore[arg-type]
    await asyncio.wait_for(store.renewing.wait(), 5)
    del live["L"]  # the stream ends: its lease is released
    await store.release("t", "L")
    store.go.set()
    await asyncio.wait_for(renewing, 5)
    assert (await store.usage("t", rpm=0, tpm=0)).active_streams == 0


async def test_a_lease_still_live_after_the_renewal_stays() -> None:
    store = GatedStore()
    store.go.set()
    live = {"L": SimpleNamespace(tenant="t"), "M": SimpleNamespace(tenant="u")}
    await LeaseKeeper(store, live).renew()  # type: ignore[arg-type]
    assert (await store.usage("t", rpm=0, tpm=0)).active_streams == 1
    assert (await store.usage("u", rpm=0, tpm=0)).active_streams == 1


def test_a_lease_chain_names_each_lease_once_its_own_first() -> None:
    assert lease_chain("c", ()) == "c"
    assert lease_chain("c", ("b", "a")) == "c b a"
    assert lease_chain("c", ("b", "c", "b", "a")) == "c b a"


@pytest.mark.parametrize("prior", [96, LEASE_CHAIN, LEASE_CHAIN - 1])
def test_a_lease_chain_keeps_the_newest_ids_up_to_its_cap(prior: int) -> None:
    # (a claim refused again and again adds an id each time: the chain stays
    # LEASE_CHAIN long, the newest kept, rather than grow with every resume)
    ids = tuple(f"l{i}" for i in range(prior))
    assert lease_chain("new", ids).split() == ["new", *ids][:LEASE_CHAIN]
    # (a client resuming every second: the chain still names a dead router's lease until its TTL ends)
    assert LEASE_CHAIN > leases.LEASE_TTL
