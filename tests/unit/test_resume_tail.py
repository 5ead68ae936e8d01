"""A router that died with the end of a stream half stored.

The finish event, the usage event and the buffer's ``[DONE]`` reach the
state store in separate writes. Router a died after the finish (or the last
token, at ``max_tokens``) was stored and before ``[DONE]`` was: a resume must
send what of the end is missing, finish the buffer and generate nothing. (It
generated past the end after an end-of-sequence, or asked a replica for no
tokens at ``max_tokens`` and ended with ``stream_lost``.) The one replica here
is never ready, so anything that tried to generate would end with
``no_replica_available``.
"""

from __future__ import annotations

import asyncio

import msgspec

from replicas.protocol import FinishReason, SamplingParams
from router.admission import Admission
from router.resume import ResumeMeta, ResumeWriter, decode_meta, encode_meta
from router.replay_slices import events_of
from router.resume_http import Position, _resume
from router.sse import DONE, ChunkEncoder, is_done
from router.state.base import CLAIM_TTL
from router.state.memory import MemoryStore
from tests.unit.test_resume_takeover import Clock, policy, service


def _done(n: int) -> bytes:
    """``[DONE]`` as event ``n`` (its id is its number alone: router/sse.py)."""
    return b"id: %d\n" % n + DONE


PROMPT = [1, 2, 3]


async def died_at_the_end(max_tokens: int = 8, include_usage: bool = False, finish: FinishReason = FinishReason.STOP,
                          stored: str = "finish", chat: bool = False, continuous_usage: bool = False,
                          stop: list[str] | None = None, include: bool = False):
    """Stream s1 of router a: "Hello" (2 tokens), then " world" (1 token)
    with ``finish`` (or, ``finish`` NONE, without: the finish came in an
    event of its own). ``stored``: how far its end reached the store before
    a died (``"finish"``, ``"usage"`` or ``"tokens"``: the last token's
    event only)."""
    clock = Clock()
    store = MemoryStore(clock)
    svc = await service()
    svc.store, svc.resume, svc.admission = store, ResumeWriter(store, 60), Admission(store, svc.metrics)
    params = SamplingParams(max_tokens=max_tokens, stop=stop or [], include_stop_str_in_output=include)
    meta = ResumeMeta("t", chat, "m", "cmpl-s1", 7, include_usage, params, PROMPT,
                      continuous_usage, lease="lease-a")
    enc = ChunkEncoder(chat, "cmpl-s1", "m", 7)
    # a's admission lease for the stream (a tenant at max_concurrent 1 is at its limit with it)
    await svc.admission.admit(policy(max_concurrent=1), 1, lease_id="lease-a")
    await store.stream_open("s1", encode_meta(meta), "router-a", 60)
    store.append_now("s1", [enc.delta("Hello", FinishReason.NONE, b"-2-5")], [10, 11], 5, False, "router-a", 60)
    store.append_now("s1", [enc.delta(" world", finish, b"-3-11-1" if finish else b"-3-11")], [12], 11, False,
                     "router-a", 60)
    if stored == "usage":
        store.append_now("s1", [enc.usage(len(PROMPT), 3, b"-3-11-2")], [], 11, False, "router-a", 60)
    clock.now += CLAIM_TTL + 1  # a died, its claim ran out
    return svc, store


async def resume_at(svc, pos: Position) -> list[bytes]:
    snap = await svc.store.stream_read("s1", pos.event)
    out = [c async for c in _resume(svc, policy(), "s1", decode_meta(snap.meta), snap, pos)]
    await asyncio.gather(*svc.tasks)
    return [e for c in out for e in events_of(c)]  # (a replay joins the stored events in slices)


def chunk(event: bytes) -> dict:
    return msgspec.json.decode(event.split(b"data: ", 1)[1])


async def test_a_stream_whose_finish_was_stored_gets_its_done_and_nothing_generated() -> None:
    svc, store = await died_at_the_end()
    out = await resume_at(svc, Position(2, 3, 11))
    assert out == [_done(3)], out
    after = await store.stream_read("s1", 0)
    assert after.finished and after.total_events == 3 and after.events[-1] == _done(3) and after.owner == ""
    # the lease a died holding ends with the stream (a continuation's admission
    # replaced it; without one it held the tenant's only slot until it expired)
    assert (await store.usage("t", rpm=0, tpm=0)).active_streams == 0
    await svc.admission.admit(policy(max_concurrent=1), 1)  # the client's next request
    # a client that had only the first event gets the finish from the buffer, then [DONE]
    out = await resume_at(svc, Position(1, 2, 5))
    assert [chunk(e)["choices"][0]["finish_reason"] for e in out[:-1]] == ["stop"] and is_done(out[-1]), out


