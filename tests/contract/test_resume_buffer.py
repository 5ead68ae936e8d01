"""The resume buffer's contract (``stream_*``), on every store backend.

The memory store takes each write at once; with Redis the ``ResumeWriter``
batches writes into ``stream_append`` calls. Both must leave the same buffer.
"""

from __future__ import annotations

import uuid

from replicas.protocol import SamplingParams
from router.resume import ResumeMeta, ResumeWriter, decode_meta, encode_meta
from tests.contract.conftest import Backend

META = ResumeMeta("t", True, "m", "chatcmpl-x", 0, False, SamplingParams(max_tokens=8), [1, 2])


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


async def test_a_buffer_holds_its_events_tokens_and_text_length(backend: Backend) -> None:
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    await store.stream_append(s, [b"e1", b"e2"], [10, 11], 5, False, "r1", 60)
    await store.stream_append(s, [b"e3"], [12], 7, False, "r1", 60)
    snap = await store.stream_read(s, 1)
    assert snap is not None and decode_meta(snap.meta) == META
    assert (snap.events, snap.total_events, snap.token_ids, snap.text_len, snap.finished, snap.owner) == \
        ([b"e2", b"e3"], 3, [10, 11, 12], 7, False, "r1")
    assert await store.stream_read(sid(), 0) is None


async def test_a_read_past_the_end_is_empty_however_far(backend: Backend) -> None:
    # (Redis's script took 10**17 as a double that LRANGE refused: the error
    # read as an outage of the store, for every tenant)
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    await store.stream_append(s, [b"e1"], [10], 2, False, "r1", 60)
    for after in (2, 10**17, 10**40):
        snap = await store.stream_read(s, after)
        assert snap is not None and snap.events == [] and snap.total_events == 1, after


async def test_a_claim_is_taken_only_from_a_released_or_expired_owner(backend: Backend) -> None:
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    assert not await store.stream_claim(s, "r2", 10)
    await store.stream_release(s, "r2")  # not its claim: nothing changes
    assert (await store.stream_read(s, 0)).owner == "r1"
    await store.stream_release(s, "r1")
    assert await store.stream_claim(s, "r2", 10)
    assert (await store.stream_read(s, 0)).owner == "r2"


async def test_a_claim_keeps_the_lease_its_continuation_holds_for_the_next_claim(backend: Backend) -> None:
    # (a continuation replaces the leases of the stream's earlier generators:
    # the one that started it is in the metadata, the last continuation's
    # here; without it a router that died continuing a stream held the
    # tenant's slot against the next continuation for the lease's TTL)
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    assert (await store.stream_read(s, 0)).lease == ""
    await store.stream_release(s, "r1")
    assert await store.stream_claim(s, "r2", 10, "lease-2")
    assert (await store.stream_read(s, 0)).lease == "lease-2"
    await store.stream_release(s, "r2")
    assert await store.stream_claim(s, "r3", 10, "lease-3")
    assert (await store.stream_read(s, 0, tokens=False)).lease == "lease-3"


async def test_a_buffer_is_lost_once_a_router_held_it_and_died(backend: Backend) -> None:
    # (only then can a client have events the buffer lacks: an id ahead of a
    # buffer no router died holding matches no event of the stream)
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    assert not (await store.stream_read(s, 0)).lost  # (generating)
    await store.stream_release(s, "r1")  # (its client left: released, nothing lost)
    assert not (await store.stream_read(s, 0)).lost
    assert await store.stream_claim(s, "r2", 0.2, "lease-2")
    await store.stream_release(s, "r2")  # (a continuation refused: given back)
    assert not (await store.stream_read(s, 0)).lost
    assert await store.stream_claim(s, "r3", 0.2, "lease-3")
    await backend.sleep(0.2 + backend.slack)  # r3 dies: its claim runs out unreleased
    assert (await store.stream_read(s, 0, tokens=False)).lost
    assert await store.stream_claim(s, "r4", 10, "lease-4")
    await store.stream_release(s, "r4")
    assert (await store.stream_read(s, 0)).lost  # (for good: what r3 sent and lost stays lost)


