"""The StateStore contract, run on every backend (memory and a real Redis).

Every test takes ``backend`` (see conftest.py) and a fresh tenant. Levels
and waits are checked exactly on the memory store's fake clock and within
``backend.slack`` seconds of refill on Redis, whose clock is the server's.
"""

from __future__ import annotations

import asyncio
import math
import uuid

import msgspec
import pytest

from router.state import AdmitRequest, StateStore
from tests.contract.conftest import Backend

def req(
    *, rpm: int = 0, tpm: int = 0, max_concurrent: int = 0, cost: int = 0, ttl: float = 30.0, lease: str = "",
    line: bool = False,
) -> AdmitRequest:
    return AdmitRequest(
        rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, cost_tokens=cost,
        lease_id=lease or uuid.uuid4().hex, lease_ttl=ttl, line=line,
    )


def between(value: float, bounds: tuple[float, float]) -> bool:
    lo, hi = bounds
    return lo <= value <= hi


async def active(store: StateStore, tenant: str) -> int:
    return (await store.usage(tenant, rpm=0, tpm=0)).active_streams


# -- admission within and over limits -----------------------------------------


async def test_admits_within_limits(backend: Backend) -> None:
    t = backend.tenant()
    for i in range(3):
        d = await backend.store.admit(t, req(rpm=10, tpm=1000, max_concurrent=5, cost=100))
        assert d.ok, d
        assert d.reason == "" and d.retry_after == 0
        assert between(d.remaining_requests, backend.level_range(10 - (i + 1), 10)), d
        assert between(d.remaining_tokens, backend.level_range(1000 - 100 * (i + 1), 1000)), d
    assert d.reset_requests > 0 and d.reset_tokens > 0
    # Unlimited (all zero) always admits.
    for _ in range(5):
        assert (await backend.store.admit(backend.tenant(), req(cost=10**9))).ok


async def test_request_over_rpm_is_refused_with_retry_after(backend: Backend) -> None:
    t, rpm = backend.tenant(), 5
    for _ in range(rpm):
        assert (await backend.store.admit(t, req(rpm=rpm))).ok
    d = await backend.store.admit(t, req(rpm=rpm))
    assert not d.ok
    assert d.reason == "requests"
    assert between(d.retry_after, backend.wait_range(60 / rpm)), d  # one request refills in 60/rpm s
    assert d.remaining_requests < 1


async def test_tokens_over_tpm_is_refused_with_retry_after_from_bucket(backend: Backend) -> None:
    t, tpm = backend.tenant(), 600  # 10 tokens/s
    assert (await backend.store.admit(t, req(tpm=tpm, cost=500))).ok
    d = await backend.store.admit(t, req(tpm=tpm, cost=200))
    assert not d.ok
    assert d.reason == "tokens"
    # 100 left, 200 needed: 100 short at 10 tokens/s.
    assert between(d.retry_after, backend.wait_range(10.0)), d
    assert between(d.remaining_tokens, backend.level_range(100, tpm)), d
    # A request that fits the rest is still admitted.
    assert (await backend.store.admit(t, req(tpm=tpm, cost=90))).ok


async def test_cost_above_tpm_is_too_large_forever(backend: Backend) -> None:
    t = backend.tenant()
    d = await backend.store.admit(t, req(rpm=10, tpm=100, cost=101))
    assert not d.ok
    assert d.reason == "too_large"
    assert d.retry_after == math.inf
    u = await backend.store.usage(t, rpm=10, tpm=100)
    assert (u.requests_available, u.tokens_available, u.active_streams) == (10, 100, 0)
    # Exactly the capacity fits.
    assert (await backend.store.admit(t, req(rpm=10, tpm=100, cost=100))).ok


async def test_too_large_wins_over_other_refusals(backend: Backend) -> None:
    t = backend.tenant()
    assert (await backend.store.admit(t, req(rpm=1, tpm=100, max_concurrent=1, cost=1))).ok
    d = await backend.store.admit(t, req(rpm=1, tpm=100, max_concurrent=1, cost=500))
    assert (d.ok, d.reason, d.retry_after) == (False, "too_large", math.inf)


# -- all or nothing ------------------------------------------------------------


