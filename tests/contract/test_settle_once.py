"""A lease's settlement counts once, however often it is made.

A settlement sent to a Redis that only hung (SIGSTOP, a long fork) times
out, and the router keeps it to make again once Redis is back
(``ResilientStore``); but Redis runs the one that timed out when it wakes,
so the tokens bucket was corrected twice for one stream: a refund given
twice, or an overage taken twice. The store now keeps each settled lease id
for ``SETTLED_TTL`` and a second settlement of it changes nothing, on every
backend (settlements without a lease id are not kept: each counts).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from router.state import AdmitRequest
from tests.contract.conftest import Backend
from tests.contract.test_resilient_store import Harness, _harness, assert_settled_once, own_redis  # noqa: F401 (a fixture)

TPM = 1000


def req(cost: int, *, tpm: int = TPM, hold: float = 0.0, replaces: tuple[str, ...] = ()) -> AdmitRequest:
    return AdmitRequest(rpm=0, tpm=tpm, max_concurrent=0, cost_tokens=cost, lease_id=uuid.uuid4().hex,
                        lease_ttl=30.0, replaces=replaces, hold=hold)


async def level(backend: Backend, t: str) -> float:
    return (await backend.store.usage(t, rpm=0, tpm=TPM)).tokens_available


def near(value: float, expected: float, backend: Backend) -> bool:
    lo, hi = backend.level_range(expected, TPM)
    return lo <= value <= hi


@pytest.mark.parametrize("hold", [0.0, 300.0], ids=["plain", "held"])
@pytest.mark.parametrize("reserved,used,after", [(600, 100, 900), (100, 400, 600)], ids=["refund", "overage"])
async def test_a_lease_settled_twice_is_charged_once(backend: Backend, hold: float, reserved: int, used: int,
                                                     after: int) -> None:
    t, store = backend.tenant(), backend.store
    r = req(reserved, hold=hold)
    assert (await store.admit(t, r)).ok
    for _ in range(2):  # (the second: Redis ran the first late, after it timed out, and it is made again)
        await store.settle(t, tpm=TPM, reserved=reserved, used=used, lease_id=r.lease_id, held=hold > 0)
        assert near(await level(backend, t), after, backend), await level(backend, t)


async def test_each_lease_is_settled_on_its_own(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    a, b = req(300), req(300)
    assert (await store.admit(t, a)).ok and (await store.admit(t, b)).ok  # (400 left)
    await store.settle(t, tpm=TPM, reserved=300, used=100, lease_id=a.lease_id)
    await store.settle(t, tpm=TPM, reserved=300, used=100, lease_id=b.lease_id)
    assert near(await level(backend, t), 800, backend)


async def test_settlements_without_a_lease_each_count(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    assert (await store.admit(t, req(100))).ok
    await store.settle(t, tpm=TPM, reserved=100, used=300)
    await store.settle(t, tpm=TPM, reserved=100, used=300)
    assert near(await level(backend, t), 500, backend)


async def test_a_taken_over_lease_settled_twice_changes_nothing(backend: Backend) -> None:
    # (the first settlement finds its reservation taken over and does nothing;
    # made again, it found no record of it and took its overage from the tenant)
    t, store = backend.tenant(), backend.store
    first = req(100, hold=300.0)
    assert (await store.admit(t, first)).ok
    cont = req(100, hold=300.0, replaces=(first.lease_id,))
    assert (await store.admit(t, cont)).ok  # (took the 100 over: nothing more)
    assert near(await level(backend, t), 900, backend)
    for _ in range(2):
        await store.settle(t, tpm=TPM, reserved=100, used=300, lease_id=first.lease_id, held=True)
        assert near(await level(backend, t), 900, backend), await level(backend, t)


@pytest.fixture(params=[True, False], ids=["fail_open", "fail_closed"])
async def harness(request, own_redis) -> AsyncIterator[Harness]:  # noqa: F811
    async for h in _harness(own_redis, request.param):
        yield h


@pytest.mark.redis
async def test_a_settlement_redis_runs_late_after_a_hang_counts_once(harness: Harness) -> None:
    # The settlement times out on the hung Redis and is kept for its return;
    # Redis runs the one sent when it wakes, and then the router makes it
    # again: 2000 tokens came back twice (8000 and more).
    h, store = harness, harness.store
    t = f"settle-{uuid.uuid4().hex[:8]}"
    r = req(6000, tpm=10_000)
    await store.start()  # (loads the scripts: an EVALSHA of an unknown one would only come back NOSCRIPT)
    await store._connected()
    assert (await store.admit(t, r)).ok  # (in Redis: its bucket at 4000)
    h.server.pause()
    try:
        await store.settle(t, tpm=10_000, reserved=6000, used=4000, lease_id=r.lease_id)  # (sent: it times out)
        assert store.healthy is False
        await store.release(t, r.lease_id)  # (known down: kept for its return)
    finally:
        h.server.resume()
    await assert_settled_once(h, t)
