"""A resume cut off while it regenerated text its client already had.

A client ahead of its dead router's buffer (it got events the router had not
stored) resumes: the continuation pads the buffer with placeholders for
those events, so that it numbers as the client does, then regenerates their
text silently. Cut off there (its client left again, or its router died),
it leaves a buffer level with the client in events but behind it in text:
with its tokens (the client left: those regenerated so far) or without them
(the router died). The next resume from the same event id found the client
level, skipped nothing, and sent the client that text again. The client's
id says how far ahead it is in tokens and characters (``N-T-C``): the
continuation drops those characters, as for a client ahead by events.

Only a client whose last event is such a placeholder in the buffer: level
with a real event, an id that counts more of the stream than the buffer
(another stream's, a made-up one) dropped that text from what the buffer
stored next, and the client that held the buffer's own id missed it.

The dead router's state is made as in test_resume_past_finish: a stream
served whole, its Redis buffer rewritten to hold only its first events.
"""

from __future__ import annotations

import httpx
import pytest

from router.state.redis_store import RedisStore
from tests.helpers import GOLD, MODEL, RouterProcess, SseEvent, aiter_sse, apoll
from tests.integration.test_resume_past_finish import _died_before_storing, _finishes

MAX_TOKENS = 48
STORED = 6  # the events the dead router stored
HAD = 40  # the events its client had (the buffer lacks 34; regenerating them takes ~1 s)
SIM = {"step_base_ms": 30}
FAST = {"step_base_ms": 3}  # (where no resume has to be cut off mid-way)


def _text(events: list[SseEvent]) -> str:
    out = ""
    for ev in events:
        if ev.data == "[DONE]":
            continue
        d = ev.json()
        assert "error" not in d, d
        out += "".join(c["text"] for c in d["choices"])
    return out


