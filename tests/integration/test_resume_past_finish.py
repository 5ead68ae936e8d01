"""A client one finish event ahead of its dead router's buffer.

A router sends each event before its resume buffer has it (with Redis, a
flush every few milliseconds), so one that dies right after a stream's
finish event (its last tokens with ``finish_reason``) and usage event can
leave a client that has them and a buffer that does not. The resume on
another router regenerates the missing tokens (greedy), drops the text the
client has, and used to send the finish again, in an event with no text
(and the usage event again): ``finish_reason`` twice. The finish event's id
is ``N-T-C-1`` and the usage event's ``N-T-C-2``, so the resume knows the
client has them and sends neither again.

The state such a router leaves is made here from a stream served whole: its
Redis buffer is rewritten to hold only the events before the finish (the
claim of a router that died, run out: ``lost``), and the resume uses the ids
the client got.
"""

from __future__ import annotations


import httpx
import pytest

from router.state.redis_store import RedisStore
from tests.helpers import GOLD, MODEL, RouterProcess, SseEvent, aiter_sse, apoll

MAX_TOKENS = 24


def _text(ev: SseEvent) -> str:
    d = ev.json()
    assert "error" not in d, d
    return "".join(c["text"] for c in d["choices"])


def _finishes(events: list[SseEvent]) -> list[str]:
    return [c["finish_reason"] for ev in events if ev.data != "[DONE]"
            for c in ev.json()["choices"] if c["finish_reason"]]


async def _died_before_storing(store: RedisStore, rid: str, events: list[SseEvent], stored: int) -> None:
    """Rewrite ``rid``'s finished buffer as its router left it when it died
    having stored only its first ``stored`` events (with their tokens and
    text), its claim run out (``lost``, as the claim that found it so
    marks it)."""
    whole = await store.stream_read(rid, 0)
    assert whole is not None and whole.finished
    tokens, chars = (int(x) for x in events[stored - 1].id.split("-")[1:3])
    await store.stream_open(rid, whole.meta, "", 600, lost=True)
    assert await store.stream_append(rid, whole.events[:stored], list(whole.token_ids[:tokens]), chars, False,
                                     "router-a", 600)


@pytest.mark.parametrize("had_usage", [False, True], ids=["had-finish", "had-finish-and-usage"])
async def test_a_client_that_had_the_finish_its_dead_router_did_not_store_gets_no_second_finish(
        tmp_path, redis_server, had_usage: bool) -> None:
    router = RouterProcess(tmp_path / "r", replicas=1, sim={"step_base_ms": 3},
                           settings={"state": {"backend": "redis", "url": redis_server.url}}).start()
    store = RedisStore(redis_server.url)
    body = {"model": MODEL, "prompt": "Le caf", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                rid = r.headers["x-request-id"]
                events = [ev async for ev in aiter_sse(r)]
            assert events[-1].data == "[DONE]"
            finish, usage = events[-3], events[-2]
            assert _finishes([finish]) == ["length"] and usage.json()["usage"]["completion_tokens"] == MAX_TOKENS

            async def finished() -> bool:
                snap = await store.stream_read(rid, 0)
                return snap is not None and snap.finished

            await apoll(finished, 10, what="the stream's buffer finished")
            have = events[:-1] if had_usage else events[:-2]  # the client's events
            # (lost with it: the last event before the finish, the finish, the usage event)
            await _died_before_storing(store, rid, events, len(events) - 4)
            last = have[-1].id

            async def resume() -> list[SseEvent]:
                async with http.stream("GET", f"/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                    assert r.status_code == 200, await r.aread()
                    return [ev async for ev in aiter_sse(r)]

            rest = await resume()
            assert rest and rest[-1].data == "[DONE]", [ev.data for ev in rest]
            assert _finishes(rest) == [], [ev.data for ev in rest]  # (was: "length" again)
            assert "".join(_text(ev) for ev in have + rest[:-1]) == "".join(_text(ev) for ev in events[:-1])
            if had_usage:
                assert len(rest) == 1, [ev.data for ev in rest]  # (was: the usage event again too)
            else:
                assert [ev.id for ev in rest[:-1]] == [usage.id], [ev.id for ev in rest]
                assert rest[0].json()["usage"] == usage.json()["usage"]
            # the buffer now numbers as the client does: a resume from the same id gets the same again
            # (from the buffer: finished, nothing generated)
            await apoll(finished, 10, what="the resumed buffer finished")
            again = await resume()
            assert [(ev.id, ev.data) for ev in again] == [(ev.id, ev.data) for ev in rest]
            # the events that carry the end say so in their ids; the others do not
            assert finish.id.endswith("-1") and len(finish.id.split("-")) == 4, finish.id
            assert usage.id.endswith("-2") and len(usage.id.split("-")) == 4, usage.id
            assert all(len(ev.id.split("-")) == 3 for ev in events[:-3]), [ev.id for ev in events]
    finally:
        await store.close()
        router.stop()
