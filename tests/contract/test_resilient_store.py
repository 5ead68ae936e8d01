"""ResilientStore over a real Redis that dies mid-run and comes back.

Each test owns its redis-server (it gets killed). Fail-open keeps admitting
with per-process limits and reports ``healthy`` False; fail-closed raises
``StoreUnavailable``; once Redis answers again on the same port the
background probe flips ``healthy`` back within a few seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import router.state
from router.state import AdmitRequest, ResilientStore, StoreUnavailable
from tests.helpers import apoll
from tests.redis_server import RedisServer, require_redis_server

pytestmark = pytest.mark.redis

PROBE = 0.1  # probe interval in these tests (seconds)


def req(*, rpm: int = 0, max_concurrent: int = 0, lease: str = "") -> AdmitRequest:
    return AdmitRequest(rpm=rpm, tpm=0, max_concurrent=max_concurrent, cost_tokens=0,
                        lease_id=lease or uuid.uuid4().hex, lease_ttl=30.0)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer(require_redis_server()) as server:
        yield server


class Harness:
    def __init__(self, server: RedisServer, fail_open: bool, **options) -> None:
        from router.state.redis_store import RedisStore

        self.server = server
        self.changes: list[bool] = []
        self.errors: list[str] = []
        self.store = ResilientStore(
            RedisStore(server.url, prefix="fs-test", timeout=0.5),
            fail_open=fail_open,
            probe_interval=options.pop("probe_interval", PROBE),
            on_change=self.changes.append,
            on_error=self.errors.append,
            **options,
        )

    async def wait_healthy(self, timeout: float = 5.0) -> float:
        start = time.monotonic()
        await apoll(lambda: self.store.healthy, timeout, what="the probe to report Redis healthy again")
        return time.monotonic() - start


async def _harness(server: RedisServer, fail_open: bool, **options) -> AsyncIterator[Harness]:
    h = Harness(server, fail_open, **options)
    try:
        yield h
    finally:
        if server.running:
            server.resume()  # (a test that failed with it paused)
        await h.store.close()
        probe = h.store._probe
        assert probe is None or probe.done(), "close() must end the probe task"
        assert getattr(h.store, "_connect", None) is None, "close() must end the first contact"


@pytest.fixture(params=[True, False], ids=["fail_open", "fail_closed"])
async def harness(request, own_redis: RedisServer) -> AsyncIterator[Harness]:
    async for h in _harness(own_redis, request.param):
        yield h


@pytest.fixture
async def open_harness(own_redis: RedisServer) -> AsyncIterator[Harness]:
    async for h in _harness(own_redis, True):
        yield h


@pytest.fixture
async def closed_harness(own_redis: RedisServer) -> AsyncIterator[Harness]:
    async for h in _harness(own_redis, False):
        yield h


async def test_fail_open_admits_with_local_limits_then_recovers(open_harness: Harness) -> None:
    h, store = open_harness, open_harness.store
    t = f"open-{uuid.uuid4().hex[:8]}"
    on_redis = uuid.uuid4().hex
    assert (await store.admit(t, req(rpm=3, lease=on_redis))).ok
    assert store.healthy and h.changes == []
    assert (await store.primary.usage(t, rpm=3, tpm=0)).active_streams == 1

    h.server.kill()
    # The outage is noticed on the next call, which is served locally.
    local = [uuid.uuid4().hex for _ in range(3)]
    for lid in local:
        d = await store.admit(t, req(rpm=3, lease=lid))
        assert d.ok, d
    assert store.healthy is False
    assert h.changes == [False]
    assert "admit" in h.errors
    # Local limits still hold: a fresh bucket of 3, then refused.
    d = await store.admit(t, req(rpm=3))
    assert (d.ok, d.reason) == (False, "requests")
    # the fallback's view: the 3 and the stream Redis counts for this router
    assert (await store.usage(t, rpm=3, tpm=0)).active_streams == 4
    # Releasing the lease Redis holds cannot reach it: no exception.
    await store.release(t, on_redis)
    await store.settle(t, tpm=100, reserved=10, used=5, lease_id=on_redis)
    # A resume buffer opened now lives in the fallback.
    await store.stream_open("s-outage", b"meta", "me", 60.0)
    assert await store.stream_read("s-outage", 0) is not None

    h.server.restart()
    took = await h.wait_healthy(5.0)
    assert took < 5.0
    assert h.changes == [False, True]
    # ... and is dropped with Redis back: resumes read Redis, and it stayed in memory for good
    assert await store.fallback.stream_read("s-outage", 0) is None

    # Back on Redis (empty after the restart): admissions count there again.
    assert (await store.admit(t, req(rpm=3))).ok
    assert (await store.primary.usage(t, rpm=3, tpm=0)).active_streams == 1
    # Leases taken during the outage are released where they were counted.
    await store.release(t, local[0])
    assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 2
    assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 1


async def test_fail_closed_raises_then_recovers(closed_harness: Harness) -> None:
    h, store = closed_harness, closed_harness.store
    t = f"closed-{uuid.uuid4().hex[:8]}"
    assert (await store.admit(t, req(max_concurrent=5))).ok

    h.server.kill()
    with pytest.raises(StoreUnavailable):
        await store.admit(t, req(max_concurrent=5))
    assert store.healthy is False
    assert h.changes == [False]
    # While down it refuses at once, without waiting on Redis.
    start = time.monotonic()
    for _ in range(3):
        with pytest.raises(StoreUnavailable):
            await store.admit(t, req(max_concurrent=5))
    assert time.monotonic() - start < 0.5
    # Nothing was admitted locally.
    assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 0

    h.server.restart()
    await h.wait_healthy(5.0)
    assert h.changes == [False, True]
    assert (await store.admit(t, req(max_concurrent=5))).ok
    assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 1


async def test_fail_closed_tells_no_usage_while_redis_is_down(closed_harness: Harness) -> None:
    # (/admin/tenants answers a store that cannot tell with an error; in a
    # fail-closed outage it showed the empty fallback's usage instead: every
    # tenant idle with full buckets while its streams ran, and limited by nothing
    # of it, since that router admits nobody)
    h, store = closed_harness, closed_harness.store
    t = f"usage-{uuid.uuid4().hex[:8]}"
    assert (await store.admit(t, req(rpm=10, max_concurrent=5))).ok
    h.server.kill()
    with pytest.raises(StoreUnavailable):
        await store.usage(t, rpm=10, tpm=0)  # (the call that finds the outage)
    assert store.healthy is False
    with pytest.raises(StoreUnavailable):
        await store.usage(t, rpm=10, tpm=0)  # (known down)
    h.server.restart()
    await h.wait_healthy(5.0)
    usage = await store.usage(t, rpm=10, tpm=0)
    assert usage.active_streams == 0 and usage.requests_available == 10  # (a restart without its data)


async def test_outage_during_concurrent_admissions(harness: Harness) -> None:
    """Redis dies while a burst is in flight: every call ends (admitted, refused
    or StoreUnavailable in fail-closed), none hangs, and the probe recovers."""
    h, store = harness, harness.store
    t = f"burst-{uuid.uuid4().hex[:8]}"

    async def one() -> str:
        try:
            d = await store.admit(t, req(rpm=1000))
        except StoreUnavailable:
            return "unavailable"
        return "ok" if d.ok else d.reason

    first = asyncio.gather(*(one() for _ in range(30)))
    await asyncio.sleep(0)  # let the burst send its commands, then pull the plug
    h.server.kill()
    results = list(await asyncio.wait_for(first, 10.0))
    results += await asyncio.wait_for(asyncio.gather(*(one() for _ in range(30))), 10.0)
    assert store.healthy is False
    assert h.changes == [False]  # one transition, however many calls failed
    if store.fail_open:
        assert set(results) == {"ok"}, results
    else:
        assert set(results) <= {"ok", "unavailable"} and "ok" not in results[30:], results
    h.server.restart()
    await h.wait_healthy(5.0)
    # Every pooled connection died with the old server; the next burst must
    # still go to Redis and not trip the store back into an outage.
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(30))), 10.0)
    assert set(results) == {"ok"}, results
    assert store.healthy is True and h.changes == [False, True]
    u = await store.primary.usage(t, rpm=1000, tpm=0)
    # counted in Redis, not locally: 30 taken from the restarted server's full
    # bucket, which refills 1000 a minute meanwhile (a loaded CI machine took
    # more than the 60 ms a fixed margin of 1 allowed)
    refill = (time.monotonic() - started) * 1000 / 60
    assert 1000 - 30 - 1 < u.requests_available <= 1000 - 30 + 1 + refill, (u, refill)


async def test_a_restart_between_two_bursts_is_no_outage(harness: Harness) -> None:
    """Redis restarts while the router is idle: the pooled connections of
    the first burst are all closed by then, and each failed once when next
    used, each time an outage of its own (503s in fail-closed mode) while
    Redis was up. One retry on a new connection takes them through."""
    h, store = harness, harness.store
    t = f"idle-{uuid.uuid4().hex[:8]}"
    results = await asyncio.gather(*(store.admit(t, req(rpm=1000)) for _ in range(20)))
    assert all(d.ok for d in results)
    h.server.kill()
    h.server.restart()
    for _ in range(3):
        results = await asyncio.gather(*(store.admit(t, req(rpm=1000)) for _ in range(20)))
        assert all(d.ok for d in results)
    assert store.healthy and h.changes == [] and h.errors == [], (h.changes, h.errors)


async def test_check_notices_an_outage_while_idle_then_recovers(harness: Harness) -> None:
    """``/ready`` and ``/metrics`` call ``check``: an idle router's outage shows there."""
    h, store = harness, harness.store
    await store.check()
    assert store.healthy and h.changes == []
    h.server.kill()
    await store.check()  # no request in between
    assert store.healthy is False and h.changes == [False] and "ping" in h.errors
    h.server.restart()
    await h.wait_healthy(5.0)
    assert h.changes == [False, True]