async def test_the_usage_event_it_asked_for_and_did_not_store_is_sent_with_the_whole_streams_counts() -> None:
    svc, store = await died_at_the_end(include_usage=True)
    out = await resume_at(svc, Position(2, 3, 11))
    assert len(out) == 2 and is_done(out[1]), out
    assert out[0].startswith(b"id: 3-3-11-2\n") and chunk(out[0])["choices"] == []
    assert chunk(out[0])["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    after = await store.stream_read("s1", 2)
    assert after.finished and after.events == [out[0], _done(4)]


async def test_a_stored_usage_event_is_not_sent_again() -> None:
    svc, _ = await died_at_the_end(include_usage=True, stored="usage")
    assert await resume_at(svc, Position(3, 3, 11)) == [_done(4)]


async def test_at_max_tokens_without_a_stored_finish_the_finish_is_sent_not_a_stream_lost() -> None:
    # (the upstream sent the finish in an event of its own, which a did not store)
    svc, store = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, chat=True, include_usage=True)
    out = await resume_at(svc, Position(2, 3, 11))
    assert len(out) == 3 and is_done(out[2]), out
    assert out[0].startswith(b"id: 3-3-11-1\n") and chunk(out[0])["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    assert out[1].startswith(b"id: 4-3-11-2\n") and chunk(out[1])["usage"]["completion_tokens"] == 3
    assert (await store.stream_read("s1", 0)).finished


async def test_at_max_tokens_with_stop_strings_the_end_is_generated_not_sent_without_the_held_back_text() -> None:
    # (its replica may have held back its last characters, which came with the finish a did not store:
    # finishing here would drop them, so a replica is asked for no more tokens, which sends that text)
    svc, store = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, stop=["wolves"])
    out = await resume_at(svc, Position(2, 3, 11))
    assert b'"code":"no_replica_available"' in out[-1], out  # it tried to generate the end
    assert not (await store.stream_read("s1", 0)).finished
    # (with include_stop_str_in_output nothing is held back: the end is sent as without stop strings)
    svc, store = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, stop=["wolves"], include=True)
    out = await resume_at(svc, Position(2, 3, 11))
    assert len(out) == 2 and chunk(out[0])["choices"][0]["finish_reason"] == "length" and is_done(out[1]), out


async def test_with_continuous_usage_the_finish_it_sends_has_the_usage_so_far() -> None:
    svc, _ = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, continuous_usage=True)
    out = await resume_at(svc, Position(2, 3, 11))
    assert chunk(out[0])["choices"][0]["finish_reason"] == "length" and is_done(out[1]), out
    assert chunk(out[0])["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_a_client_that_had_the_end_the_buffer_lacks_gets_only_the_rest() -> None:
    # a sent the finish and the usage event to its client and died before
    # storing them: the client is two events ahead, and only [DONE] is left
    svc, store = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, include_usage=True)
    assert await resume_at(svc, Position(4, 3, 11)) == [_done(5)]
    after = await store.stream_read("s1", 0)
    assert after.finished and after.total_events == 5 and after.events[2:4] == [b"", b""]


async def test_a_finish_id_for_an_event_the_buffer_holds_does_not_drop_the_finish() -> None:
    # (``N-T-C-1`` where the buffer's event N is a token's, no finish: another
    # stream's id, or a made-up one. Only a placeholder for event N, from a
    # resume cut off after padding for it, says what of the end a level client
    # has: the buffer was finished without its finish, and every client that
    # resumed from it got none)
    svc, store = await died_at_the_end(max_tokens=3, finish=FinishReason.NONE, include_usage=True)
    out = await resume_at(svc, Position(2, 3, 11, 1))
    assert len(out) == 3 and out[0].startswith(b"id: 3-3-11-1\n") and is_done(out[2]), out
    assert chunk(out[0])["choices"][0]["finish_reason"] == "length"
    after = await store.stream_read("s1", 2)
    assert after.finished and after.events == out


async def test_an_id_past_what_the_end_could_hold_is_a_mismatch_and_the_stream_stays_open() -> None:
    svc, store = await died_at_the_end(include_usage=True)
    for bogus in (Position(4, 3, 11), Position(3, 4, 13)):  # two events past the finish; a token more than it has
        out = await resume_at(svc, bogus)
        assert len(out) == 1 and b'"code":"resume_mismatch"' in out[0], out
    after = await store.stream_read("s1", 0)
    assert not after.finished and after.total_events == 2 and after.owner == ""
    out = await resume_at(svc, Position(2, 3, 11))  # its real client
    assert chunk(out[0])["usage"]["total_tokens"] == 6 and is_done(out[1])


