"""A resuming client placed by the tokens and characters its id counts.

An event id is ``N-T-C``. A client whose events were split at other places
than the buffer's (a second reader of a stream whose router died, whose
continuation stored events cut where its own deltas fell; a stale id) was
replayed from its event number N: it got text twice or missed some. It is
placed by ``(T, C)`` instead: after the stored event with those counts, or
inside the one whose counts bracket them (it gets the rest of that event's
text under that event's id, then the events after it); an id the buffer
cannot place is a 400, never a wrong text.

Buffers of other splits are made here from a stream served whole, as in
test_resume_past_finish: its Redis buffer rewritten with the same text in
other events.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from router.state.redis_store import RedisStore
from tests.helpers import GOLD, MODEL, RouterProcess, SseEvent, apoll
from tests.integration.test_resume_interrupted import _resumed, _served, _text
from tests.integration.test_resume_past_finish import _died_before_storing, _finishes

MAX_TOKENS = 48
BODY = {"model": MODEL, "prompt": "Le caf", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


def _counts(event_id: str) -> tuple[int, int]:
    return int(event_id.split("-")[1]), int(event_id.split("-")[2])


def _merged(events: list[SseEvent], group: int, first: int = 0) -> list[SseEvent]:
    """``events`` with their plain text events from ``first`` on merged in
    groups of ``group`` (the same text, split at other places), renumbered."""
    out: list[SseEvent] = list(events[:first])
    run: list[SseEvent] = []

    def flush() -> None:
        if run:
            d = run[-1].json()
            d["choices"][0]["text"] = "".join(ev.json()["choices"][0]["text"] for ev in run)
            tail = run[-1].id.split("-", 1)[1]
            out.append(SseEvent(f"{len(out) + 1}-{tail}", msgspec.json.encode(d).decode()))
            run.clear()

    for ev in events[first:]:
        if ev.id is not None and ev.id.count("-") == 2:  # (a plain text event)
            run.append(ev)
            if len(run) == group:
                flush()
            continue
        flush()
        n, _, tail = (ev.id or "").partition("-")
        out.append(SseEvent(f"{len(out) + 1}-{tail}" if ev.id else None, ev.data))
    flush()
    return out


def _sse(events: list[SseEvent]) -> list[bytes]:
    return [(f"id: {ev.id}\n" if ev.id else "").encode() + f"data: {ev.data}\n\n".encode() for ev in events]


async def _stored(http: httpx.AsyncClient, router: RouterProcess, store: RedisStore) -> tuple[str, list[SseEvent]]:
    rid, events = await _served(http, router, store, BODY)
    assert _finishes(events) == ["length"] and len(events) > 20, [ev.id for ev in events]
    return rid, events


@pytest.fixture
async def served(tmp_path, redis_server):
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    router = RouterProcess(tmp_path / "r", replicas=1, sim={"step_base_ms": 3}, settings=settings).start()
    store = RedisStore(redis_server.url)
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {GOLD}"}, timeout=60) as http:
            yield router, store, http
    finally:
        await store.close()
        router.stop()


@pytest.mark.parametrize("buffer", ["coarser", "finer"])
async def test_a_client_whose_events_were_split_elsewhere_gets_exactly_the_text_it_lacks(served, buffer) -> None:
    # "coarser": the buffer holds the text in fewer events than the client's
    # (its N is past the event with its counts, or inside one: it missed text);
    # "finer": in more (its N is before it: it got text twice).
    router, store, http = served
    rid, events = await _stored(http, router, store)
    whole = await store.stream_read(rid, 0)
    assert whole is not None
    merged = _merged(events, 3)
    if buffer == "coarser":
        await store.stream_open(rid, whole.meta, "", 600)
        assert await store.stream_append(rid, _sse(merged), list(whole.token_ids), whole.text_len, True,
                                         "router-a", 600)
        client, stored = events, merged
    else:
        client, stored = merged, events
    ref = _text(events)
    stored_ids = {ev.id for ev in stored}
    tried = 0
    for i, last in enumerate(client[:-3]):  # (every text event's id; the finish and usage events: below)
        if last.id in stored_ids:
            continue  # (the buffer's own id: replayed as ever)
        tried += 1
        rest = await _resumed(http, router, rid, last.id)
        assert _text(client[:i + 1]) + _text(rest) == ref, (last.id, [ev.id for ev in rest])
        assert _finishes(rest) == ["length"] and rest[-1].data == "[DONE]", [ev.id for ev in rest]
        numbers = [ev.number for ev in rest[:-1]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers  # the buffer's numbering
        assert rest[-2].id == stored[-2].id  # (its usage event, under the buffer's id)
    assert tried > 5, tried
    for last in client[-3:-1]:  # the finish, the usage event: what comes after them, once
        rest = await _resumed(http, router, rid, last.id)
        assert [ev.data for ev in rest] == [ev.data for ev in client[client.index(last) + 1:]]


async def test_an_id_the_buffer_cannot_place_is_a_400(served) -> None:
    router, store, http = served
    rid, events = await _stored(http, router, store)
    n, tokens, chars = (int(x) for x in events[9].id.split("-"))
    c_next = _counts(events[10].id)[1]
    for last, code in [(f"{n}-{tokens}-{c_next + 1}", "resume_mismatch"),  # more text than its tokens made
                       (f"{n}-{MAX_TOKENS + 3}-{chars + 400}", "resume_mismatch")]:  # more than the stream has
        r = await http.get(f"{router.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last})
        assert r.status_code == 400, (last, r.text)
        assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "Last-Event-ID", r.text
    # among placeholders (events lost with a router, only a client ahead had them): their text is not there
    whole = await store.stream_read(rid, 0)
    assert whole is not None
    await store.stream_open(rid, whole.meta, "", 600)
    assert await store.stream_append(rid, whole.events[:5] + [b""] * 5 + whole.events[10:], list(whole.token_ids),
                                     whole.text_len, True, "router-a", 600)
    r = await http.get(f"{router.base_url}/v1/streams/{rid}",
                       headers={"Last-Event-ID": f"3-{_counts(events[7].id)[0]}-{_counts(events[7].id)[1]}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "resume_gap", r.text


STORED = 8  # the events the dead router stored
BEHIND = 6  # the events the client behind the buffer has
HAD = 30  # the events the client ahead of it had, in the dead router's split


@pytest.mark.parametrize("when", ["after", "during"])
async def test_two_clients_of_a_stream_whose_router_died_both_get_exactly_its_text(
        tmp_path, redis_server, when: str) -> None:
    # One client is behind the dead router's buffer, one ahead of it; the one
    # behind resumes first, and its continuation stores events split where
    # its own deltas fall. The one ahead resumes when that continuation has
    # ended ("after"), or while it runs ("during": it waits until the buffer
    # holds its counts). Its events were cut at other places than the
    # continuation's (here: by four): from its event number, it got text twice.
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    sim = {"step_base_ms": 3 if when == "after" else 40}
    router = RouterProcess(tmp_path / "r", replicas=1, sim=sim, settings=settings).start()
    store = RedisStore(redis_server.url)
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {GOLD}"}, timeout=60) as http:
            rid, events = await _stored(http, router, store)
            ref = _text(events)
            await _died_before_storing(store, rid, events, STORED)
            ahead = _merged(events[:HAD], 4, STORED)  # (the dead router's events, as it sent them)
            behind = events[:BEHIND]
            assert ahead[-1].number > STORED and _counts(ahead[-1].id) == _counts(events[HAD - 1].id)

            async def resume(have: list[SseEvent]) -> list[SseEvent]:
                return await _resumed(http, router, rid, have[-1].id)

            first = asyncio.create_task(resume(behind))
            if when == "during":
                async def started() -> bool:
                    snap = await store.stream_read(rid, 0, tokens=False)
                    return snap is not None and STORED < snap.total_events and snap.text_len < _counts(
                        ahead[-1].id)[1]
                await apoll(started, 10, interval=0.01, what="the continuation storing its first events")
                second = await resume(ahead)
                rest_behind = await first
            else:
                rest_behind = await first

                async def finished():
                    snap = await store.stream_read(rid, 0, tokens=False)
                    return snap if snap is not None and snap.finished else None

                snap = await apoll(finished, 10, what="the continuation's events stored")
                events_n = snap.events[ahead[-1].number - 1]
                assert not events_n.startswith(f"id: {ahead[-1].id}\n".encode()), events_n  # (split elsewhere)
                second = await resume(ahead)
            assert _text(behind) + _text(rest_behind) == ref, [ev.id for ev in rest_behind]
            assert _text(ahead) + _text(second) == ref, ([ev.id for ev in ahead], [ev.id for ev in second])
            assert _finishes(second) == ["length"] and second[-1].data == "[DONE]"
    finally:
        await store.close()
        router.stop()