async def test_leases_taken_during_an_outage_count_in_redis_once_it_is_back(open_harness: Harness) -> None:
    # (they stayed in the local fallback for good: after Redis returned,
    # another router admitted past max_concurrent while they ran)
    h, store = open_harness, open_harness.store
    t = f"move-{uuid.uuid4().hex[:8]}"
    h.server.kill()
    lid = uuid.uuid4().hex
    assert (await store.admit(t, req(max_concurrent=1, lease=lid))).ok  # (counted locally)
    h.server.restart()
    await h.wait_healthy(5.0)
    await store.renew(t, [lid], 30.0)  # (the lease keeper's next round)
    d = await store.primary.admit(t, req(max_concurrent=1))  # another router's admission
    assert (d.ok, d.reason) == (False, "concurrency"), d
    await store.release(t, lid)  # released where it is counted now
    assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 0
    assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 0


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_a_release_redis_missed_is_made_when_it_returns(fail_open: bool) -> None:
    # (it was dropped: the tenant's slot stayed taken in Redis until the
    # lease's TTL, 30 s, and every router refused the tenant meanwhile.
    # A server that keeps its data over the restart, as one that was only
    # out of reach does.)
    with RedisServer(require_redis_server(), persist=True) as server:
        async for h in _harness(server, fail_open):
            store = h.store
            t = f"owed-{uuid.uuid4().hex[:8]}"
            lid = uuid.uuid4().hex
            assert (await store.admit(t, req(max_concurrent=1, lease=lid))).ok
            server.kill()
            await store.release(t, lid)  # (cannot reach it: owed)
            assert store.healthy is False
            server.restart()
            await h.wait_healthy(10.0)
            assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 0
            assert (await store.primary.admit(t, req(max_concurrent=1))).ok


