"""A continuation that never got going leaves its stream resumable.

``_resume`` claims a stream whose client left, is admitted again and waits
for its first piece. Refused there (no ready replica, a limit, a time limit)
or left by its client meanwhile, it must give its claim back and leave the
buffer as it was, so a later resume (here or on another router) continues it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from policies.batching import AimdSettings
from replicas.pool import ReplicaPool
from replicas.protocol import SamplingParams
from replicas.spec import ReplicaSpec
from router.admission import Admission
from router.metrics import Metrics
from router.resume import ResumeMeta, ResumeWriter, decode_meta
from router.resume_http import Position, _resume
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from router.state.base import CLAIM_TTL
from router.state.memory import MemoryStore
from router.tenants import ResolvedLimits, TenantPolicy


def policy(on_limit: str = "reject", max_concurrent: int = 0) -> TenantPolicy:
    return TenantPolicy(
        name="t", priority="normal", rank=1, weight=1.0, models=["*"], queue_depth=10, chunk_tokens=16,
        on_limit=on_limit, log_content=False,
        limits=ResolvedLimits(requests_per_minute=0, tokens_per_minute=0, max_concurrent=max_concurrent,
                              max_prompt_tokens=0, max_tokens=0, max_sockets=0, queue_wait=30.0, first_token=0.0, stall=0.0,
                              total=0.0),
    )


async def service() -> SimpleNamespace:
    """The parts of RouterService a resume uses; the one replica is not ready (restarting)."""
    store, metrics = MemoryStore(), Metrics()
    pool = ReplicaPool([ReplicaSpec(name="r0")])
    tasks: list[asyncio.Task] = []
    return SimpleNamespace(
        store=store, resume=ResumeWriter(store, 60), metrics=metrics, pool=pool,
        admission=Admission(store, metrics), scheduler=Scheduler(pool, metrics, SchedulerSettings(), AimdSettings()),
        config=SimpleNamespace(max_failovers=2, failover_wait=0.0), rank=lambda p: 0, tasks=tasks,
        background=lambda c: tasks.append(asyncio.ensure_future(c)),
    )


async def left_after_one_event(svc: SimpleNamespace) -> None:
    """Stream s1: its client left after one event (2 tokens, 5 characters)."""
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s1", meta)
    svc.resume.append("s1", b"id: 1-2-5\ndata: {}\n\n", [10, 11], 5)
    await svc.resume.detach("s1", 5)


async def resume(svc: SimpleNamespace, pol: TenantPolicy) -> list[bytes]:
    snap = await svc.store.stream_read("s1", 1)
    return [chunk async for chunk in _resume(svc, pol, "s1", decode_meta(snap.meta), snap, Position(1, 2, 5))]


async def test_a_continuation_refused_for_want_of_a_replica_leaves_the_stream_resumable() -> None:
    svc = await service()
    await left_after_one_event(svc)
    out = await resume(svc, policy())
    await asyncio.gather(*svc.tasks)
    assert b'"code":"no_replica_available"' in out[-1]  # the client is told
    # with no id of its own: the client resumes from the last one it has (a
    # numbered error, one past the buffer, made that resume a 400)
    assert not any(line.startswith(b"id:") for line in out[-1].split(b"\n")), out[-1]
    after = await svc.store.stream_read("s1", 0)
    assert not after.finished and after.total_events == 1, after.events
    assert after.owner == "" and "s1" not in svc.resume.live  # the claim is given back
    # (and a later resume claims it again: refused the same way while the replica is down)
    assert b'"code":"no_replica_available"' in (await resume(svc, policy()))[-1]


async def test_a_continuation_left_while_it_waits_for_its_tenants_limit_gives_its_claim_back() -> None:
    svc = await service()
    pol = policy(on_limit="queue", max_concurrent=1)
    other = await svc.admission.admit(pol, 1)  # the tenant's one stream is taken
    await left_after_one_event(svc)
    task = asyncio.ensure_future(resume(svc, pol))
    await asyncio.sleep(0.2)
    assert "s1" in svc.resume.live  # claimed; waiting in the tenant's line
    task.cancel()  # the client disconnects
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.gather(*svc.tasks)
    assert "s1" not in svc.resume.live
    assert (await svc.store.stream_read("s1", 0)).owner == ""
    await svc.admission.finish(other, 1)


async def test_a_client_ahead_of_this_routers_own_live_stream_follows_it_and_never_claims_it(monkeypatch) -> None:
    # The buffer of a stream this router generates lags the client for good
    # (its appends were lost): past the catch-up wait the resume must keep
    # following, not claim the stream and start a second generation into it.
    import router.resume_http as resume_http
    monkeypatch.setattr(resume_http, "CATCH_UP", 0.05)
    svc = await service()
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s1", meta)  # live on this router
    svc.resume.append("s1", b"id: 1-2-5\ndata: {}\n\n", [10, 11], 5)
    snap = await svc.store.stream_read("s1", 3)
    out: list[bytes] = []

    async def client() -> None:
        async for chunk in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, Position(3, 4, 9)):
            out.append(chunk)

    task = asyncio.ensure_future(client())
    await asyncio.sleep(0.5)
    assert not task.done() and out == [], out  # still following; no continuation, no error
    svc.resume.append("s1", b"e2", [12], 7)
    svc.resume.append("s1", b"e3", [13], 9)
    svc.resume.append("s1", b"e4", [14], 11)
    await svc.resume.finish("s1", b"data: [DONE]\n\n", 11)
    await asyncio.wait_for(task, 2)
    assert b"".join(out) == b"e4data: [DONE]\n\n"  # (the replay joins the stored events in slices)


async def test_a_resume_that_loses_its_buffer_mid_way_ends_with_an_error_event_not_silently(monkeypatch) -> None:
    # (a Redis timeout under load: a fail-open store answers the read from its
    # local fallback, which lacks the buffer; the client saw a clean end of
    # the response without [DONE] and without an error)
    import router.resume_http as resume_http
    monkeypatch.setattr(resume_http, "REREAD_GRACE", 0.5)
    svc = await service()
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s1", meta)  # live on this router: the resume follows it
    svc.resume.append("s1", b"e1", [10, 11], 5)
    snap = await svc.store.stream_read("s1", 0)
    real_read, misses = svc.store.stream_read, [3]

    async def flaky_read(sid, after, tokens=True):
        if misses[0]:
            misses[0] -= 1
            return None
        return await real_read(sid, after, tokens)

    monkeypatch.setattr(svc.store, "stream_read", flaky_read)
    await svc.resume.finish("s1", b"[DONE]", 5)
    # a read that fails for a moment is tried again
    out = [chunk async for chunk in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, Position(0))]
    assert out == [b"e1", b"[DONE]"] and misses == [0]
    # one that keeps failing ends the resume with an error event
    misses[0] = 1000
    out = [chunk async for chunk in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, Position(0))]
    assert out[0] == b"e1" and b'"code":"resume_unavailable"' in out[-1], out


async def test_a_resume_during_a_state_store_outage_is_a_503_not_an_unknown_stream() -> None:
    from router.errors import ServiceUnavailable
    from router.resume_http import handle_resume
    from router.state import StoreUnavailable
    svc = await service()
    svc.store.healthy = False  # fail-open: reads come from the local fallback, which lacks the buffer
    with pytest.raises(ServiceUnavailable) as e:
        await handle_resume(svc, policy(), "s1", Position(0))  # type: ignore[arg-type]
    assert e.value.code == "state_store_unavailable" and e.value.headers["retry-after"] == "1"

    async def down(sid, after):
        raise StoreUnavailable("redis: timeout")  # fail-closed

    svc.store.stream_read = down
    with pytest.raises(ServiceUnavailable):
        await handle_resume(svc, policy(), "s1", Position(0))  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_quiet_live_stream_whose_claim_lapsed_is_followed_not_taken_over() -> None:
    # A stream this router generates appended nothing for longer than
    # CLAIM_TTL (a slow replica, a client that stopped reading): the store
    # shows no owner, but a resume here must still follow it, not start a
    # second generation into its buffer.
    clock = Clock()
    svc = await service()
    svc.store = MemoryStore(clock)
    svc.resume = ResumeWriter(svc.store, 60)
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s1", meta)
    svc.resume.append("s1", b"id: 1-2-5\ndata: {}\n\n", [10, 11], 5)
    clock.now += CLAIM_TTL + 1
    snap = await svc.store.stream_read("s1", 1)
    assert snap.owner == ""  # lapsed
    task = asyncio.ensure_future(_collect(svc, snap))
    await asyncio.sleep(0.3)
    assert not task.done() and "s1" in svc.resume.live  # following; no continuation, no error
    assert (await svc.store.stream_read("s1", 0)).owner == ""  # not claimed
    svc.resume.append("s1", b"e2", [12], 7)
    await svc.resume.finish("s1", b"data: [DONE]\n\n", 7)
    assert b"".join(await asyncio.wait_for(task, 2)) == b"e2data: [DONE]\n\n"


async def test_a_continuation_replaces_the_leases_of_the_routers_that_died_generating_the_stream() -> None:
    # Router a started the stream, router b continued it, both died holding
    # their leases (counted for the lease TTL). This router's continuation
    # replaces both: it was refused at the tenant's max_concurrent (b's
    # lease, written nowhere, held the slot), or after a's alone, 30 s long.
    from router.resume import encode_meta
    from router.state.base import AdmitRequest

    clock = Clock()
    svc = await service()
    svc.store = MemoryStore(clock)
    svc.resume = ResumeWriter(svc.store, 60)
    svc.admission = Admission(svc.store, svc.metrics)
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2], lease="lease-a")
    await svc.store.stream_open("s1", encode_meta(meta), "router-a", 60)
    await svc.store.stream_append("s1", [b"id: 1-2-5\ndata: {}\n\n"], [10, 11], 5, False, "router-a", 60)
    for lid in ("lease-a", "lease-b"):
        assert (await svc.store.admit("t", AdmitRequest(0, 0, 0, 1, lid, 60.0))).ok
    await svc.store.stream_release("s1", "router-a")
    assert await svc.store.stream_claim("s1", "router-b", CLAIM_TTL, "lease-b")
    clock.now += CLAIM_TTL + 1  # router b died: its claim lapsed, its lease has not
    out = await resume(svc, policy(max_concurrent=1))
    await asyncio.gather(*svc.tasks)
    # admitted (then no replica is ready here: the stream stays resumable)
    assert b'"code":"no_replica_available"' in out[-1], out[-1]
    assert (await svc.store.usage("t", rpm=0, tpm=0)).active_streams == 0  # both went, and its own is given back


async def _collect(svc, snap) -> list[bytes]:
    return [c async for c in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, Position(1, 2, 5))]


async def test_the_router_renews_the_claims_of_its_quiet_live_streams(monkeypatch) -> None:
    # (another router sharing the store must not see a quiet stream as abandoned)
    import router.resume as resume

    monkeypatch.setattr(resume, "RENEW_INTERVAL", 0.05)
    clock = Clock()
    store = MemoryStore(clock)
    writer = ResumeWriter(store, 60)
    await writer.start()
    try:
        meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
        await writer.open("s1", meta)
        for _ in range(3):  # 3 x 0.8 CLAIM_TTL without an append
            clock.now += CLAIM_TTL * 0.8
            await asyncio.sleep(0.15)
            assert (await store.stream_read("s1", 0)).owner == writer.owner
        assert not await store.stream_claim("s1", "another-router", CLAIM_TTL)
        await writer.release("s1")  # it no longer generates it: no more renewals
        clock.now += CLAIM_TTL * 0.8
        await asyncio.sleep(0.15)
        assert await store.stream_claim("s1", "another-router", CLAIM_TTL)
    finally:
        await writer.close()


async def test_a_stream_released_while_its_renewal_is_on_the_way_is_not_left_claimed(monkeypatch) -> None:
    # (the renewal reaches the store after the release: it must not claim the
    # stream again, or a resume on another router would wait up to CLAIM_TTL)
    import router.resume as resume

    monkeypatch.setattr(resume, "RENEW_INTERVAL", 0.01)
    arrived = asyncio.Event()
    in_flight = asyncio.Event()

    class SlowRoundTrip(MemoryStore):
        async def stream_renew(self, sids, owner, claim_ttl):
            in_flight.set()
            await arrived.wait()
            return await super().stream_renew(sids, owner, claim_ttl)

    store = SlowRoundTrip(Clock())
    writer = ResumeWriter(store, 60)
    await writer.start()
    try:
        await writer.open("s1", ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2]))
        await asyncio.wait_for(in_flight.wait(), 2)
        await writer.release("s1")  # the client left mid-stream
        arrived.set()
        await asyncio.sleep(0.05)  # (the renewal landed)
        assert store._streams["s1"].owner == ""
        assert await store.stream_claim("s1", "another-router", CLAIM_TTL)
    finally:
        arrived.set()
        await writer.close()


async def test_two_resumes_claiming_one_stream_at_once_on_a_router_take_it_over_once() -> None:
    # (the store lets an owner claim again: two resumes here whose claims
    # were on their way together (Redis) both took the stream over, two
    # generations into one buffer)
    class RoundTrip(MemoryStore):
        async def stream_claim(self, sid, owner, claim_ttl, lease=""):
            await asyncio.sleep(0.01)
            return await super().stream_claim(sid, owner, claim_ttl, lease)

    writer = ResumeWriter(RoundTrip(Clock()), 60)
    await writer.open("s1", ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2]))
    await writer.release("s1")  # its client left
    assert sorted(await asyncio.gather(writer.claim("s1"), writer.claim("s1"))) == [False, True]
    assert "s1" in writer.live
    await writer.release("s1")
    assert await writer.claim("s1")  # (free again once released)


async def test_a_claim_waits_for_this_routers_release_of_the_stream_to_land() -> None:
    # (the original stream's release was on its way when a resume here
    # claimed the stream; landing after the claim, it took the claim away,
    # and the claim renewals, which only extend claims held, let another
    # router take the stream over: two generations into one buffer)
    landed = asyncio.Event()

    class SlowRelease(MemoryStore):
        async def stream_release(self, sid, owner, charged=0):
            await landed.wait()
            return await super().stream_release(sid, owner, charged)

    store = SlowRelease(Clock())
    writer = ResumeWriter(store, 60)
    await writer.open("s1", ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2]))
    releasing = asyncio.ensure_future(writer.release("s1"))  # the client left: the original lets it go
    await asyncio.sleep(0)
    assert not await writer.claim("s1")  # not while that release is on its way
    landed.set()
    await releasing
    assert await writer.claim("s1", "lease-2")
    snap = await store.stream_read("s1", 0)
    assert (snap.owner, snap.lease) == (writer.owner, "lease-2") and writer._releasing == {}


async def test_a_resume_past_a_final_error_is_a_400_not_an_empty_stream() -> None:
    # (a stream that ended with stream_lost: its error event was numbered, and
    # a resume with that id was a 200 with nothing in it, over and over)
    from router.errors import BadRequest
    from router.resume_http import handle_resume

    svc = await service()
    meta = ResumeMeta("t", False, "m", "cmpl-s2", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s2", meta)
    svc.resume.append("s2", b"id: 1-2-5\ndata: {}\n\n", [10, 11], 5)
    error = b'id: 2\ndata: {"error":{"message":"lost","type":"server_error","param":null,"code":"stream_lost"}}\n\n'
    await svc.resume.finish("s2", error, 5)
    with pytest.raises(BadRequest) as info:
        await handle_resume(svc, policy(), "s2", Position(2, None, None))
    assert info.value.code == "stream_ended" and "stream_lost" in info.value.message, info.value.message


async def test_a_replay_that_reaches_events_lost_with_a_router_says_so() -> None:
    # The placeholders a continuation pads with (events only the client that
    # was ahead had) were skipped: a replay from before them had a hole.
    svc = await service()
    meta = ResumeMeta("t", False, "m", "cmpl-s3", 0, False, SamplingParams(max_tokens=8), [1, 2])
    await svc.resume.open("s3", meta)
    svc.resume.append("s3", b"id: 1-1-2\ndata: {}\n\n", [10], 2)
    svc.resume.pad("s3", 2)
    svc.resume.append("s3", b"id: 4-4-8\ndata: {}\n\n", [11, 12, 13], 8)
    await svc.resume.finish("s3", b"data: [DONE]\n\n", 8)
    snap = await svc.store.stream_read("s3", 0)
    out = [chunk async for chunk in _resume(svc, policy(), "s3", decode_meta(snap.meta), snap, Position(0, None, None))]
    assert out[0].startswith(b"id: 1-1-2") and b'"code":"resume_gap"' in out[-1] and len(out) == 2, out
    # asked for before the stream starts, a 400 (an error event, with no id,
    # left an EventSource reconnecting to the same gap for ever)
    from router.errors import BadRequest
    from router.resume_http import handle_resume

    with pytest.raises(BadRequest) as info:
        await handle_resume(svc, policy(), "s3", Position(1, None, None))
    assert info.value.code == "resume_gap" and "from 2 on" in info.value.message, info.value.message
    # past the gap: the rest replays
    assert (await handle_resume(svc, policy(), "s3", Position(3, None, None))) is not None  # (a Stream)


async def _resume_at(svc: SimpleNamespace, pos: Position) -> list[bytes]:
    snap = await svc.store.stream_read("s1", pos.event)
    out = [c async for c in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, pos)]
    await asyncio.gather(*svc.tasks)
    return out


async def test_an_id_ahead_of_a_stream_no_router_died_holding_is_refused_also_after_a_claim_given_back() -> None:
    # (a review found the first form of this check, "its last generator let it
    # go whole", undone by any continuation refused after its claim: the same
    # made-up id then got through and padded the stream for its real client)
    svc = await service()
    await left_after_one_event(svc)
    bogus = Position(3, 4, 9)
    assert b"resume_mismatch" in (await _resume_at(svc, bogus))[-1]
    assert b"no_replica_available" in (await _resume_at(svc, Position(1, 2, 5)))[-1]  # its real client, refused
    assert b"resume_mismatch" in (await _resume_at(svc, bogus))[-1]
    after = await svc.store.stream_read("s1", 0)
    assert after.total_events == 1 and not after.lost


async def test_a_client_ahead_of_a_router_that_died_is_not_refused_after_another_continuation_let_go() -> None:
    # (router a died with events its client had and the buffer lacks; a
    # second reader's continuation on b made one event, then its client left:
    # the first form of the check took the buffer for whole and refused a's
    # client its real id)
    clock = Clock()
    store = MemoryStore(clock)
    svc = await service()
    svc.store, svc.resume, svc.admission = store, ResumeWriter(store, 60), Admission(store, svc.metrics)
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2])
    from router.resume import encode_meta
    await store.stream_open("s1", encode_meta(meta), "router-a", 60)
    store.append_now("s1", [b"id: 1-1-1\ndata: {}\n\n"], [10], 1, False, "router-a", 60)
    clock.now += CLAIM_TTL + 1  # a died; it had sent events 2 and 3 to its client
    assert await store.stream_claim("s1", "router-b", CLAIM_TTL, "lease-b")
    store.append_now("s1", [b"id: 2-2-2\ndata: {}\n\n"], [11], 2, False, "router-b", 60)
    await store.stream_release("s1", "router-b")  # b's client left
    out = await _resume_at(svc, Position(3, 3, 3))
    assert b"resume_mismatch" not in out[-1], out[-1]