async def test_tokens_refusal_takes_no_request_and_no_lease(backend: Backend) -> None:
    t, rpm, tpm = backend.tenant(), 10, 100
    assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=5, cost=90))).ok
    for _ in range(5):
        d = await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=5, cost=50))
        assert (d.ok, d.reason) == (False, "tokens"), d
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert between(u.requests_available, backend.level_range(9, rpm)), u
    assert between(u.tokens_available, backend.level_range(10, tpm)), u
    assert u.active_streams == 1


async def test_requests_refusal_takes_no_tokens(backend: Backend) -> None:
    t, rpm, tpm = backend.tenant(), 1, 1000
    assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, cost=10))).ok
    d = await backend.store.admit(t, req(rpm=rpm, tpm=tpm, cost=10))
    assert (d.ok, d.reason) == (False, "requests")
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert between(u.tokens_available, backend.level_range(990, tpm)), u
    assert u.active_streams == 1


async def test_concurrency_refusal_takes_nothing(backend: Backend) -> None:
    t, rpm, tpm = backend.tenant(), 10, 1000
    assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=1, cost=100))).ok
    for _ in range(3):
        d = await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=1, cost=100))
        assert (d.ok, d.reason) == (False, "concurrency"), d
        assert d.retry_after > 0
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert between(u.requests_available, backend.level_range(9, rpm)), u
    assert between(u.tokens_available, backend.level_range(900, tpm)), u
    assert u.active_streams == 1


# -- concurrency leases --------------------------------------------------------


async def test_max_concurrent_leases_then_release_frees_one(backend: Backend) -> None:
    t, n = backend.tenant(), 3
    leases = [uuid.uuid4().hex for _ in range(n)]
    for lid in leases:
        assert (await backend.store.admit(t, req(max_concurrent=n, lease=lid))).ok
    assert await active(backend.store, t) == n
    d = await backend.store.admit(t, req(max_concurrent=n))
    assert (d.ok, d.reason) == (False, "concurrency")

    await backend.store.release(t, leases[0])
    assert await active(backend.store, t) == n - 1
    await backend.store.release(t, leases[0])  # idempotent
    await backend.store.release(t, "no-such-lease")
    assert await active(backend.store, t) == n - 1

    assert (await backend.store.admit(t, req(max_concurrent=n))).ok
    d = await backend.store.admit(t, req(max_concurrent=n))
    assert (d.ok, d.reason) == (False, "concurrency")


async def test_a_lease_that_replaces_another_is_not_counted_against_it_and_takes_its_place(
        backend: Backend) -> None:
    # (a resumed stream's continuation replaces the lease its dead router
    # left: counted against it, it was refused until that lease's TTL ran out)
    t, old = backend.tenant(), uuid.uuid4().hex
    assert (await backend.store.admit(t, req(max_concurrent=2, lease=old))).ok
    assert (await backend.store.admit(t, req(max_concurrent=2))).ok
    d = await backend.store.admit(t, req(max_concurrent=2))
    assert (d.ok, d.reason) == (False, "concurrency"), d
    new = uuid.uuid4().hex
    assert (await backend.store.admit(t, msgspec.structs.replace(req(max_concurrent=2, lease=new),
                                                                 replaces=(old, "never-taken")))).ok
    assert await active(backend.store, t) == 2  # the old one went
    await backend.store.release(t, old)  # (its router's late release: nothing left to free)
    assert await active(backend.store, t) == 2
    d = await backend.store.admit(t, req(max_concurrent=2))
    assert (d.ok, d.reason) == (False, "concurrency"), d
    # a refused one takes nothing: the lease it names stays
    d = await backend.store.admit(t, msgspec.structs.replace(req(max_concurrent=1), replaces=(new,)))
    assert (d.ok, d.reason) == (False, "concurrency"), d
    await backend.store.release(t, new)
    assert await active(backend.store, t) == 1