async def test_in_an_outage_the_fallbacks_leases_are_renewed_and_settled_where_they_were_taken(
        open_harness: Harness) -> None:
    # (a review of the first version: one failed Redis renewal skipped the
    # fallback's, so leases of running streams expired locally after 30 s;
    # and a lease moved to Redis took its settlement along, refunding tokens
    # Redis never reserved)
    h, store = open_harness, open_harness.store
    t = f"groups-{uuid.uuid4().hex[:8]}"
    on_redis, local = uuid.uuid4().hex, uuid.uuid4().hex
    assert (await store.admit(t, req(max_concurrent=5, lease=on_redis))).ok
    h.server.kill()
    tokens = AdmitRequest(rpm=0, tpm=10_000, max_concurrent=5, cost_tokens=4000, lease_id=local, lease_ttl=0.5)
    assert (await store.admit(t, tokens)).ok  # (the fallback's, reserving 4000 tokens there)
    await asyncio.sleep(0.3)
    await store.renew(t, [on_redis, local], 30.0)  # (Redis's group fails first)
    await asyncio.sleep(0.4)  # past the local lease's first TTL
    # (Redis's lease is counted there too in the outage: ``_hold_locally``)
    assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 2, "the fallback's lease expired"
    h.server.restart()
    await h.wait_healthy(5.0)
    await store.renew(t, [on_redis, local], 30.0)  # (moves the local lease to Redis)
    taken = AdmitRequest(rpm=0, tpm=10_000, max_concurrent=0, cost_tokens=5000, lease_id=uuid.uuid4().hex,
                         lease_ttl=30.0)
    assert (await store.primary.admit(t, taken)).ok  # (Redis's bucket at 5000, not full: a refund would show)
    await store.settle(t, tpm=10_000, reserved=4000, used=10, lease_id=local)
    assert (await store.primary.usage(t, rpm=0, tpm=10_000)).tokens_available < 6000  # (5000 and a refill)
    assert (await store.fallback.usage(t, rpm=0, tpm=10_000)).tokens_available > 9000  # refunded where reserved
    await store.release(t, local)
    await store.release(t, on_redis)
    assert store._reserve_store == {} and store._lease_store == {} and store._lease_of == {}