async def test_a_buffer_keeps_the_most_tokens_charged_by_those_that_held_it(backend: Backend) -> None:
    # (a request whose client left counted every token its generation had,
    # more than the buffer holds: the continuation of a resume counts from
    # there, so the tokens it generates again are not charged twice)
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    await store.stream_append(s, [b"e1"], [10], 2, False, "r1", 60)
    assert (await store.stream_read(s, 0)).charged == 0
    await store.stream_release(s, "r1", 4)  # (its client left: 4 tokens counted, 1 in the buffer)
    snap = await store.stream_read(s, 0, tokens=False)
    assert (snap.charged, snap.token_ids, snap.owner) == (4, [], "")
    assert await store.stream_claim(s, "r2", 10, "lease-2")
    await store.stream_release(s, "r3", 9)  # not its claim: nothing changes
    assert (await store.stream_read(s, 0)).charged == 4
    await store.stream_release(s, "r2", 2)  # (a continuation cut short of it: the count stays)
    assert (await store.stream_read(s, 0)).charged == 4
    assert await store.stream_claim(s, "r2", 10, "lease-3")
    await store.stream_release(s, "r2", 7)
    assert (await store.stream_read(s, 0)).charged == 7
    copied = sid()  # (a fallback's buffer copied to Redis keeps it)
    await store.stream_open(copied, encode_meta(META), "", 60, lease="lease-3", charged=7)
    assert (await store.stream_read(copied, 0)).charged == 7


async def test_a_finished_buffer_says_so(backend: Backend) -> None:
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    await store.stream_append(s, [b"e1", b"[DONE]"], [10], 3, True, "r1", 60)
    snap = await store.stream_read(s, 0)
    assert snap.finished and snap.total_events == 2
    # (and is never claimed: a resume of it is told the stream is done, not continued)
    await store.stream_release(s, "r1")
    assert not await store.stream_claim(s, "r2", 10)
    assert not await store.stream_claim(s, "r1", 10)
    assert (await store.stream_read(s, 0)).owner == ""


async def test_padding_keeps_the_text_length(backend: Backend) -> None:
    # a client ahead of the buffer (events lost with their router): the
    # takeover pads the numbering; the text the buffer holds is unchanged
    writer = ResumeWriter(backend.store, retention=60.0)
    await writer.start()
    try:
        s = sid()
        await writer.open(s, META)
        writer.append(s, b"id: 1-2-5\ndata: {}\n\n", [10, 11], 5)
        await writer.detach(s, 5)
        writer.pad(s, 2)
        await writer._flush()  # (what the writer's task does a few ms later)
        snap = await backend.store.stream_read(s, 0)
        assert (snap.total_events, snap.token_ids, snap.text_len) == (3, [10, 11], 5), snap
    finally:
        await writer.close()


async def test_a_bulk_renewal_extends_only_the_owners_own_claims(backend: Backend) -> None:
    # (more streams than one Redis pipeline takes: RedisStore.CLAIMS_PER_TRIP)
    store = backend.store
    sids = [sid() for _ in range(1100)]
    for s in sids:
        await store.stream_open(s, encode_meta(META), "r1", 60)
    assert await store.stream_renew(sids, "r1", 10) == [True] * len(sids)  # its own: renewed
    assert await store.stream_renew(sids[:3], "r2", 10) == [False] * 3  # r1's: not taken
    assert (await store.stream_read(sids[0], 0)).owner == "r1"
    released = set(sids[1::2])
    for s in released:
        await store.stream_release(s, "r1")
    await store.stream_append(sids[0], [b"[DONE]"], [], 0, True, "r1", 60)
    gone = sid()
    got = await store.stream_renew([*sids, gone], "r1", 10)
    # released (its client left: waiting for a resume), finished and missing: False, and left as they are
    assert got == [s not in released and s != sids[0] for s in sids] + [False]
    assert (await store.stream_read(sids[1], 0)).owner == ""
    assert await store.stream_claim(sids[1], "r2", 10)  # a resume elsewhere takes it at once
    assert await store.stream_renew([], "r1", 10) == []
    if backend.redis is not None:  # a server that lost its scripts (restarted, flushed): loaded again
        await store._redis.script_flush()
        assert await store.stream_renew(sids[1:4], "r1", 10) == [False, True, False]


