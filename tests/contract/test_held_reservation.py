"""Held reservations (``AdmitRequest.hold``), run on every backend.

A stream's token reservation is kept under its lease id until it is
settled. A router killed mid-stream never settles it, and the stream's
continuation on another router (which names the dead router's lease in
``replaces``) takes it over: it needs that many tokens fewer, and settles
for the whole stream. Before, it reserved its own tokens on top, and a
tenant whose bucket the dead router's reservation had emptied was refused
the rest of a stream it had paid for.
"""

from __future__ import annotations

import uuid

from router.state import AdmitRequest
from tests.contract.conftest import Backend

TPM = 60


def req(cost: int, *, hold: float = 300.0, base: int = 0, replaces: tuple[str, ...] = (), lease: str = "",
        max_concurrent: int = 0) -> AdmitRequest:
    return AdmitRequest(rpm=0, tpm=TPM, max_concurrent=max_concurrent, cost_tokens=cost,
                        lease_id=lease or uuid.uuid4().hex, lease_ttl=30.0, replaces=replaces, hold=hold, base=base)


async def level(backend: Backend, t: str) -> float:
    return (await backend.store.usage(t, rpm=0, tpm=TPM)).tokens_available


def near(value: float, expected: float, backend: Backend) -> bool:
    lo, hi = backend.level_range(expected, TPM)
    return lo <= value <= hi