async def test_leases_expire_after_ttl_without_renew(backend: Backend) -> None:
    # (the ttl outlasts a loaded machine's stall between the two admits; and the
    # clock starts before the lease is taken: taken after the second admit, a
    # slow one made a lease that expired on time look early)
    t, ttl = backend.tenant(), 1.0
    start = backend.now()
    assert (await backend.store.admit(t, req(max_concurrent=1, ttl=ttl))).ok
    assert (await backend.store.admit(t, req(max_concurrent=1, ttl=ttl))).reason == "concurrency"
    await backend.until(lambda: _admitted(backend, t, req(max_concurrent=1, ttl=ttl)), 5.0,
                        what="the expired lease to free its slot")
    assert backend.now() - start >= ttl - 0.05  # not before the ttl (0.05: Redis' and our clock's skew)


async def _admitted(backend: Backend, tenant: str, r: AdmitRequest) -> bool:
    return (await backend.store.admit(tenant, r)).ok


async def test_lease_expiry_shows_in_usage(backend: Backend) -> None:
    t = backend.tenant()
    for _ in range(2):
        assert (await backend.store.admit(t, req(max_concurrent=5, ttl=0.3))).ok
    assert await active(backend.store, t) == 2
    await backend.until(lambda: _count_is(backend, t, 0), 5.0, what="leases to expire")


async def _count_is(backend: Backend, tenant: str, n: int) -> bool:
    return await active(backend.store, tenant) == n


async def test_renew_keeps_leases_alive(backend: Backend) -> None:
    t, ttl = backend.tenant(), 0.5
    kept, dropped = uuid.uuid4().hex, uuid.uuid4().hex
    assert (await backend.store.admit(t, req(max_concurrent=5, ttl=ttl, lease=kept))).ok
    assert (await backend.store.admit(t, req(max_concurrent=5, ttl=ttl, lease=dropped))).ok
    # Renew one every 0.1 s for 4 ttls: it stays; the other one expires meanwhile.
    start = backend.now()
    while backend.now() - start < 4 * ttl:
        await backend.store.renew(t, [kept], ttl)
        await backend.sleep(0.1)
    await backend.store.renew(t, [kept], ttl)
    assert await active(backend.store, t) == 1
    d = await backend.store.admit(t, req(max_concurrent=1, ttl=ttl))
    assert (d.ok, d.reason) == (False, "concurrency"), "the renewed lease must still hold its slot"
    # Without renewal it expires too.
    await backend.until(lambda: _count_is(backend, t, 0), 5.0, what="the renewed lease to expire once left alone")


@pytest.mark.parametrize(
    "backend",
    [
        "memory",
        pytest.param("redis", marks=[pytest.mark.redis]),
    ],
    indirect=True,
)
async def test_a_short_lease_does_not_cut_a_long_one(backend: Backend) -> None:
    t = backend.tenant()
    long_lease = uuid.uuid4().hex
    assert (await backend.store.admit(t, req(max_concurrent=5, ttl=30.0, lease=long_lease))).ok
    short_lease = uuid.uuid4().hex
    assert (await backend.store.admit(t, req(max_concurrent=5, ttl=0.3, lease=short_lease))).ok
    await backend.store.renew(t, [short_lease], 0.3)  # renewing a short lease must not cut the long one either
    await backend.until(lambda: _count_is(backend, t, 1), 5.0, what="the short lease to expire")
    await backend.sleep(1.5)  # well past the short lease's ttl (+1 s of key slack)
    assert await active(backend.store, t) == 1, "the 30 s lease must still be live"


async def test_renew_adds_back_a_lease_the_store_lost(backend: Backend) -> None:
    # A lease Redis lost (a restart, a flush, or expired while its router was
    # frozen) counted nothing while its stream ran on: other routers admitted
    # past max_concurrent. The router renews the streams it runs: they count again.
    t, ttl = backend.tenant(), 0.3
    lid = uuid.uuid4().hex
    assert (await backend.store.admit(t, req(max_concurrent=1, ttl=ttl, lease=lid))).ok
    await backend.until(lambda: _count_is(backend, t, 0), 5.0, what="lease to expire")
    await backend.store.renew(t, [lid], 30.0)
    assert await active(backend.store, t) == 1
    d = await backend.store.admit(t, req(max_concurrent=1))
    assert (d.ok, d.reason) == (False, "concurrency")
    await backend.store.release(t, lid)
    await backend.store.renew(t, [], 30.0)  # nothing to do
    assert await active(backend.store, t) == 0


# -- settle --------------------------------------------------------------------


