"""A router that died between a stream's finish and its stored ``[DONE]``,
on each store: with Redis the resume writer batches its appends, and the
end a resume sends must land in the buffer before it is finished
(tests/unit/test_resume_tail.py has the cases)."""

from __future__ import annotations

import asyncio

import msgspec

from replicas.protocol import FinishReason, SamplingParams
from router.admission import Admission
from router.resume import ResumeMeta, ResumeWriter, decode_meta, encode_meta
from router.resume_http import Position, _resume
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