async def _stream(http: httpx.AsyncClient, base_url: str, body: dict) -> tuple[str, list[SseEvent]]:
    """A completion streamed to its end: its request id and its events."""
    async with http.stream("POST", base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return r.headers["x-request-id"], [ev async for ev in aiter_sse(r)]


@pytest.mark.parametrize("cut", ["client-left", "router-died"])
async def test_a_resume_cut_off_while_it_regenerated_the_clients_text_does_not_send_it_again(
        tmp_path, redis_server, cut: str) -> None:
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    a = RouterProcess(tmp_path / "a", replicas=1, sim=SIM, settings=settings).start()
    # (the router the first resume runs on: a second one, killed, for "router-died")
    b = RouterProcess(tmp_path / "b", replicas=1, sim=SIM, settings=settings).start() if cut == "router-died" else a
    store = RedisStore(redis_server.url)
    body = {"model": MODEL, "prompt": "The cluster", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {GOLD}"}, timeout=60) as http:
            rid, events = await _stream(http, a.base_url, body)
            assert events[-1].data == "[DONE]" and len(events) > HAD + 3, [ev.id for ev in events]

            async def buffer():
                snap = await store.stream_read(rid, 0, tokens=False)
                assert snap is not None
                return snap

            await apoll(lambda: _finished(buffer), 10, what="the stream's buffer finished")
            await _died_before_storing(store, rid, events, STORED)
            have, last = events[:HAD], events[HAD - 1].id
            _, tokens, chars = (int(x) for x in last.split("-"))

            # the first resume: padded, regenerating the client's text silently, and cut off
            async with http.stream("GET", f"{b.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                assert r.status_code == 200, await r.aread()

                async def padded() -> bool:
                    return (await buffer()).total_events == HAD

                await apoll(padded, 10, interval=0.01, what="the buffer padded to the client's events")
                if cut == "router-died":
                    b.proc.kill()
                    b.proc.wait(5)
            snap = await store.stream_read(rid, 0)
            assert snap is not None
            # (cut off before it sent anything: no event past the client's, text still behind it)
            assert snap.total_events == HAD and snap.text_len < chars and len(snap.token_ids) < tokens, (
                snap.total_events, snap.text_len, len(snap.token_ids))
            assert all(e == b"" for e in snap.events[STORED:])

            # the next resume from the same id (a router that died: once its claim runs out)
            async with http.stream("GET", f"{a.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                assert r.status_code == 200, await r.aread()
                rest = [ev async for ev in aiter_sse(r)]
            assert rest and rest[-1].data == "[DONE]", [ev.data for ev in rest]
            assert _text(have) + _text(rest) == _text(events)  # (was: the text from event STORED on, again)
            assert [ev.number for ev in rest[:-1]] == list(range(HAD + 1, HAD + len(rest))), [ev.id for ev in rest]
            assert _finishes(have + rest) == ["length"]
            assert [ev.id for ev in rest[-3:-1]] == [ev.id for ev in events[-3:-1]]  # finish, usage: same ids
    finally:
        await store.close()
        if b is not a:
            b.stop(check=False)
        a.stop()


@pytest.mark.parametrize("ended", ["max_tokens", "eos"])
async def test_a_resume_cut_off_after_it_regenerated_the_clients_finish_does_not_send_it_again(
        tmp_path, redis_server, ended: str) -> None:
    # The client had the finish event; the resume that padded for it stored the
    # tokens it regenerated (every one: its router flushed them) and died before
    # its usage event reached the buffer. The next resume found the output ended
    # at max_tokens and sent the finish again: ``finish_reason`` twice. Ended by
    # an end-of-sequence, nothing in the buffer said it had ended: the stream was
    # continued, past the end (new text, a second finish and usage event).
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    router = RouterProcess(tmp_path / "r", replicas=1, sim=FAST, settings=settings).start()
    store = RedisStore(redis_server.url)
    limit = {"max_tokens": MAX_TOKENS, "ignore_eos": True} if ended == "max_tokens" else {"max_tokens": 1000}
    body = {"model": MODEL, "prompt": "The cluster", "temperature": 0, **limit,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {GOLD}"}, timeout=60) as http:
            rid, events = await _stream(http, router.base_url, body)
            finish, usage = events[-3], events[-2]
            assert _finishes([finish]) == ["length" if ended == "max_tokens" else "stop"], finish.data
            assert len(events) > STORED + 3, [ev.id for ev in events]

            async def finished() -> bool:
                snap = await store.stream_read(rid, 0)
                return snap is not None and snap.finished

            await apoll(finished, 10, what="the stream's buffer finished")
            whole = await store.stream_read(rid, 0)
            assert whole is not None
            assert (len(whole.token_ids) == MAX_TOKENS) == (ended == "max_tokens"), len(whole.token_ids)
            have = events[:-2]  # up to the finish
            await store.stream_open(rid, whole.meta, "", 600, lost=True)
            assert await store.stream_append(rid, whole.events[:STORED] + [b""] * (len(have) - STORED),
                                             list(whole.token_ids), whole.text_len, False, "router-b", 600)
            async with http.stream("GET", f"{router.base_url}/v1/streams/{rid}",
                                   headers={"Last-Event-ID": finish.id}) as r:
                assert r.status_code == 200, await r.aread()
                rest = [ev async for ev in aiter_sse(r)]
            assert len(rest) == 2 and rest[0].id == usage.id, [ev.data for ev in rest]  # (was: the finish first)
            assert rest[0].data == usage.data and rest[-1].data == "[DONE]"
    finally:
        await store.close()
        router.stop()


async def _served(http: httpx.AsyncClient, router: RouterProcess, store: RedisStore,
                  body: dict) -> tuple[str, list[SseEvent]]:
    """A stream served whole, with its buffer finished: its id and events."""
    async with http.stream("POST", router.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        rid = r.headers["x-request-id"]
        events = [ev async for ev in aiter_sse(r)]
    assert events[-1].data == "[DONE]", [ev.data for ev in events]

    async def finished() -> bool:
        snap = await store.stream_read(rid, 0, tokens=False)
        return snap is not None and snap.finished

    await apoll(finished, 10, what="the stream's buffer finished")
    return rid, events


async def _resumed(http: httpx.AsyncClient, router: RouterProcess, rid: str, last: str) -> list[SseEvent]:
    async with http.stream("GET", f"{router.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
        assert r.status_code == 200, await r.aread()
        return [ev async for ev in aiter_sse(r)]


async def test_a_level_id_counting_more_than_a_real_event_drops_no_text_from_the_buffer(
        tmp_path, redis_server) -> None:
    # A router died holding the stream (``lost``), its buffer has real events
    # only. An id for its last event that counts more tokens and characters than
    # the buffer (another stream's, a made-up one) was taken as a client ahead:
    # the continuation dropped that many characters and stored its events
    # without them, so the client holding the buffer's own id missed them.
    # (Then it was taken as level, and its holder got text again; now the
    # buffer cannot place it, nothing generates more: a 400, test_resume_position.)
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    router = RouterProcess(tmp_path / "r", replicas=1, sim=FAST, settings=settings).start()
    store = RedisStore(redis_server.url)
    body = {"model": MODEL, "prompt": "The cluster", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {GOLD}"}, timeout=60) as http:
            rid, events = await _served(http, router, store, body)
            await _died_before_storing(store, rid, events, STORED)
            n, tokens, chars = (int(x) for x in events[STORED - 1].id.split("-"))
            r = await http.get(f"{router.base_url}/v1/streams/{rid}",
                               headers={"Last-Event-ID": f"{n}-{tokens + 5}-{chars + 20}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "resume_mismatch", r.text
            rest = await _resumed(http, router, rid, events[STORED - 1].id)  # the client the buffer's ids are of
            assert _text(events[:STORED]) + _text(rest) == _text(events)
            assert rest[-1].data == "[DONE]" and _finishes(rest) == ["length"], [ev.data for ev in rest]
    finally:
        await store.close()
        router.stop()


async def _finished(buffer) -> bool:
    return (await buffer()).finished