async def test_settle_refunds_reserved_minus_used(backend: Backend) -> None:
    t, tpm = backend.tenant(), 1000
    assert (await backend.store.admit(t, req(tpm=tpm, cost=600))).ok
    await backend.store.settle(t, tpm=tpm, reserved=600, used=100)
    u = await backend.store.usage(t, rpm=0, tpm=tpm)
    assert between(u.tokens_available, backend.level_range(900, tpm)), u


async def test_settle_refund_never_above_capacity(backend: Backend) -> None:
    t, tpm = backend.tenant(), 1000
    assert (await backend.store.admit(t, req(tpm=tpm, cost=100))).ok
    await backend.store.settle(t, tpm=tpm, reserved=100, used=0)
    await backend.store.settle(t, tpm=tpm, reserved=500, used=0)  # a bogus refund: still capped
    u = await backend.store.usage(t, rpm=0, tpm=tpm)
    assert u.tokens_available == tpm, u
    # A full bucket admits exactly tpm, not more.
    assert (await backend.store.admit(t, req(tpm=tpm, cost=tpm))).ok
    d = await backend.store.admit(t, req(tpm=tpm, cost=tpm))
    assert (d.ok, d.reason) == (False, "tokens")


async def test_settle_takes_overage(backend: Backend) -> None:
    t, tpm = backend.tenant(), 1000
    assert (await backend.store.admit(t, req(tpm=tpm, cost=100))).ok
    await backend.store.settle(t, tpm=tpm, reserved=100, used=400)
    u = await backend.store.usage(t, rpm=0, tpm=tpm)
    assert between(u.tokens_available, backend.level_range(600, tpm)), u


@pytest.mark.parametrize(
    "backend",
    [
        "memory",
        pytest.param("redis", marks=[pytest.mark.redis]),
    ],
    indirect=True,
)
async def test_settle_overage_after_the_bucket_refilled(backend: Backend) -> None:
    """A stream that outlives its reservation's refill still pays for extra usage.

    tpm 6000 refills the 10 reserved tokens in 0.1 s; the stream runs 1.5 s and
    uses 1010 tokens, so 1000 are owed from a full bucket.
    """
    t, tpm = backend.tenant(), 6000
    assert (await backend.store.admit(t, req(tpm=tpm, cost=10))).ok
    await backend.sleep(1.5)  # the stream runs (a precondition, not an assertion)
    await backend.store.settle(t, tpm=tpm, reserved=10, used=1010)
    u = await backend.store.usage(t, rpm=0, tpm=tpm)
    assert between(u.tokens_available, backend.level_range(5000, tpm)), u


async def test_settle_with_no_tpm_is_a_no_op(backend: Backend) -> None:
    t = backend.tenant()
    await backend.store.settle(t, tpm=0, reserved=100, used=5)
    u = await backend.store.usage(t, rpm=0, tpm=0)
    assert (u.tokens_available, u.active_streams) == (0, 0)


# -- usage ---------------------------------------------------------------------


async def test_usage_reports_levels_and_leases(backend: Backend) -> None:
    t, rpm, tpm = backend.tenant(), 10, 100
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert (u.requests_available, u.tokens_available, u.active_streams) == (rpm, tpm, 0)
    lease = uuid.uuid4().hex
    assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=5, cost=30, lease=lease))).ok
    assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, max_concurrent=5, cost=30))).ok
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert between(u.requests_available, backend.level_range(8, rpm)), u
    assert between(u.tokens_available, backend.level_range(40, tpm)), u
    assert u.active_streams == 2
    await backend.store.release(t, lease)
    assert (await backend.store.usage(t, rpm=rpm, tpm=tpm)).active_streams == 1
    # Unlimited dimensions report 0.
    u = await backend.store.usage(t, rpm=0, tpm=0)
    assert (u.requests_available, u.tokens_available, u.active_streams) == (0, 0, 1)


async def test_usage_levels_refill_to_capacity(backend: Backend) -> None:
    t, rpm, tpm = backend.tenant(), 600, 60_000  # 10 requests/s, 1000 tokens/s
    for _ in range(3):
        assert (await backend.store.admit(t, req(rpm=rpm, tpm=tpm, cost=100))).ok
    u = await backend.store.usage(t, rpm=rpm, tpm=tpm)
    assert u.requests_available < rpm and u.tokens_available < tpm
    await backend.until(lambda: _full(backend, t, rpm, tpm), 5.0, what="buckets to refill")


