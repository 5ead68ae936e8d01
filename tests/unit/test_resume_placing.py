"""Placing a resuming client by its id's counts as the buffer grows
(router/resume_position.py's ``Placer`` in ``handle_resume``), on the
in-memory store: a client a few milliseconds ahead of a live buffer, one
ahead of a dead router's, ids no event of the stream can count, what a
waiting client reads, and a store that fails while it waits."""

from __future__ import annotations

import asyncio

import pytest

import router.resume_http as resume_http
from replicas.protocol import FinishReason, SamplingParams
from router.errors import BadRequest, NotFound, ServiceUnavailable
from router.resume import ResumeMeta, ResumeWriter, encode_meta
from router.resume_http import Position, handle_resume
from router.sse import ChunkEncoder
from router.state import StoreUnavailable
from router.state.memory import MemoryStore
from tests.unit.test_resume_takeover import policy, service

ENC = ChunkEncoder(False, "cmpl-s1", "m", 7)
# ids 1-2-5, 2-3-9, 3-4-11, 4-5-12
EVENTS = [ENC.delta("Hello", FinishReason.NONE, b"-2-5"), ENC.delta(" wor", FinishReason.NONE, b"-3-9"),
          ENC.delta("ld", FinishReason.NONE, b"-4-11"), ENC.delta("!", FinishReason.NONE, b"-5-12")]


async def _stream(owner: str, lost: bool, temperature: float, max_tokens: int = 50,
                  include_usage: bool = False):
    """A service whose store holds stream s1 with EVENTS[:2] (``owner``: the
    router generating it, "" for none: it died)."""
    svc = await service()
    store = MemoryStore()
    svc.store, svc.resume = store, ResumeWriter(store, 60)
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 7, include_usage,
                      SamplingParams(max_tokens=max_tokens, temperature=temperature), [1, 2])
    await store.stream_open("s1", encode_meta(meta), owner, 60, lost=lost)
    store.append_now("s1", EVENTS[:2], [10, 11, 12], 9, False, owner, 60)
    return svc, store


@pytest.mark.parametrize(("temperature", "lost"), [(0.0, False), (0.0, True), (0.8, False), (0.8, True)])
async def test_a_client_a_few_ms_ahead_of_a_live_buffer_follows_it_sampled_or_not(temperature, lost) -> None:
    # Router b generates the stream (after a router that died, ``lost``); its
    # client has event 3, which b sends before it stores it (a few ms later).
    # A sampled stream whose router once died was refused (400 resume_gap)
    # before the resume could follow b's buffer to event 3.
    svc, store = await _stream("router-b", lost, temperature)
    resp = await handle_resume(svc, policy(), "s1", Position(3, 4, 11))
    store.append_now("s1", EVENTS[2:], [13, 14], 12, True, "router-b", 60)  # (b stores events 3 and 4)
    assert [c async for c in resp.iterator] == [EVENTS[3]]


async def test_a_sampled_client_ahead_of_a_dead_routers_buffer_is_told_in_the_stream() -> None:
    # (as before placing by counts: the take-over finds it ahead and cannot
    # regenerate sampled text; a 200 whose one event is the resume_gap error)
    svc, _ = await _stream("", True, 0.8)
    resp = await handle_resume(svc, policy(), "s1", Position(3, 4, 11))
    out = [c async for c in resp.iterator]
    await asyncio.gather(*svc.tasks)
    assert len(out) == 1 and b'"code":"resume_gap"' in out[0], out


@pytest.mark.parametrize("pos", [Position(1, 51, 99999), Position(3, 4, 11, 2)])
async def test_an_id_no_event_of_the_stream_can_count_is_a_400_at_once(pos: Position) -> None:
    # (more tokens than the request allows, or a usage event it never had: it
    # waited while the stream lived, placed again, reading the buffer, as it grew)
    svc, _ = await _stream("router-b", False, 0.0)
    with pytest.raises(BadRequest) as e:
        await handle_resume(svc, policy(), "s1", pos)
    assert e.value.code == "resume_mismatch"


async def test_a_waiting_client_reads_each_event_about_once(monkeypatch) -> None:
    # An id level with the buffer in events, past it in counts, waits while a
    # live router stores more. Placed again on every poll that saw the buffer
    # grow, it read the whole buffer each time (quadratic; on Redis each read is
    # a script holding the server for every tenant).
    monkeypatch.setattr(resume_http, "TAIL_POLL", 0.001)
    svc, store = await _stream("router-b", False, 0.0, max_tokens=5000)
    read, events_read = store.stream_read, [0]

    async def counted(sid, after, tokens=True):
        snap = await read(sid, after, tokens)
        events_read[0] += len(snap.events) if snap else 0
        return snap

    monkeypatch.setattr(store, "stream_read", counted)
    resp = await handle_resume(svc, policy(), "s1", Position(2, 4000, 9999))  # (never placed: the stream stops short)
    n = 300

    async def live() -> None:
        for i in range(3, n + 1):
            await asyncio.sleep(0.003)
            store.append_now("s1", [ENC.delta("ab", FinishReason.NONE, b"-%d-%d" % (i + 10, 2 * i + 10))], [10],
                             2 * i + 10, i == n, "router-b", 60)

    task = asyncio.ensure_future(live())
    out = [c async for c in resp.iterator]
    await task
    assert len(out) == 1 and b'"code":"resume_mismatch"' in out[0], out  # (its generation ended short of it)
    assert events_read[0] <= 3 * n, events_read[0]