async def test_in_fail_open_the_fallback_counts_the_streams_already_running(open_harness: Harness) -> None:
    # (it started empty: a router running 3 of a tenant's streams when Redis
    # went down admitted 3 more, 6 at once on a router for a limit of 3)
    h, store = open_harness, open_harness.store
    t = f"held-{uuid.uuid4().hex[:8]}"
    running = [uuid.uuid4().hex for _ in range(2)]
    for lid in running:
        assert (await store.admit(t, req(max_concurrent=3, lease=lid))).ok
    h.server.kill()
    first = uuid.uuid4().hex
    assert (await store.admit(t, req(max_concurrent=3, lease=first))).ok  # (meets the outage: the third)
    assert store.healthy is False
    d = await store.admit(t, req(max_concurrent=3))
    assert (d.ok, d.reason) == (False, "concurrency"), d
    assert (await store.usage(t, rpm=0, tpm=0)).active_streams == 3
    await store.renew(t, running + [first], 30.0)  # (the lease keeper's round: they stay counted locally)
    await store.release(t, running[0])  # a running stream ends in the outage: its slot frees here
    assert (await store.admit(t, req(max_concurrent=3))).ok
    d = await store.admit(t, req(max_concurrent=3))
    assert (d.ok, d.reason) == (False, "concurrency"), d
    h.server.restart()
    await h.wait_healthy(5.0)
    # back: Redis counts the running stream again, the fallback only what it took
    assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 2


# -- a router's start: the first contact ---------------------------------------


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_a_slow_first_answer_at_start_is_no_outage(own_redis: RedisServer, fail_open: bool) -> None:
    # (a router started on a busy 2-core box met Redis's first answer past
    # the 0.5 s timeout and began in an outage: fail-open, it served a
    # tenant limited to 12 requests with local limits, 24 of 24 admitted)
    async for h in _harness(own_redis, fail_open):
        store = h.store
        t = f"start-{uuid.uuid4().hex[:8]}"
        own_redis.pause()  # (answers nothing for 1.2 s: a few tries time out)
        await store.start()
        assert store.connecting
        await store.check()  # (/ready while connecting: not an outage either)
        asyncio.get_running_loop().call_later(1.2, own_redis.resume)
        started = time.monotonic()
        d = await asyncio.wait_for(store.admit(t, req(max_concurrent=1)), 5.0)  # (waits for the answer)
        assert d.ok and time.monotonic() - started >= 1.0
        assert not store.connecting and store.healthy
        # (fairstream_state_store_up: 0 from the first try's timeout to the answer; no outage)
        assert h.changes == [False, True] and h.errors == [], (h.changes, h.errors)
        assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 1  # counted in Redis
        assert (await store.fallback.usage(t, rpm=0, tpm=0)).active_streams == 0
        d = await store.admit(t, req(max_concurrent=1))
        assert (d.ok, d.reason) == (False, "concurrency")


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_no_answer_within_connect_timeout_is_an_outage(own_redis: RedisServer, fail_open: bool) -> None:
    async for h in _harness(own_redis, fail_open, connect_timeout=1.0):
        store = h.store
        t = f"nostart-{uuid.uuid4().hex[:8]}"
        own_redis.kill()
        await store.start()
        started = time.monotonic()
        if fail_open:
            assert (await store.admit(t, req(max_concurrent=1))).ok  # (local limits, once the wait is over)
        else:
            with pytest.raises(StoreUnavailable):
                await store.admit(t, req(max_concurrent=1))
        assert 0.5 <= time.monotonic() - started < 3.0
        assert not store.connecting and store.healthy is False
        assert h.changes == [False] and "connect" in h.errors
        own_redis.restart()
        await h.wait_healthy(5.0)
        assert h.changes == [False, True]


async def test_a_first_contact_that_fails_unexpectedly_tries_again(own_redis: RedisServer, monkeypatch) -> None:
    # (only StoreUnavailable was caught: anything else ended the first
    # contact with the router connecting, not ready, for good)
    async for h in _harness(own_redis, True):
        store = h.store
        ping, calls = store.primary.ping, []

        async def flaky() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a client bug")
            await ping()

        monkeypatch.setattr(store.primary, "ping", flaky)
        await store.start()
        await apoll(lambda: not store.connecting, 5.0, what="the first contact to end")
        assert store.healthy and len(calls) >= 2  # (more where a try timed out on a busy box)
        assert h.changes == [False, True], h.changes


