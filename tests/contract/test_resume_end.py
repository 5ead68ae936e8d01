"""A router that died between a stream's finish and its stored ``[DONE]``,
on each store: with Redis the resume writer batches its appends, and the
end a resume sends must land in the buffer before it is finished
(tests/unit/test_resume_tail.py has the cases)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from replicas.protocol import FinishReason, SamplingParams
from router.admission import Admission
from router.resume import ResumeMeta, ResumeWriter, decode_meta, encode_meta
from router.resume_http import Position, _resume, parse_last_event_id
from router.resume_tail import done_at
from router.sse import DONE, ChunkEncoder, is_done
from router.state.base import CLAIM_TTL
from tests.contract.conftest import Backend
from tests.unit.test_resume_takeover import policy, service


async def test_a_resume_sends_and_stores_the_end_its_dead_router_did_not_store(backend: Backend) -> None:
    store, sid = backend.store, backend.tenant("s")
    svc = await service()
    svc.store, svc.resume, svc.admission = store, ResumeWriter(store, 60), Admission(store, svc.metrics)
    await svc.resume.start()
    try:
        meta = ResumeMeta("t", True, "m", "chatcmpl-1", 7, True, SamplingParams(max_tokens=8), [1, 2, 3])
        enc = ChunkEncoder(True, "chatcmpl-1", "m", 7)
        await store.stream_open(sid, encode_meta(meta), "router-a", 60)
        await store.stream_append(sid, [enc.delta("Hello", FinishReason.NONE, b"-2-5"),
                                        enc.delta(" world", FinishReason.STOP, b"-3-11")],
                                  [10, 11, 12], 11, False, "router-a", 60)
        await backend.sleep(CLAIM_TTL + 1)  # router a died before the usage event and [DONE]
        snap = await store.stream_read(sid, 2)
        out = [c async for c in _resume(svc, policy(), sid, decode_meta(snap.meta), snap, Position(2, 3, 11))]
        await asyncio.gather(*svc.tasks)
        assert len(out) == 2 and is_done(out[1]), out
        usage = msgspec.json.decode(out[0].split(b"data: ", 1)[1])["usage"]
        assert usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        after = await store.stream_read(sid, 2)
        assert after.finished and after.events == out and not after.owner
        assert list(after.token_ids) == [10, 11, 12] and after.text_len == 11
    finally:
        await svc.resume.close()


class _Counting:
    """The store, counting the events each ``stream_read`` returns."""

    def __init__(self, store) -> None:
        self.store, self.read = store, []

    async def stream_read(self, sid, after, tokens=True):
        snap = await self.store.stream_read(sid, after, tokens)
        self.read.append(len(snap.events) if snap is not None else 0)
        return snap


async def test_telling_a_resume_at_done_reads_no_more_than_the_last_event(backend: Backend) -> None:
    # done_at runs before the resume is charged: it read every event after
    # the id given (a long stream's MBs for Last-Event-ID: 1, then a 429,
    # again and again by a tenant over its limit)
    store, sid = backend.store, backend.tenant("s")
    enc = ChunkEncoder(True, "chatcmpl-1", "m", 7)
    await store.stream_open(sid, encode_meta(ResumeMeta("t", True, "m", "chatcmpl-1", 7, True,
                                                        SamplingParams(max_tokens=500), [1])), "router-a", 60)
    events = [enc.delta("x", FinishReason.NONE, b"-%d-%d" % (i, i)) for i in range(1, 300)]
    await store.stream_append(sid, [*events, b"id: 300\n" + DONE], list(range(299)), 299, True, "router-a", 60)
    counting = _Counting(store)
    svc = SimpleNamespace(store=counting)
    assert not await done_at(svc, sid, "t", parse_last_event_id("1"))
    assert not await done_at(svc, sid, "t", parse_last_event_id("299"))
    assert not await done_at(svc, sid, "other-tenant", parse_last_event_id("300"))
    assert await done_at(svc, sid, "t", parse_last_event_id("300"))
    assert counting.read and max(counting.read) <= 1, counting.read