@pytest.mark.parametrize("failures", [3, 1000])
async def test_a_store_failing_while_a_client_is_placed_again_is_tried_again(monkeypatch, failures) -> None:
    # (placing again read the store once: a Redis timeout ended the response
    # with no event. Now as every read there: tried again for REREAD_GRACE,
    # then a resume_unavailable error event)
    monkeypatch.setattr(resume_http, "REREAD_GRACE", 0.3)
    svc, store = await _stream("router-b", False, 0.0)
    resp = await handle_resume(svc, policy(), "s1", Position(3, 4, 11))
    read, left = store.stream_read, [failures]

    async def flaky(sid, after, tokens=True):
        if after == 2 and left[0]:  # (placing again reads past the 2 events it has read; following, past 3)
            left[0] -= 1
            raise StoreUnavailable("timeout")
        return await read(sid, after, tokens)

    monkeypatch.setattr(store, "stream_read", flaky)
    store.append_now("s1", EVENTS[2:], [13, 14], 12, True, "router-b", 60)
    out = [c async for c in resp.iterator]
    if failures < 10:
        assert out == [EVENTS[3]] and left == [0]
    else:
        assert len(out) == 1 and b'"code":"resume_unavailable"' in out[0], out


@pytest.mark.parametrize("failing", [1, 2, 3])
async def test_a_placing_read_the_store_cannot_answer_is_a_503_not_a_replay_by_number(monkeypatch, failing) -> None:
    # A fail-open store answers a Redis timeout from its local fallback, which
    # lacks the stream: the read is None (and the store unhealthy). Placing took
    # that for "nothing to do" and the resume replayed the events after the
    # client's number: a client of another split (it has "Hello world", the
    # buffer's event 3, under id 2-4-11) got "ld" twice. (``failing``: the
    # placing's first or second read, or the read of the events after where
    # it placed the client, which answered 404 stream_not_found.)
    svc, store = await _stream("", False, 0.0)
    store.append_now("s1", EVENTS[2:], [13, 14], 12, True, "", 60)
    read, reads = store.stream_read, [0]

    async def fallback(sid, after, tokens=True):
        reads[0] += 1
        if reads[0] == failing + 1:  # (read 1: handle_resume's own, before placing)
            store.healthy = False
            return None
        return await read(sid, after, tokens)

    monkeypatch.setattr(store, "stream_read", fallback)
    with pytest.raises(ServiceUnavailable) as e:
        resp = await handle_resume(svc, policy(), "s1", Position(2, 4, 11))
        pytest.fail(f"resumed: {[c async for c in resp.iterator]}")
    assert e.value.code == "state_store_unavailable"
    store.healthy = True  # (the store back: the same id gets the rest of the buffer's event 3 and event 4)
    resp = await handle_resume(svc, policy(), "s1", Position(2, 4, 11))
    assert [c async for c in resp.iterator] == [EVENTS[3]]


@pytest.mark.parametrize("failing", [1, 2])
async def test_a_buffer_that_expires_while_the_client_is_placed_is_a_404_on_a_healthy_store(monkeypatch,
                                                                                           failing) -> None:
    # (the store healthy, the placing's read finds no buffer: it expired
    # between two reads; "stream not found", as any read of it says, not a
    # 503 that has the client retry a stream that is gone)
    svc, store = await _stream("", False, 0.0)
    store.append_now("s1", EVENTS[2:], [13, 14], 12, True, "", 60)
    read, reads = store.stream_read, [0]

    async def expired(sid, after, tokens=True):
        reads[0] += 1
        return None if reads[0] == failing + 1 else await read(sid, after, tokens)

    monkeypatch.setattr(store, "stream_read", expired)
    with pytest.raises(NotFound) as e:
        await handle_resume(svc, policy(), "s1", Position(2, 4, 11))
    assert e.value.code == "stream_not_found"


async def test_a_client_ahead_of_a_buffer_that_finishes_short_of_it_is_told_in_the_stream(monkeypatch) -> None:
    # Ahead of a live buffer by events, it follows it; the stream ended short
    # of its id (another stream's, or made up): an empty 200, a silent end,
    # where a resume after the end is a 400.
    monkeypatch.setattr(resume_http, "TAIL_POLL", 0.001)
    svc, store = await _stream("router-b", False, 0.0)
    resp = await handle_resume(svc, policy(), "s1", Position(6, 8, 20))
    store.append_now("s1", EVENTS[2:], [13, 14], 12, True, "router-b", 60)
    out = [c async for c in resp.iterator]
    assert len(out) == 1 and b'"code":"resume_mismatch"' in out[0] and b"past the end" in out[0], out
    with pytest.raises(BadRequest, match="past the end"):
        await handle_resume(svc, policy(), "s1", Position(6, 8, 20))