async def test_the_probe_looks_again_soon_after_an_outage_began(own_redis: RedisServer) -> None:
    # (it first looked a whole probe_interval later, 1 s: a Redis that was
    # slow once, past its 0.5 s, left the router on local limits that long)
    async for h in _harness(own_redis, True, probe_interval=1.0):
        store = h.store
        t = f"blip-{uuid.uuid4().hex[:8]}"
        own_redis.pause()
        assert (await store.admit(t, req(max_concurrent=1))).ok  # (after 0.5 s: the fallback's)
        own_redis.resume()
        assert store.healthy is False
        took = await h.wait_healthy(5.0)
        assert took < 0.8, took  # (it was a whole probe_interval after the outage began, ~1 s from here)


# -- generation: a Redis that lost its data ---------------------------------------


async def test_the_generation_changes_when_redis_loses_its_data(own_redis: RedisServer) -> None:
    from router.state.redis_store import RedisStore

    store = RedisStore(own_redis.url, prefix="fs-test", timeout=2.0)
    other = RedisStore(own_redis.url, prefix="fs-test", timeout=2.0)  # (another router)
    try:
        first = await store.generation()
        assert first and await store.generation() == first == await other.generation()
        own_redis.kill()
        own_redis.restart()  # (empty: no persistence)
        second = await other.generation()  # (whichever router looks first makes the new one)
        assert second != first and await store.generation() == second
        await store._redis.flushdb()
        assert await store.generation() not in (first, second)
    finally:
        await store.close()
        await other.close()


async def test_the_generation_stays_across_a_restart_that_keeps_the_data() -> None:
    from router.state.redis_store import RedisStore

    with RedisServer(require_redis_server(), persist=True) as server:
        store = RedisStore(server.url, prefix="fs-test", timeout=2.0)
        try:
            first = await store.generation()
            server.kill()
            server.restart()
            assert await store.generation() == first  # (its leases are there: nothing to add back)
        finally:
            await store.close()


async def test_the_generation_changes_when_redis_is_back_from_an_outage(open_harness: Harness) -> None:
    # (the leases the fallback took move to Redis at their next renewal: the
    # lease keeper makes it at once when the generation changes)
    h, store = open_harness, open_harness.store
    first = await store.generation()
    h.server.pause()
    await store.check()
    assert store.healthy is False
    with pytest.raises(StoreUnavailable):
        await store.generation()
    h.server.resume()  # (its data kept: only the outage says the leases must move)
    await h.wait_healthy(5.0)
    assert await store.generation() != first


async def test_the_scripts_are_loaded_at_the_first_contact_and_when_redis_is_back_from_an_outage(own_redis: RedisServer) -> None:
    # (before, each script's first use cost EVALSHA, NOSCRIPT, SCRIPT LOAD
    # and EVALSHA inside the 0.5 s timeout: a router's first burst on a busy
    # box could begin an outage of its own)
    import redis.asyncio as aioredis

    async def loaded() -> list[bool]:
        client = aioredis.Redis.from_url(own_redis.url)
        try:
            return list(await client.script_exists(*shas))
        finally:
            await client.aclose()

    async for h in _harness(own_redis, True):
        store = h.store
        lua = sorted((Path(router.state.__file__).parent / "lua").glob("*.lua"))
        shas = [hashlib.sha1(f.read_bytes()).hexdigest() for f in lua]  # (as EVALSHA names them)
        assert len(shas) == 14 and not any(await loaded())
        await store.start()
        await apoll(lambda: not store.connecting, 5, what="the first contact")
        assert await loaded() == [True] * 14  # before any request
        own_redis.kill()
        await store.check()  # (an outage)
        assert not store.healthy
        own_redis.restart()  # (no persistence: no scripts either)
        await h.wait_healthy(5.0)
        assert await loaded() == [True] * 14


async def test_an_admission_redis_runs_late_after_a_hang_holds_no_slot(harness: Harness) -> None:
    # A Redis that hangs (SIGSTOP, a long fork, a network stall) runs the
    # admission that timed out when it wakes. The router admitted the stream
    # locally (fail-open) or refused it (fail-closed); either way Redis's
    # lease must not hold the tenant's only slot for its TTL (30 s) once
    # the stream has ended and Redis is back.
    h, store = harness, harness.store
    t = f"late-{uuid.uuid4().hex[:8]}"
    lid = uuid.uuid4().hex
    await store.start()  # (loads the scripts, as a router's start does: an EVALSHA of an
    await store._connected()  # unknown script would only come back NOSCRIPT)
    h.server.pause()
    try:
        try:
            d = await store.admit(t, req(max_concurrent=1, lease=lid))
        except StoreUnavailable:
            d = None  # (fail-closed)
        assert store.healthy is False
        if d is not None:
            assert d.ok
            await store.release(t, lid)  # (the stream ended during the hang)
    finally:
        h.server.resume()
    await h.wait_healthy(5.0)
    await asyncio.sleep(0.2)
    assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 0
    assert (await store.admit(t, req(max_concurrent=1))).ok


