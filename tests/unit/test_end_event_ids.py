"""The ids of a resumable stream's end, and what a resume makes of them.

A finish event's id is ``N-T-C-1`` and the usage event's ``N-T-C-2``
(router/sse.py), so a resume knows whether the client's last event carried
the finish: a client ahead of its dead router's buffer by those events is
not sent them again (tests/integration/test_resume_past_finish.py runs it
with a replica that regenerates).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from replicas.protocol import Delta, FinishReason, SamplingParams
from router.errors import BadRequest
from router.metrics import Metrics
from router.relay import EventStream
from router.resume import ResumeMeta, ResumeWriter
from router.resume_http import Position, parse_last_event_id
from router.sse import DONE, ChunkEncoder, is_done
from router.state.memory import MemoryStore
from tests.unit.generations import Sink, started
from tests.unit.test_resume_tail import died_at_the_end, resume_at


def _done(n: int) -> bytes:
    """``[DONE]`` as event ``n`` (its id is its number alone: router/sse.py)."""
    return b"id: %d\n" % n + DONE


NONE, LENGTH = FinishReason.NONE, FinishReason.LENGTH


@pytest.mark.parametrize("value,pos", [
    (None, Position(0)), ("", Position(0)), ("7", Position(7)), ("7-6-20", Position(7, 6, 20)),
    ("7-6-20-1", Position(7, 6, 20, 1)), ("8-6-20-2", Position(8, 6, 20, 2)),
])
def test_last_event_ids_this_router_sends_are_read(value: str | None, pos: Position) -> None:
    assert parse_last_event_id(value) == pos


@pytest.mark.parametrize("value", ["7-6", "7-6-20-0", "7-6-20-3", "7-6-20-1-1", "7-6-20-", "7-6-20-01x",
                                   "7-6-20- 1", "7-6-20-١", "7-6-20-1" + "0" * 15, "a"])
def test_other_last_event_ids_are_refused(value: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_last_event_id(value)
    assert e.value.param == "Last-Event-ID" and "N-T-C-1" in e.value.message


async def _stream(include_usage: bool, had_end: int = 0, skip_chars: int = 0):
    """An ``EventStream`` of resumable stream s1 on a memory store, fed by hand."""
    store = MemoryStore()
    writer = ResumeWriter(store, 60)
    await writer.open("s1", ResumeMeta("t", False, "m", "cmpl-s1", 0, include_usage, SamplingParams(max_tokens=8),
                                       [1, 2]))
    tasks: list[asyncio.Future] = []
    svc = SimpleNamespace(metrics=Metrics(), resume=writer, background=lambda c: tasks.append(asyncio.ensure_future(c)))
    gen, col, _, _ = started(Sink(), [1, 2])
    es = EventStream(svc, gen, ChunkEncoder(False, "cmpl-s1", "m", 0), (include_usage, False),  # type: ignore[arg-type]
                     SimpleNamespace(name="t", priority="normal"), None,  # type: ignore[arg-type]
                     SimpleNamespace(started=time.monotonic()), "s1", skip_chars=skip_chars,  # type: ignore[arg-type]
                     had_end=had_end)
    return es, col, store


def _ids(events) -> list[bytes]:
    return [e.split(b"\n", 1)[0] for e in events if e is not None and not is_done(e)]


async def test_the_finish_and_usage_events_say_so_in_their_ids_and_plain_events_do_not() -> None:
    es, col, _ = await _stream(include_usage=True)
    col.put(Delta(1, [5, 6], "Hello", NONE))
    col.put(Delta(1, [7], " you", LENGTH))
    out = [es.event("Hello", 2, NONE), es.event(" you", 1, LENGTH), *es.tail()]
    assert _ids(out) == [b"id: 1-2-5", b"id: 2-3-9-1", b"id: 3-3-9-2"], out
    assert is_done(out[-1])


async def test_a_client_that_has_the_finish_is_not_sent_it_again_and_the_buffer_keeps_its_tokens() -> None:
    # the client had "Hello you" and the finish (and, had_end 2, the usage
    # event); the buffer lost them: the continuation regenerates 3 tokens
    for had_end, rest in ((1, [b"id: 1-3-9-2"]), (2, [])):
        es, col, store = await _stream(include_usage=True, had_end=had_end, skip_chars=9)
        col.put(Delta(1, [5, 6], "Hello", NONE))
        col.put(Delta(1, [7], " you", LENGTH))
        out = [es.event("Hello", 2, NONE), es.event(" you", 1, LENGTH), *es.tail()]
        assert _ids(out) == rest and is_done(out[-1]), out
        snap = await store.stream_read("s1", 0)  # (what went to the buffer: ``settle`` adds [DONE])
        assert snap.token_ids == [5, 6, 7] and snap.text_len == 9
        assert snap.events == [e for e in out if e is not None and not is_done(e)]
    # a finish with text the client lacks still goes out (its regeneration is longer than what it had)
    es, col, _ = await _stream(include_usage=False, had_end=1, skip_chars=5)
    col.put(Delta(1, [5, 6], "Hello", NONE))
    col.put(Delta(1, [7], " you", LENGTH))
    assert es.event("Hello", 2, NONE) is None
    assert _ids([es.event(" you", 1, LENGTH)]) == [b"id: 1-3-9-1"]


async def test_the_end_a_resume_sends_from_the_buffer_has_those_ids_too() -> None:
    svc, _ = await died_at_the_end(max_tokens=3, finish=NONE, include_usage=True)
    out = await resume_at(svc, Position(2, 3, 11))
    assert _ids(out) == [b"id: 3-3-11-1", b"id: 4-3-11-2"] and is_done(out[-1]), out


async def test_a_client_ahead_of_the_buffer_with_the_finish_gets_the_rest_of_the_end() -> None:
    # (its router sent the finish, in an event of its own at max_tokens, and died before storing it)
    svc, store = await died_at_the_end(max_tokens=3, finish=NONE, include_usage=True)
    out = await resume_at(svc, Position(3, 3, 11, 1))
    assert _ids(out) == [b"id: 4-3-11-2"] and is_done(out[-1]), out
    after = await store.stream_read("s1", 0)
    assert after.finished and after.events[2] == b"" and after.events[3:] == out


async def test_an_id_that_says_another_part_of_the_end_than_the_buffer_makes_it_is_a_mismatch() -> None:
    svc, store = await died_at_the_end(max_tokens=3, finish=NONE, include_usage=True)
    # event 3 is the finish (the buffer lacks it), not the usage event; event 4 the usage event
    for bogus in (Position(3, 3, 11, 2), Position(4, 3, 11, 1)):
        out = await resume_at(svc, bogus)
        assert len(out) == 1 and b'"code":"resume_mismatch"' in out[0], (bogus, out)
    after = await store.stream_read("s1", 0)
    assert not after.finished and after.total_events == 2 and after.owner == ""
    # (an id without that part, as a router before it sent, is taken as before)
    assert await resume_at(svc, Position(4, 3, 11)) == [_done(5)]