async def test_a_client_leaving_while_the_end_is_read_gives_the_claim_back() -> None:
    # (it stayed claimed and renewed by this router for good: every later
    # resume followed an owner that never wrote)
    svc, store = await died_at_the_end()
    read, held = store.stream_read, asyncio.Event()

    async def slow_tail(sid, after, tokens=True):
        if not tokens:  # (the read of the last events)
            held.set()
            await asyncio.sleep(30)
        return await read(sid, after, tokens)

    store.stream_read = slow_tail
    task = asyncio.ensure_future(resume_at(svc, Position(2, 3, 11)))
    await asyncio.wait_for(held.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.gather(*svc.tasks)
    store.stream_read = read
    assert not (await store.stream_read("s1", 0)).owner and "s1" not in svc.resume.live
    assert await resume_at(svc, Position(2, 3, 11)) == [_done(3)]


async def test_a_stream_whose_last_events_cannot_be_read_is_not_continued(monkeypatch) -> None:
    # (a fail-open store answering from its local fallback has no buffer:
    # taken for "not ended", the stream was continued past its stored finish)
    import router.resume_http as resume_http

    monkeypatch.setattr(resume_http, "REREAD_GRACE", 0.2)
    svc, store = await died_at_the_end()
    read = store.stream_read

    async def no_tail(sid, after, tokens=True):
        return None if not tokens else await read(sid, after, tokens)

    store.stream_read = no_tail
    out = await resume_at(svc, Position(2, 3, 11))
    assert len(out) == 1 and b'"code":"resume_unavailable"' in out[0], out
    store.stream_read = read
    after = await store.stream_read("s1", 0)
    assert not after.finished and not after.owner and after.total_events == 2


async def test_a_stream_that_had_not_ended_is_still_continued() -> None:
    svc, _ = await died_at_the_end(finish=FinishReason.NONE)
    out = await resume_at(svc, Position(2, 3, 11))
    assert b'"code":"no_replica_available"' in out[-1], out  # it tried to generate the rest


async def padded_finish_then_usage(max_tokens: int):
    """A resume (router b) padded for its client's finish event (event 2),
    regenerated its tokens silently (stored with no event), stored the usage
    event (3) and died before ``[DONE]`` reached the store: the buffer's
    finish is a placeholder, its usage event real."""
    clock = Clock()
    store = MemoryStore(clock)
    svc = await service()
    svc.store, svc.resume, svc.admission = store, ResumeWriter(store, 60), Admission(store, svc.metrics)
    meta = ResumeMeta("t", False, "m", "cmpl-s1", 7, True, SamplingParams(max_tokens=max_tokens), [1, 2, 3], False,
                      lease="lease-a")
    enc = ChunkEncoder(False, "cmpl-s1", "m", 7)
    await svc.admission.admit(policy(max_concurrent=1), 1, lease_id="lease-a")
    await store.stream_open("s1", encode_meta(meta), "router-b", 60, lost=True)
    store.append_now("s1", [enc.delta("Hello", FinishReason.NONE, b"-2-5")], [10, 11], 5, False, "router-b", 60)
    store.append_now("s1", [b""], [], None, False, "router-b", 60)  # the pad for the client's finish event
    store.append_now("s1", [], [12], 11, False, "router-b", 60)  # its tokens, regenerated silently
    usage = ChunkEncoder(False, "cmpl-s1", "m", 7, event_id=2).usage(3, 3, b"-3-11-2")
    store.append_now("s1", [usage], [], 11, False, "router-b", 60)
    clock.now += CLAIM_TTL + 1
    return svc


async def test_a_stored_usage_event_after_a_padded_finish_says_the_output_ended() -> None:
    # (the buffer held no real finish, so the end went unseen: an end-of-sequence
    # finish was continued past its end, one at max_tokens was sent again)
    svc = await padded_finish_then_usage(8)  # (ended on a stop or end-of-sequence, below max_tokens)
    assert await resume_at(svc, Position(3, 3, 11, 2)) == [_done(4)]
    svc = await padded_finish_then_usage(8)
    out = await resume_at(svc, Position(2, 3, 11, 1))  # (the client had the finish, not the usage event)
    assert len(out) == 2 and chunk(out[0])["usage"] is not None and is_done(out[-1]), out
    svc = await padded_finish_then_usage(3)  # (ended at max_tokens)
    assert await resume_at(svc, Position(3, 3, 11, 2)) == [_done(4)]