async def _full(backend: Backend, tenant: str, rpm: int, tpm: int) -> bool:
    u = await backend.store.usage(tenant, rpm=rpm, tpm=tpm)
    assert u.requests_available <= rpm and u.tokens_available <= tpm, u
    return u.requests_available == rpm and u.tokens_available == tpm


# -- atomicity under concurrency ----------------------------------------------


async def test_concurrent_burst_admits_exactly_the_limit(backend: Backend) -> None:
    t = backend.tenant()
    results = await asyncio.gather(*(backend.store.admit(t, req(rpm=20)) for _ in range(50)))
    assert sum(d.ok for d in results) == 20
    assert {d.reason for d in results if not d.ok} == {"requests"}


async def test_concurrent_burst_takes_exactly_max_concurrent_leases(backend: Backend) -> None:
    t = backend.tenant()
    results = await asyncio.gather(*(backend.store.admit(t, req(max_concurrent=7)) for _ in range(50)))
    assert sum(d.ok for d in results) == 7
    assert {d.reason for d in results if not d.ok} == {"concurrency"}
    assert await active(backend.store, t) == 7


# -- the tenant's line (on_limit: queue) ---------------------------------------------------------------------


async def test_a_refused_request_in_line_holds_back_later_ones(backend: Backend) -> None:
    """The first refused takes the first free slot; one that comes later is
    refused (``queued``) though its limits pass, and takes nothing."""
    s, t = backend.store, backend.tenant()
    running = req(max_concurrent=1, line=True)
    assert (await s.admit(t, running)).ok
    first = req(max_concurrent=1, line=True)
    d = await s.admit(t, first)
    assert not d.ok and d.reason == "concurrency"
    await s.release(t, running.lease_id)
    later = await s.admit(t, req(rpm=10, max_concurrent=1, line=True))
    assert not later.ok and later.reason == "queued" and 0 < later.retry_after <= 1.0, later
    assert await active(s, t) == 0
    assert between((await s.usage(t, rpm=10, tpm=0)).requests_available, backend.level_range(10, 10))
    assert (await s.admit(t, first)).ok  # its turn
    assert await active(s, t) == 1


async def test_the_line_keeps_its_order_and_an_admitted_request_leaves_it(backend: Backend) -> None:
    s, t = backend.store, backend.tenant()
    holder = req(max_concurrent=1, line=True)
    assert (await s.admit(t, holder)).ok
    a, b = req(max_concurrent=1, line=True), req(max_concurrent=1, line=True)
    assert not (await s.admit(t, a)).ok
    assert not (await s.admit(t, b)).ok
    await s.release(t, holder.lease_id)
    d = await s.admit(t, b)
    assert not d.ok and d.reason == "queued"  # a is ahead
    assert (await s.admit(t, a)).ok
    await s.release(t, a.lease_id)
    assert (await s.admit(t, b)).ok  # a left the line when admitted
    await s.release(t, b.lease_id)
    assert (await s.admit(t, req(max_concurrent=1, line=True))).ok  # and b too: the line is empty


async def test_a_request_that_leaves_the_line_holds_nobody_back(backend: Backend) -> None:
    s, t = backend.store, backend.tenant()
    holder = req(max_concurrent=1, line=True)
    assert (await s.admit(t, holder)).ok
    gone = req(max_concurrent=1, line=True)
    assert not (await s.admit(t, gone)).ok
    await s.leave(t, gone.lease_id)
    await s.leave(t, gone.lease_id)  # (idempotent)
    await s.release(t, holder.lease_id)
    assert (await s.admit(t, req(max_concurrent=1, line=True))).ok