async def test_a_stream_that_ends_while_redis_is_known_to_hang_is_settled_once_and_waits_for_nothing(
        harness: Harness) -> None:
    # (a review: a stream that ended during a known outage still sent its
    # settlement and release to the hung Redis and waited its timeout for
    # each, 1 s in all, before its tenant's next request, waiting in line
    # for that slot, was woken; both are owed and made once Redis is back)
    h, store = harness, harness.store
    t = f"hang-{uuid.uuid4().hex[:8]}"
    lid = uuid.uuid4().hex
    await store.start()
    await store._connected()
    reserve = AdmitRequest(rpm=0, tpm=10_000, max_concurrent=1, cost_tokens=6000, lease_id=lid, lease_ttl=30.0)
    assert (await store.admit(t, reserve)).ok  # (in Redis: its bucket at 4000)
    h.server.pause()
    try:
        await store.check()  # (the outage is known: the ping timed out)
        assert store.healthy is False
        began = time.monotonic()
        await store.settle(t, tpm=10_000, reserved=6000, used=4000, lease_id=lid)  # (2000 back, once)
        await store.release(t, lid)
        assert time.monotonic() - began < 0.25, "the end of a stream waited for a Redis known to be down"
    finally:
        h.server.resume()
    await assert_settled_once(h, t)


async def assert_settled_once(h: Harness, t: str) -> None:
    """Once Redis is back: ``t``'s lease is gone and its bucket (10,000 a
    minute, 6000 reserved, 4000 used) got the 2000 back once."""
    await h.wait_healthy(5.0)
    await asyncio.sleep(0.2)
    usage = await h.store.primary.usage(t, rpm=0, tpm=10_000)
    assert usage.active_streams == 0
    # 6000 (4000 and the 2000 given back, once) and the refill of a few seconds (167/s)
    assert 5900 < usage.tokens_available < 7500, usage


async def test_a_lease_renewal_while_redis_is_known_to_hang_waits_for_nothing(closed_harness: Harness) -> None:
    # (in fail-closed the renewal still went to the hung Redis and waited its
    # timeout, 0.5 s per tenant, in the lease keeper's round; the lease is
    # added again by the first renewal once Redis is back, as one that
    # expired meanwhile)
    h, store = closed_harness, closed_harness.store
    t = f"renew-{uuid.uuid4().hex[:8]}"
    lid = uuid.uuid4().hex
    await store.start()
    await store._connected()
    assert (await store.admit(t, req(max_concurrent=1, lease=lid))).ok
    h.server.pause()
    try:
        await store.check()
        assert store.healthy is False
        began = time.monotonic()
        await store.renew(t, [lid], 30.0)
        assert time.monotonic() - began < 0.25, "a lease renewal waited for a Redis known to be down"
    finally:
        h.server.resume()
    await h.wait_healthy(5.0)
    await store.renew(t, [lid], 30.0)
    assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 1


async def test_a_redis_that_refuses_writes_is_an_outage_until_it_takes_them(open_harness: Harness) -> None:
    # At maxmemory with noeviction (or a read-only replica) Redis answers a
    # PING but refuses every script: the router must stay in its outage (one
    # log line, fairstream_state_store_up 0), not be called back by a PING
    # 0.1 s later and go down again at the next request, over and over.
    h, store = open_harness, open_harness.store
    t = f"oom-{uuid.uuid4().hex[:8]}"
    await store.start()
    await store._connected()
    r = store.primary._redis
    await r.config_set("maxmemory-policy", "noeviction")
    await r.config_set("maxmemory", 1)
    try:
        for _ in range(5):
            assert (await store.admit(t, req())).ok  # (fail-open: locally)
            await asyncio.sleep(0.3)
        await store.check()
        assert store.healthy is False
        assert h.changes == [False], h.changes
    finally:
        await r.config_set("maxmemory", 0)
    await h.wait_healthy(5.0)
    assert h.changes == [False, True]


