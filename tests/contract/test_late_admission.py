"""An admission Redis runs late, whose answer its router never used, costs nothing.

An admission sent to a Redis that only hung (SIGSTOP, a long fork) times
out; the router admits the request locally (fail-open) or refuses it
(fail-closed), and Redis runs the one sent when it wakes. Its lease was
released on Redis's return, but the request and the tokens it reserved
stayed taken from the tenant's buckets until they refilled; a
continuation's took over the reservation a dead router left unsettled, and
nothing settled it again (the continuation that ran was the local one). The
router now undoes such an admission when Redis is back
(``StateStore.undo_admit``): admitted, it gives back what it took and
hands back what it took over, as it was; refused or never made, nothing
changes; made again, it counts once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from router.state import AdmitRequest, StoreUnavailable
from tests.contract.conftest import Backend
from tests.contract.test_resilient_store import Harness, _harness, own_redis  # noqa: F401 (a fixture)

RPM = 6
TPM = 1000


def req(cost: int, *, rpm: int = RPM, tpm: int = TPM, hold: float = 300.0, replaces: tuple[str, ...] = (),
        base: int = 0, max_concurrent: int = 0) -> AdmitRequest:
    return AdmitRequest(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, cost_tokens=cost,
                        lease_id=uuid.uuid4().hex, lease_ttl=30.0, replaces=replaces, hold=hold, base=base)


async def levels(backend: Backend, t: str) -> tuple[float, float, int]:
    u = await backend.store.usage(t, rpm=RPM, tpm=TPM)
    return u.requests_available, u.tokens_available, u.active_streams


def near(value: float, expected: float, per_minute: int, backend: Backend) -> bool:
    lo, hi = backend.level_range(expected, per_minute)
    return lo <= value <= hi


# -- the store's part, on every backend ---------------------------------------


@pytest.mark.parametrize("keep_lease", [False, True], ids=["ended", "still_runs"])
async def test_an_undone_admission_gives_back_its_request_and_tokens_once(backend: Backend, keep_lease: bool) -> None:
    t, store = backend.tenant(), backend.store
    assert (await store.admit(t, req(200))).ok  # (another stream: 5 requests, 800 tokens left)
    late = req(300)
    assert (await store.admit(t, late)).ok  # (4, 500)
    for _ in range(2):  # (the second: made again after a reply lost on its way)
        await store.undo_admit(t, late, keep_lease=keep_lease)
        rq, tk, active = await levels(backend, t)
        assert near(rq, 5, RPM, backend) and near(tk, 800, TPM, backend), (rq, tk)
        assert active == (2 if keep_lease else 1)


async def test_an_undo_made_again_once_its_stream_ended_ends_the_lease_and_gives_nothing_back_again(
        backend: Backend) -> None:
    # (made while the stream ran on the fallback, its reply lost in a second
    # hang; the stream ended meanwhile, so the router makes it again with
    # keep_lease False: the charge was given back once already)
    t, store = backend.tenant(), backend.store
    assert (await store.admit(t, req(200))).ok  # (another stream: 5 requests, 800 tokens left)
    late = req(300)
    assert (await store.admit(t, late)).ok  # (4, 500)
    await store.undo_admit(t, late, keep_lease=True)
    for _ in range(2):
        await store.undo_admit(t, late, keep_lease=False)
        rq, tk, active = await levels(backend, t)
        assert near(rq, 5, RPM, backend) and near(tk, 800, TPM, backend), (rq, tk)
        assert active == 1  # (its lease is gone: the stream it counted ended)


async def test_a_request_admitted_late_again_after_another_hang_is_undone_again(backend: Backend) -> None:
    # (it waited in line on the fallback, then timed out on Redis once more)
    t, store = backend.tenant(), backend.store
    late = req(300)
    for _ in range(2):
        assert (await store.admit(t, late)).ok
        await store.undo_admit(t, late)
        rq, tk, active = await levels(backend, t)
        assert near(rq, RPM, RPM, backend) and near(tk, TPM, TPM, backend) and active == 0, (rq, tk, active)
        fill = req(900, rpm=0)
        assert (await store.admit(t, fill)).ok  # (what it gave back is there: 100 left)
        assert not (await store.admit(t, req(200, rpm=0))).ok
        await store.settle(t, tpm=TPM, reserved=900, used=0, lease_id=fill.lease_id)  # (full for the next round)
        await store.release(t, fill.lease_id)


async def test_undoing_an_admission_that_was_refused_or_never_made_changes_nothing(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    assert (await store.admit(t, req(800))).ok  # (5, 200 left)
    refused = req(300)
    assert not (await store.admit(t, refused)).ok
    await store.undo_admit(t, refused)
    await store.undo_admit(t, req(300))  # (never reached the store)
    rq, tk, _ = await levels(backend, t)
    assert near(rq, 5, RPM, backend) and near(tk, 200, TPM, backend), (rq, tk)


async def test_an_undone_continuation_hands_back_the_reservation_it_took_over(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(200)  # (its router dies: 800 left)
    assert (await store.admit(t, first)).ok
    cont = req(500, rpm=0, base=20, replaces=(first.lease_id,))
    assert (await store.admit(t, cont)).taken == 200  # (300 more: 500 left)
    await store.undo_admit(t, cont)
    _, tk, _ = await levels(backend, t)
    assert near(tk, 800, TPM, backend), tk
    # the dead router's reservation is as it was: the next continuation takes it over ...
    again = req(500, rpm=0, base=20, replaces=(first.lease_id,))
    d = await store.admit(t, again)
    assert d.ok and (d.taken, d.base) == (200, 0), d
    await store.undo_admit(t, again)
    # ... or, had the first's router only frozen, its own settlement counts (150 of 200 back)
    await store.settle(t, tpm=TPM, reserved=200, used=50, lease_id=first.lease_id, held=True)
    _, tk, _ = await levels(backend, t)
    assert near(tk, 950, TPM, backend), tk


@pytest.mark.parametrize("used", [50, 260], ids=["under", "over"])
async def test_the_dead_routers_settlement_that_lands_before_the_undo_counts(backend: Backend, used: int) -> None:
    # (the first's router only froze: its settlement came after the late
    # continuation took its reservation over, and changed nothing then)
    t, store = backend.tenant(), backend.store
    first = req(200)  # (800 left)
    assert (await store.admit(t, first)).ok
    cont = req(500, rpm=0, base=20, replaces=(first.lease_id,))
    assert (await store.admit(t, cont)).taken == 200  # (300 more: 500 left)
    await store.settle(t, tpm=TPM, reserved=200, used=used, lease_id=first.lease_id, held=True)
    _, tk, _ = await levels(backend, t)
    assert near(tk, 500, TPM, backend), tk  # (the continuation settles for it, were it not undone)
    await store.undo_admit(t, cont)
    _, tk, _ = await levels(backend, t)
    assert near(tk, 1000 - used, TPM, backend), tk  # (as if the continuation never ran: 800 + 200 - used)
    # (settled: nothing left to take over)
    assert (await store.admit(t, req(10, rpm=0, replaces=(first.lease_id,)))).taken == 0


async def test_an_undone_continuation_whose_reservation_was_taken_over_since_gives_back_no_tokens(
        backend: Backend) -> None:
    # (another router's continuation took the late one's reservation over,
    # the first's with it, and settles for the whole stream)
    t, store = backend.tenant(), backend.store
    first = req(200)
    assert (await store.admit(t, first)).ok
    cont = req(500, rpm=0, replaces=(first.lease_id,))
    assert (await store.admit(t, cont)).taken == 200  # (500 left)
    other = req(600, rpm=0, replaces=(cont.lease_id, first.lease_id))
    assert (await store.admit(t, other)).taken == 500  # (100 more: 400 left)
    await store.undo_admit(t, cont)
    _, tk, _ = await levels(backend, t)
    assert near(tk, 400, TPM, backend), tk
    assert (await store.admit(t, req(10, rpm=0, replaces=(first.lease_id,)))).taken == 0


# -- a router's admission that times out on a hung Redis ----------------------


@pytest.fixture(params=[True, False], ids=["fail_open", "fail_closed"])
async def harness(request, own_redis) -> AsyncIterator[Harness]:  # noqa: F811
    async for h in _harness(own_redis, request.param):
        yield h


async def _admit_on_hung_redis(h: Harness, t: str, r: AdmitRequest, *, used: int | None = 100) -> bool:
    """Admit ``r`` while Redis is stopped (it times out: fail-open admits it
    locally, fail-closed refuses it); its stream ends during the hang unless
    ``used`` is None. Redis wakes; returns whether the router admitted it."""
    store = h.store
    h.server.pause()
    try:
        try:
            d = await store.admit(t, r)
        except StoreUnavailable:
            d = None  # (fail-closed)
        assert store.healthy is False
        if d is not None:
            assert d.ok and d.taken == 0, d  # (the fallback holds no reservation to take over)
            if used is not None:
                await store.settle(t, tpm=r.tpm, reserved=r.cost_tokens, used=used, lease_id=r.lease_id,
                                   held=r.hold > 0)
                await store.release(t, r.lease_id)
    finally:
        h.server.resume()
    await h.wait_healthy(5.0)
    await asyncio.sleep(0.2)
    return d is not None


async def _started(h: Harness) -> None:
    await h.store.start()  # (loads the scripts: an EVALSHA of an unknown one would only come back NOSCRIPT)
    await h.store._connected()


@pytest.mark.redis
async def test_an_admission_redis_runs_late_after_a_hang_costs_the_tenant_nothing(harness: Harness) -> None:
    h = harness
    t = f"late-{uuid.uuid4().hex[:8]}"
    await _started(h)
    await _admit_on_hung_redis(h, t, req(3000, rpm=6, tpm=6000))
    u = await h.store.primary.usage(t, rpm=6, tpm=6000)
    assert u.active_streams == 0
    # (charged: 5 and 3000, and a second or two of refill, 0.1 and 100 a second)
    assert u.requests_available > 5.6 and u.tokens_available > 5600, u


@pytest.mark.redis
async def test_an_admission_redis_refuses_late_gives_nothing_back(harness: Harness) -> None:
    h = harness
    t = f"late-{uuid.uuid4().hex[:8]}"
    await _started(h)
    assert (await h.store.admit(t, req(5000, rpm=6, tpm=6000))).ok  # (a stream running: 1000 left)
    await _admit_on_hung_redis(h, t, req(3000, rpm=6, tpm=6000))
    u = await h.store.primary.usage(t, rpm=6, tpm=6000)
    assert u.tokens_available < 1000 + 600, u  # (a few seconds' refill; not 3000 it never took)


@pytest.mark.redis
async def test_a_late_admission_of_a_stream_that_still_runs_keeps_its_lease_not_its_charge(
        open_harness: Harness) -> None:
    h = open_harness
    t = f"late-{uuid.uuid4().hex[:8]}"
    await _started(h)
    r = req(3000, rpm=6, tpm=6000)
    assert await _admit_on_hung_redis(h, t, r, used=None)
    u = await h.store.primary.usage(t, rpm=6, tpm=6000)
    assert u.active_streams == 1  # (Redis ran it; the stream it counts runs on, from the fallback)
    assert u.requests_available > 5.6 and u.tokens_available > 5600, u
    await h.store.renew(t, [r.lease_id], 30.0)  # (the lease keeper's, at once: the generation changed)
    await h.store.settle(t, tpm=6000, reserved=3000, used=100, lease_id=r.lease_id, held=True)  # (to the fallback)
    await h.store.release(t, r.lease_id)
    u = await h.store.primary.usage(t, rpm=6, tpm=6000)
    assert u.active_streams == 0 and u.tokens_available > 5600, u


@pytest.mark.redis
async def test_a_continuation_admitted_late_leaves_the_dead_routers_reservation_as_it_was(harness: Harness) -> None:
    # Router A died mid-stream, its reservation (2000) unsettled; the
    # stream's continuation here times out on the hung Redis, which runs it
    # when it wakes: it took A's reservation over (and 2000 more), but the
    # continuation that ran was the fallback's (or none: fail-closed), and
    # A's reservation was marked taken over with nothing to settle it.
    h = harness
    t = f"late-{uuid.uuid4().hex[:8]}"
    await _started(h)
    first = req(2000, rpm=0, tpm=6000)
    assert (await h.store.primary.admit(t, first)).ok  # (router A's: 4000 left)
    cont = req(4000, rpm=0, tpm=6000, base=30, replaces=(first.lease_id,))
    await _admit_on_hung_redis(h, t, cont)
    primary = h.store.primary
    u = await primary.usage(t, rpm=0, tpm=6000)
    assert 4000 <= u.tokens_available < 4600, u  # (a few seconds' refill; not 2000 taken for good)
    # A's reservation can be settled (A only froze: 1500 of it back) ...
    await primary.settle(t, tpm=6000, reserved=2000, used=500, lease_id=first.lease_id, held=True)
    u2 = await primary.usage(t, rpm=0, tpm=6000)
    assert u2.tokens_available > u.tokens_available + 1400, (u, u2)


@pytest.mark.redis
async def test_a_continuation_admitted_late_leaves_the_reservation_to_the_next_continuation(
        harness: Harness) -> None:
    h = harness
    t = f"late-{uuid.uuid4().hex[:8]}"
    await _started(h)
    first = req(2000, rpm=0, tpm=6000)
    assert (await h.store.primary.admit(t, first)).ok
    await _admit_on_hung_redis(h, t, req(4000, rpm=0, tpm=6000, base=30, replaces=(first.lease_id,)))
    # ... or taken over by the stream's next continuation (its client resumes again)
    d = await h.store.primary.admit(t, req(1000, rpm=0, tpm=6000, base=30, replaces=(first.lease_id,)))
    assert d.ok and d.taken == 2000, d


@pytest.fixture
async def open_harness(own_redis) -> AsyncIterator[Harness]:  # noqa: F811
    async for h in _harness(own_redis, True):
        yield h


@pytest.mark.redis
async def test_an_undo_tells_the_routers_when_the_tenant_has_a_line(redis_server) -> None:  # noqa: F811
    # (it frees what the admission took, as a release or a settlement does:
    # a request of the tenant waiting on another router asks again at once)
    from router.state.redis_store import RedisStore

    a = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="fs-test", timeout=2.0)
    heard: list[str] = []
    try:
        b.watch(heard.append)
        await asyncio.sleep(0.2)  # (subscribed)
        t = Backend.tenant("undo-turns")
        late, kept = req(300, max_concurrent=2), req(300, max_concurrent=2)
        assert (await a.admit(t, late)).ok and (await a.admit(t, kept)).ok
        assert not (await a.admit(t, AdmitRequest(rpm=RPM, tpm=TPM, max_concurrent=2, cost_tokens=100,
                                                  lease_id=uuid.uuid4().hex, lease_ttl=30.0, line=True))).ok
        await a.undo_admit(t, late)  # (the tenant has a line now: said)
        await a.undo_admit(t, late)  # (made again: nothing freed, nothing said)
        await a.undo_admit(t, req(300))  # (never made: nothing said)
        await a.undo_admit(t, kept, keep_lease=True)  # (its request and tokens back: said)
        await a.undo_admit(t, kept, keep_lease=True)  # (made again: nothing)
        await a.undo_admit(t, kept)  # (its stream ended before the reply came: its lease ends, said)
        await asyncio.sleep(0.3)
        assert heard == [t, t, t], heard
    finally:
        await a.close()
        await b.close()