async def test_a_place_in_the_line_expires_after_its_retry(backend: Backend) -> None:
    """A waiting request whose router stopped asking (it crashed) holds the
    others back for its retry_after plus LINE_SLACK at most."""
    from router.state.base import LINE_SLACK

    s, t = backend.store, backend.tenant()
    holder = req(max_concurrent=1, line=True)
    assert (await s.admit(t, holder)).ok
    crashed = await s.admit(t, req(max_concurrent=1, line=True))
    assert not crashed.ok
    await s.release(t, holder.lease_id)
    assert (await s.admit(t, req(max_concurrent=1, line=True))).reason == "queued"
    await backend.sleep(crashed.retry_after + LINE_SLACK + backend.slack)
    assert (await s.admit(t, req(max_concurrent=1, line=True))).ok


async def test_without_a_line_a_request_ignores_the_line(backend: Backend) -> None:
    """A tenant that does not queue (``line`` False) is not held back, and
    a refused request of it does not join."""
    s, t = backend.store, backend.tenant()
    holder = req(max_concurrent=1, line=True)
    assert (await s.admit(t, holder)).ok
    assert not (await s.admit(t, req(max_concurrent=1, line=True))).ok
    await s.release(t, holder.lease_id)
    assert (await s.admit(t, req(max_concurrent=1))).ok
    t2 = backend.tenant()
    holder = req(max_concurrent=1)
    assert (await s.admit(t2, holder)).ok
    assert not (await s.admit(t2, req(max_concurrent=1))).ok
    await s.release(t2, holder.lease_id)
    assert (await s.admit(t2, req(max_concurrent=1, line=True))).ok


async def test_a_request_too_large_for_the_tenant_never_joins_the_line(backend: Backend) -> None:
    s, t = backend.store, backend.tenant()
    d = await s.admit(t, req(tpm=100, cost=101, line=True))
    assert not d.ok and d.reason == "too_large"
    assert (await s.admit(t, req(tpm=100, cost=50, line=True))).ok


@pytest.mark.redis
async def test_two_redis_stores_share_one_line(redis_server) -> None:
    """A request refused on one router is first to the slot that a stream on
    the other frees: the other router's next request is refused."""
    from router.state.redis_store import RedisStore

    a = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    try:
        t = Backend.tenant("line")
        running = req(max_concurrent=1, line=True)
        assert (await a.admit(t, running)).ok
        waiting = req(max_concurrent=1, line=True)
        assert not (await b.admit(t, waiting)).ok
        await a.release(t, running.lease_id)
        assert (await a.admit(t, req(max_concurrent=1, line=True))).reason == "queued"
        assert (await b.admit(t, waiting)).ok
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_a_redis_store_keeps_at_most_max_connections(redis_server) -> None:
    """A burst of calls waits for the pool's connections instead of opening
    one each (redis-py's default pool kept every one it ever opened)."""
    import redis.asyncio as aioredis

    from router.state.redis_store import RedisStore

    store = RedisStore(redis_server.url, prefix="fs-test", timeout=5.0, max_connections=4)
    probe = aioredis.Redis.from_url(redis_server.url)
    try:
        t = Backend.tenant("pool")
        results = await asyncio.gather(*(store.admit(t, req(rpm=1000)) for _ in range(150)))
        assert all(d.ok for d in results)
        clients = (await probe.info("clients"))["connected_clients"]
        assert clients <= 4 + 1, clients  # (+1: the probe)
    finally:
        await probe.aclose()
        await store.close()