async def test_a_redis_that_wants_a_password_the_router_lacks_says_so(own_redis: RedisServer, caplog) -> None:
    # Not "did not answer": Redis answered, refusing the router's credentials,
    # which no retry mends. The log must name the cause and where to fix it.
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.config_set("requirepass", "s3cret")
    await admin.aclose()
    async for h in _harness(own_redis, True, connect_timeout=0.5):
        with caplog.at_level("WARNING", logger="fairstream.state"):
            await h.store.start()
            await h.store._connected()
        assert h.store.healthy is False
        text = caplog.text
        assert "did not answer" not in text
        assert "credentials" in text and "state.url" in text, text


async def test_a_stream_begun_during_an_outage_stays_resumable_once_redis_is_back(open_harness: Harness) -> None:
    # Its buffer was in the fallback, which Redis's return empties: every
    # resume of it was a 404 (on its own router too) for the rest of the stream.
    h, store = open_harness, open_harness.store
    await store.start()
    await store._connected()
    h.server.kill()
    await store.stream_open("s-during", b"meta", "me", 60.0)
    assert store.healthy is False
    assert await store.stream_append("s-during", [b"e0", b"e1"], [1, 2], 2, False, "me", 60.0, 0)
    h.server.restart()
    await h.wait_healthy(5.0)
    assert await store.stream_append("s-during", [b"e2"], [3], 3, False, "me", 60.0, 2)
    snap = await store.stream_read("s-during", 0)
    assert snap is not None and not snap.broken
    assert snap.events == [b"e0", b"e1", b"e2"] and snap.token_ids == [1, 2, 3] and snap.meta == b"meta"


async def test_the_move_to_redis_keeps_lease_and_lost_and_misses_no_stream_written_while_it_runs(
        open_harness: Harness) -> None:
    # (the copy carried neither a buffer's last claim's leases nor its being lost, so a resume after
    # it replaced the wrong leases and trusted a client's events it could not have; a stream opened
    # while the copy ran went to the fallback and was dropped with it; events written to a buffer
    # after its copy broke it)
    h, store = open_harness, open_harness.store
    await store.start()
    await store._connected()
    h.server.kill()
    await store.stream_open("s-claimed", b"m1", "a", 60.0)
    assert await store.stream_append("s-claimed", [b"e0"], [1], 1, False, "a", 60.0, 0)
    await store.stream_release("s-claimed", "a", 3)  # (its client left: 3 tokens charged, 1 in the buffer)
    assert await store.stream_claim("s-claimed", "b", 10.0, "lease-b lease-a")
    await store.stream_open("s-lost", b"m2", "dead", 60.0)
    assert await store.stream_append("s-lost", [b"e0", b"e1"], [1, 2], 2, False, "dead", 60.0, 0)
    store.fallback._streams["s-lost"].owner_until = 0.0  # (its router died: its claim ran out unreleased)
    assert store.healthy is False

    moving = store.primary.stream_append
    during: list[str] = []

    async def append_then_write_more(sid, events, *args):
        done = await moving(sid, events, *args)
        if not during:  # (while the first copy is under way: another stream opens, this one goes on)
            during.append(sid)
            await store.stream_open("s-new", b"m3", "me", 60.0)
            assert await store.stream_append("s-new", [b"n0"], [7], 1, False, "me", 60.0, 0)
            # (to the buffer copied now, or to the one still to copy)
            assert await store.stream_append("s-claimed", [b"late"], [9], 9, False, "b", 60.0, 1)
        return done

    store.primary.stream_append = append_then_write_more  # type: ignore[method-assign]
    h.server.restart()
    await h.wait_healthy(5.0)
    assert during  # (the copy ran)

    claimed = await store.primary.stream_read("s-claimed", 0)
    lost = await store.primary.stream_read("s-lost", 0)
    new = await store.primary.stream_read("s-new", 0)
    assert claimed is not None and (claimed.lease, claimed.lost, claimed.owner) == ("lease-b lease-a", False, "b")
    assert (claimed.charged, lost.charged if lost else None) == (3, 0)
    assert not claimed.broken and (claimed.events, claimed.token_ids, claimed.text_len) == ([b"e0", b"late"], [1, 9], 9)
    assert lost is not None and lost.lost and lost.owner == "" and not lost.broken
    assert (lost.events, lost.token_ids, lost.text_len) == ([b"e0", b"e1"], [1, 2], 2)
    assert new is not None and (new.events, new.token_ids) == ([b"n0"], [7]) and not new.broken