async def test_a_continuation_takes_over_the_reservation_of_the_lease_it_replaces(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(43)  # (a 40-token stream of a 3-token prompt)
    assert (await store.admit(t, first)).ok
    # its router dies after 11 tokens; the rest (29) would not fit in the 17 left
    cont = req(29, base=3 + 11, replaces=(first.lease_id,))
    d = await store.admit(t, cont)
    assert d.ok, d
    assert (d.taken, d.base) == (43, 0)
    assert near(await level(backend, t), 17, backend)  # (it took nothing more)
    # it settles for the whole stream (3 + 40 of the 43 held)
    await store.settle(t, tpm=TPM, reserved=43, used=43, lease_id=cont.lease_id)
    assert near(await level(backend, t), 17, backend)
    # the first's own settlement (its router only froze) changes nothing: the continuation made it
    await store.settle(t, tpm=TPM, reserved=43, used=14, lease_id=first.lease_id)
    assert near(await level(backend, t), 17, backend)


async def test_a_settled_reservation_is_not_taken_over(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(43)
    assert (await store.admit(t, first)).ok
    await store.settle(t, tpm=TPM, reserved=43, used=14, lease_id=first.lease_id)  # (its client left)
    assert near(await level(backend, t), 46, backend)
    d = await store.admit(t, req(29, base=14, replaces=(first.lease_id,)))
    assert d.ok and (d.taken, d.base) == (0, 0), d
    assert near(await level(backend, t), 17, backend)


async def test_a_refused_continuation_takes_nothing_over(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first, other = req(43), req(1)
    assert (await store.admit(t, first)).ok and (await store.admit(t, other)).ok
    refused = await store.admit(t, req(29, base=14, replaces=(first.lease_id,), max_concurrent=1))
    assert (refused.ok, refused.reason, refused.taken) == (False, "concurrency", 0), refused
    await store.release(t, other.lease_id)
    d = await store.admit(t, req(29, base=14, replaces=("never-admitted", first.lease_id), max_concurrent=1))
    assert d.ok and d.taken == 43, d


async def test_a_chain_of_continuations_hands_the_reservation_on_once(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(43)
    assert (await store.admit(t, first)).ok
    second = req(29, base=14, replaces=(first.lease_id,))
    assert (await store.admit(t, second)).taken == 43
    # the second's router dies too: the third names both, and takes the 43 once, from the first's base
    third = req(10, base=33, replaces=(second.lease_id, first.lease_id))
    d = await store.admit(t, third)
    assert d.ok and (d.taken, d.base) == (43, 0), d
    assert near(await level(backend, t), 17, backend)
    d = await store.admit(t, req(5, base=40, replaces=(second.lease_id, first.lease_id)))
    assert d.ok and d.taken == 0, d  # (the third holds it now; it did not die)


async def test_a_continuation_that_took_nothing_over_keeps_its_own_base(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(43, hold=0)  # (kept for nobody: a store or router without holds)
    assert (await store.admit(t, first)).ok
    second = req(10, base=33, replaces=(first.lease_id,))
    assert (await store.admit(t, second)).taken == 0
    d = await store.admit(t, req(5, base=40, replaces=(second.lease_id, first.lease_id)))
    assert d.ok and (d.taken, d.base) == (10, 33), d


async def test_a_held_reservation_is_kept_for_its_hold_only(backend: Backend) -> None:
    t, store = backend.tenant(), backend.store
    first = req(43, hold=1.0)
    assert (await store.admit(t, first)).ok
    await backend.sleep(1.0 + backend.slack)
    d = await store.admit(t, req(10, base=33, replaces=(first.lease_id,)))
    assert d.ok and d.taken == 0, d
    # and the first's settlement, had its router lived, is made as any other
    before = await level(backend, t)
    await store.settle(t, tpm=TPM, reserved=43, used=3, lease_id=first.lease_id)
    assert await level(backend, t) >= before + 40 - 1e-6


async def test_a_late_settlement_after_the_marker_expired_is_not_a_second_refund(backend: Backend) -> None:
    # (router A froze, or lost Redis with its settlement owed, longer than the
    # hold after its stream's continuation took its reservation over and
    # settled the whole stream: its late settlement refunded it a second time)
    t, store = backend.tenant(), backend.store
    first = req(43, hold=1.0)  # (a 40-token stream of a 3-token prompt; hold: resume_retention)
    assert (await store.admit(t, first)).ok
    cont = req(29, hold=1.0, base=3 + 11, replaces=(first.lease_id,))
    d = await store.admit(t, cont)
    assert d.ok and d.taken == 43, d
    # the continuation ends the stream and settles all of it: 43 used of the 43 held
    await store.settle(t, tpm=TPM, reserved=43, used=43, lease_id=cont.lease_id)
    await backend.sleep(1.0 + backend.slack)  # (A is still frozen)
    before = await level(backend, t)
    # A wakes and settles its own ticket: 14 used of 43 reserved
    await store.settle(t, tpm=TPM, reserved=43, used=14, lease_id=first.lease_id, held=True)
    after = await level(backend, t)
    assert after - before < 1.0, f"refunded again: {before:.1f} -> {after:.1f}"


async def test_a_stream_longer_than_its_hold_is_still_taken_over(backend: Backend) -> None:
    # (a stream that ran longer than resume_retention, its router renewing its
    # lease, then lost its router: its continuation found no reservation to
    # take over and paid for the rest of the stream again)
    t, store = backend.tenant(), backend.store
    first = req(43, hold=1.0)
    assert (await store.admit(t, first)).ok
    for _ in range(3):  # (the stream runs on; its router renews its lease)
        await backend.sleep(0.5)
        await store.renew(t, [first.lease_id], 30.0)
    cont = req(29, hold=1.0, base=3 + 30, replaces=(first.lease_id,))
    d = await store.admit(t, cont)
    assert d.ok and d.taken == 43, d


async def test_a_reservation_past_its_hold_is_not_taken_over_before_the_next_sweep(backend: Backend) -> None:
    # (the memory store sweeps expired reservations at most once a second: a
    # continuation that came after a hold ran out, but before the sweep,
    # took the expired reservation over and paid for none of its tokens)
    t, store = backend.tenant(), backend.store
    first = req(43, hold=1.5)
    assert (await store.admit(t, first)).ok  # (the memory store sweeps now, the next in 1 s)
    await backend.sleep(1.2)
    assert (await store.admit(t, req(1))).ok  # (another request: a sweep, the first kept; the next at 2.2)
    await backend.sleep(0.5)  # (1.7 s in: its hold ran out at 1.5)
    d = await store.admit(t, req(10, base=33, replaces=(first.lease_id,)))
    assert d.ok and (d.taken, d.base) == (0, 0), d


async def test_a_renewed_reservation_is_kept_for_its_hold_past_the_leases_end(backend: Backend) -> None:
    # (a renewal keeps the reservation until the lease's new end plus the
    # hold: a router that dies right after renewing leaves its lease for the
    # TTL, and a client resuming after that, within the hold, must still
    # find the reservation to take over)
    t, store = backend.tenant(), backend.store
    first = req(43, hold=2.0)
    assert (await store.admit(t, first)).ok
    await backend.sleep(0.5)
    await store.renew(t, [first.lease_id], 1.0)  # (its router's last renewal: kept until 0.5 + 1 + 2)
    await backend.sleep(2.0)  # (2.5 s in: the lease ended at 1.5, the hold not yet)
    d = await store.admit(t, req(29, base=14, replaces=(first.lease_id,)))
    assert d.ok and d.taken == 43, d