@pytest.mark.redis
async def test_a_redis_store_hears_the_turns_of_a_tenant_with_a_line(redis_server) -> None:
    """A lease released, tokens given back, a request that leaves or is
    admitted from the line: the other routers hear it while the tenant has
    a line (and only then: a tenant nobody waits for costs no message)."""
    from router.state.redis_store import RedisStore

    a = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    heard: list[str] = []
    try:
        b.watch(heard.append)
        await asyncio.sleep(0.2)  # (subscribed)
        t, quiet = Backend.tenant("turns"), Backend.tenant("no-line")
        running = req(max_concurrent=1, tpm=1000, cost=100, line=True)
        assert (await a.admit(t, running)).ok
        lone = req(max_concurrent=1)
        assert (await a.admit(quiet, lone)).ok
        await a.release(quiet, lone.lease_id)  # (no line: nothing said)
        waiting = req(max_concurrent=1, tpm=1000, cost=100, line=True)
        assert not (await a.admit(t, waiting)).ok  # (now the tenant has a line)
        await a.settle(t, tpm=1000, reserved=100, used=10, lease_id=running.lease_id)
        await a.release(t, running.lease_id)
        later = req(max_concurrent=1, tpm=1000, cost=100, line=True)
        assert not (await a.admit(t, later)).ok  # (behind the waiting one)
        await a.leave(t, waiting.lease_id)  # (gives up: later is the front)
        await asyncio.sleep(0.3)
        assert heard == [t, t, t], heard
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_two_redis_stores_share_one_limit(redis_server) -> None:
    """Two routers (two RedisStore instances, two connection pools) on one tenant."""
    from router.state.redis_store import RedisStore

    a = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    try:
        t = Backend.tenant("shared")
        calls = [s.admit(t, req(rpm=25, tpm=100_000, cost=10)) for _ in range(40) for s in (a, b)]
        results = await asyncio.gather(*calls)
        assert sum(d.ok for d in results) == 25
        assert {d.reason for d in results if not d.ok} == {"requests"}
        by_store = [sum(d.ok for d in results[i::2]) for i in (0, 1)]
        assert sum(by_store) == 25

        t2 = Backend.tenant("shared-leases")
        calls = [s.admit(t2, req(max_concurrent=9)) for _ in range(30) for s in (a, b)]
        results = await asyncio.gather(*calls)
        assert sum(d.ok for d in results) == 9
        assert (await a.usage(t2, rpm=0, tpm=0)).active_streams == 9
        assert (await b.usage(t2, rpm=0, tpm=0)).active_streams == 9
    finally:
        await a.close()
        await b.close()


# -- routers and their tenants files --------------------------------------------------------------------------


async def test_peers_lists_the_live_routers_digests(backend: Backend) -> None:
    router = f"r-{uuid.uuid4().hex[:8]}"
    mine = await backend.store.peers(router, "d1", 30.0)
    assert mine.get(router) == "d1"
    if backend.name == "memory":
        assert mine == {router: "d1"}  # (one process: no other router)
        return
    other, leaving = f"r-{uuid.uuid4().hex[:8]}", f"r-{uuid.uuid4().hex[:8]}"
    await backend.store.peers(router, "d1", 1.0)
    await backend.store.peers(leaving, "d1", 1.0)
    both = await backend.store.peers(other, "d2", 1.0)  # (a router that then stops publishing)
    assert both[router] == "d1" and both[other] == "d2" and both[leaving] == "d1"
    assert leaving not in await backend.store.peers(leaving, "", 0)  # (one that stops and says so)
    await backend.sleep(0.7)
    await backend.store.peers(router, "d1", 1.0)
    await backend.sleep(0.7)  # (past other's entry, not past router's: the key itself must outlive both)
    after = await backend.store.peers(router, "d1", 1.0)
    assert after == {router: "d1"}, after  # other gone once its ttl passed, leaving at once


async def test_a_continuation_replaces_every_lease_it_names(backend: Backend) -> None:
    # (a stream taken over twice: the leases of the router that started it
    # and of the one that continued it, both dead, held two slots)
    t, first, second = backend.tenant(), uuid.uuid4().hex, uuid.uuid4().hex
    for lid in (first, second):
        assert (await backend.store.admit(t, req(max_concurrent=2, lease=lid))).ok
    third = msgspec.structs.replace(req(max_concurrent=1), replaces=(second, first))
    assert (await backend.store.admit(t, third)).ok
    assert await active(backend.store, t) == 1


async def test_an_admission_without_a_lease_takes_a_request_and_no_slot(backend: Backend) -> None:
    # (a resume's charge: it held a concurrency slot for its round trip on Redis,
    # where another request of the tenant at its max_concurrent was refused)
    t = backend.tenant()
    charge = AdmitRequest(rpm=2, tpm=0, max_concurrent=0, cost_tokens=0, lease_id="", lease_ttl=30.0)
    assert (await backend.store.admit(t, charge)).ok
    assert await active(backend.store, t) == 0
    assert (await backend.store.admit(t, req(rpm=2, max_concurrent=1))).ok  # the request left, and the slot
    assert await active(backend.store, t) == 1
    refused = await backend.store.admit(t, charge)
    assert not refused.ok and refused.reason == "requests", refused