async def test_a_release_owed_while_the_buffers_move_is_made_before_redis_counts_as_back() -> None:
    # (a release while Redis is known to be down is owed, not sent: one that
    # came while the probe copied the fallback's resume buffers, after it
    # made the owed ones, waited for the next outage's return, and the
    # tenant's slot stayed taken in Redis until the lease's TTL)
    with RedisServer(require_redis_server(), persist=True) as server:
        async for h in _harness(server, True):
            store = h.store
            await store.start()
            await store._connected()
            t = f"moving-{uuid.uuid4().hex[:8]}"
            lid = uuid.uuid4().hex
            assert (await store.admit(t, req(max_concurrent=1, lease=lid))).ok  # (in Redis)
            server.kill()
            await store.stream_open("s-moving", b"meta", "me", 60.0)  # (in the fallback: the probe moves it)
            assert store.healthy is False
            opened = store.primary.stream_open

            async def open_and_end_a_stream(*args, **kwargs):
                await store.release(t, lid)  # (its stream ends while the buffer moves)
                return await opened(*args, **kwargs)

            store.primary.stream_open = open_and_end_a_stream
            server.restart()
            await h.wait_healthy(10.0)
            assert (await store.primary.usage(t, rpm=0, tpm=0)).active_streams == 0


async def test_a_reservation_a_continuation_took_over_is_not_settled_again_now_or_when_owed(
        harness: Harness) -> None:
    # (the wrapper passed a settlement on without its lease id: Redis could
    # not tell one whose reservation another router's continuation had taken
    # over, and gave the tenant back what the continuation settles too)
    h, store = harness, harness.store
    t = f"held-{uuid.uuid4().hex[:8]}"
    await store.start()
    await store._connected()
    firsts = []
    for _ in range(2):
        first = AdmitRequest(rpm=0, tpm=60, max_concurrent=0, cost_tokens=20, lease_id=uuid.uuid4().hex,
                             lease_ttl=30.0, hold=300.0)
        assert (await store.admit(t, first)).ok  # (in Redis: its bucket at 40, then 20)
        cont = AdmitRequest(rpm=0, tpm=60, max_concurrent=0, cost_tokens=15, lease_id=uuid.uuid4().hex,
                            lease_ttl=30.0, replaces=(first.lease_id,), hold=300.0, base=8)
        assert (await store.primary.admit(t, cont)).taken == 20  # (another router's continuation)
        firsts.append(first)
    await store.settle(t, tpm=60, reserved=20, used=8, lease_id=firsts[0].lease_id)
    h.server.pause()
    try:
        await store.check()
        assert store.healthy is False
        await store.settle(t, tpm=60, reserved=20, used=8, lease_id=firsts[1].lease_id)  # (owed)
    finally:
        h.server.resume()
    await h.wait_healthy(5.0)
    await asyncio.sleep(0.2)
    usage = await store.primary.usage(t, rpm=0, tpm=60)
    assert usage.tokens_available < 20 + 12, usage  # (20 and a few seconds' refill; not 24 more given back)


async def test_a_buffer_moved_to_redis_is_written_there_while_the_releases_owed_meanwhile_are_made() -> None:
    # (once the move ended, the releases owed during it were made with the
    # buffers back in the fallback's hands: an append then was taken there
    # and dropped when Redis counted as back; Redis missed the event, and
    # the stream's next append found its buffer broken)
    with RedisServer(require_redis_server(), persist=True) as server:
        async for h in _harness(server, True):
            store = h.store
            await store.start()
            await store._connected()
            t = f"window-{uuid.uuid4().hex[:8]}"
            lid = uuid.uuid4().hex
            assert (await store.admit(t, req(max_concurrent=1, lease=lid))).ok  # (in Redis)
            server.kill()
            await store.stream_open("s-window", b"meta", "me", 60.0)  # (in the fallback: the probe moves it)
            assert await store.stream_append("s-window", [b"e0"], [1], 1, False, "me", 60.0, 0)
            opened, released = store.primary.stream_open, store.primary.release
            paying = asyncio.Event()

            async def open_and_end_a_stream(*args, **kwargs):
                await store.release(t, lid)  # (owed: made once the buffers have moved)
                return await opened(*args, **kwargs)

            async def slow_release(*args, **kwargs):
                paying.set()
                await asyncio.sleep(0.5)
                return await released(*args, **kwargs)

            store.primary.stream_open = open_and_end_a_stream
            store.primary.release = slow_release
            server.restart()
            await asyncio.wait_for(paying.wait(), 15.0)
            assert store.healthy is False
            assert await store.stream_append("s-window", [b"e1"], [2], 2, False, "me", 60.0, 1)
            await h.wait_healthy(10.0)
            snap = await store.primary.stream_read("s-window", 0)
            assert snap is not None and snap.total_events == 2, snap
            assert await store.stream_append("s-window", [b"e2"], [3], 3, False, "me", 60.0, 2)