async def test_a_buffer_that_misses_events_is_marked_broken_for_good(backend: Backend) -> None:
    # Events a router wrote to its local fallback during an outage never
    # reached Redis; it went on appending after them, and a resume read the
    # events by position: a silently wrong text (a chaos review's, after a
    # 2.5 s Redis hang).
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    assert await store.stream_append(s, [b"e0", b"e1"], [10, 11], 2, False, "r1", 60, first=0)
    assert await store.stream_append(s, [b"e2"], [12], 3, False, "r1", 60, first=2)
    assert not await store.stream_append(s, [b"e5"], [15], 6, False, "r1", 60, first=5)  # (3 and 4 went elsewhere)
    assert not await store.stream_append(s, [b"e6"], [16], 7, False, "r1", 60, first=6)
    snap = await store.stream_read(s, 0)
    assert snap.broken and snap.events == [b"e0", b"e1", b"e2"] and snap.token_ids == [10, 11, 12], snap


async def test_only_the_router_that_holds_a_stream_appends_to_it(backend: Backend) -> None:
    # A router frozen past its claim came back and flushed what it held into
    # a stream another router had taken over: a resume then read garbled text.
    store, s = backend.store, sid()
    await store.stream_open(s, encode_meta(META), "r1", 60)
    assert await store.stream_append(s, [b"e0"], [10], 1, False, "r1", 60, first=0)
    await store.stream_release(s, "r1")
    assert await store.stream_claim(s, "r2", 10)
    assert not await store.stream_append(s, [b"stale"], [99], 9, False, "r1", 60, first=1)
    assert await store.stream_append(s, [b"e1"], [11], 2, True, "r2", 60, first=1)
    assert not await store.stream_append(s, [b"late"], [98], 9, False, "r2", 60, first=2)  # (finished)
    snap = await store.stream_read(s, 0)
    assert not snap.broken and snap.events == [b"e0", b"e1"] and snap.token_ids == [10, 11] and snap.text_len == 2


async def test_an_append_to_a_buffer_that_is_gone_is_not_taken(backend: Backend) -> None:
    # A Redis restarted without persistence (or flushed) lost the buffers of
    # the streams a router was writing; its appends were answered "no such
    # buffer", which read as a success, so its shutdown told their clients
    # to resume them, and each resume was a 404. An expired buffer is as gone.
    store, s, never = backend.store, sid(), sid()
    assert not await store.stream_append(never, [b"e0"], [10], 1, False, "r1", 60, first=0)
    await store.stream_open(s, encode_meta(META), "r1", 0.2)
    assert await store.stream_append(s, [b"e0"], [10], 1, False, "r1", 0.2, first=0)
    await backend.sleep(0.5)
    assert not await store.stream_append(s, [b"e1"], [11], 2, False, "r1", 60, first=1)
    assert await store.stream_read(s, 0) is None and await store.stream_read(never, 0) is None
    if backend.redis is not None:  # (the batching writer's: the memory store's cannot lose a buffer it writes)
        writer = ResumeWriter(store, retention=60.0)
        await writer.start()
        try:
            await writer.open(s, META)
            writer.append(s, b"id: 1-1-1\ndata: {}\n\n", [10], 1)
            await writer._flush()
            assert writer.resumable(s)
            await store._redis.flushall()  # type: ignore[attr-defined]
            writer.append(s, b"id: 2-2-2\ndata: {}\n\n", [11], 2)
            await writer._flush()
            assert not writer.resumable(s)
        finally:
            await writer.close()
