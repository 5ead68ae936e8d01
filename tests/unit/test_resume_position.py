"""Placing a resuming client among a buffer's events by its id's tokens and
characters (router/resume_position.py): pure parts."""

from __future__ import annotations

import msgspec
import pytest

from replicas.protocol import FinishReason
from router.resume_position import (AT, BEYOND, GAP, INSIDE, MISMATCH, NO_ID, Mark, Scan, Spot, locate, mark_of,
                                    parse_last_event_id, rest_of)
from router.sse import DONE, END_FINISH, ChunkEncoder


def _events(pieces: list[tuple[str, int]], chat: bool = False, finish_last: bool = False) -> list[bytes]:
    """SSE events of ``pieces`` (text, tokens), with cumulative ids as the relay writes them."""
    enc = ChunkEncoder(chat, "cmpl-1", "m", 1)
    out, t, c = [], 0, 0
    for i, (text, n) in enumerate(pieces):
        t, c = t + n, c + len(text)
        last = finish_last and i == len(pieces) - 1
        pos = b"-%d-%d" % (t, c) + (END_FINISH if last else b"")
        out.append(enc.delta(text, FinishReason.LENGTH if last else FinishReason.NONE, pos))
    return out


PIECES = [("Hel", 3), ("lo, ", 4), ("wörld", 6), ("!", 1)]  # ids 1-3-3, 2-7-7, 3-13-12, 4-14-13
MARKS = [mark_of(e) for e in _events(PIECES)]


def test_marks_come_from_the_ids() -> None:
    assert MARKS == [Mark(3, 3), Mark(7, 7), Mark(13, 12), Mark(14, 13)]
    assert mark_of(b"") is None and mark_of(DONE) is NO_ID
    assert mark_of(_events([("a", 1)], finish_last=True)[0]) == Mark(1, 1, 1)


@pytest.mark.parametrize(("have", "spot"), [
    (Mark(7, 7), Spot(AT, 2)),                # a boundary, whatever the client's event number
    (Mark(0, 0), Spot(INSIDE, 1)),            # (an id 0-0-0 is never sent: N 0 is not placed)
    (Mark(5, 5), Spot(INSIDE, 2)),            # inside event 2: it has 2 of its 4 characters
    (Mark(10, 7), Spot(INSIDE, 3)),           # tokens past a boundary, no text yet (a multi-byte character)
    (Mark(14, 12), Spot(INSIDE, 4)),          # the last event's token, not yet its character
    (Mark(8, 13), Spot(MISMATCH, 4)),         # more characters than its tokens made (counts across a boundary)
    (Mark(6, 8), Spot(MISMATCH, 3)),
    (Mark(15, 14), Spot(BEYOND)),             # more than the buffer holds
    (Mark(15, 12), Spot(MISMATCH)),           # more tokens, fewer characters than the last event
    (Mark(7, 7, 1), Spot(MISMATCH, 3)),       # a finish where the buffer goes on
])
def test_locate(have: Mark, spot: Spot) -> None:
    assert locate(MARKS, have) == spot


@pytest.mark.parametrize("have", [Mark(7, 7), Mark(10, 7), Mark(14, 12), Mark(8, 13), Mark(15, 14), Mark(15, 12),
                                  Mark(21, 19), Mark(10, 9)])
def test_a_scan_fed_in_parts_answers_as_one_over_the_whole_buffer(have: Mark) -> None:
    # (a client placed again as the buffer grows reads only the events after those it read)
    marks = [*MARKS, None, Mark(20, 18), Mark(22, 20)]
    for cut in range(len(marks) + 1):
        scan = Scan(have)
        first = scan.feed(marks[:cut])
        assert first == locate(marks[:cut], have)
        if first.kind == BEYOND:  # (else the client is placed, or refused: nothing is read again)
            assert scan.feed(marks[cut:]) == locate(marks, have), cut


def test_a_finish_of_its_own_is_told_from_the_last_text_event() -> None:
    marks = [Mark(3, 3), Mark(5, 5), Mark(5, 5, 1), Mark(5, 5, 2), NO_ID]
    assert locate(marks, Mark(5, 5)) == Spot(AT, 2)
    assert locate(marks, Mark(5, 5, 1)) == Spot(AT, 3)
    assert locate(marks, Mark(5, 5, 2)) == Spot(AT, 4)
    # the buffer's finish carries the last text: a client without it is inside it
    assert locate([Mark(3, 3), Mark(5, 5, 1)], Mark(5, 5)) == Spot(INSIDE, 2)
    assert locate([Mark(3, 3), Mark(5, 5, 1)], Mark(4, 4)) == Spot(INSIDE, 2)


def test_placeholders_have_no_known_counts() -> None:
    marks = [Mark(3, 3), None, None, Mark(20, 18), Mark(22, 20)]
    assert locate(marks, Mark(3, 3)) == Spot(AT, 1)
    assert locate(marks, Mark(10, 9)) == Spot(GAP, 4)        # its text is in events lost with a router
    assert locate(marks, Mark(20, 18)) == Spot(AT, 4)        # (a real event after them has its counts)
    assert locate(marks, Mark(21, 19)) == Spot(INSIDE, 5)
    assert locate([Mark(3, 3), None], Mark(9, 9)) == Spot(BEYOND)  # (the ahead client the placeholders are for)


@pytest.mark.parametrize("chat", [False, True])
def test_rest_of_an_event_keeps_its_id_and_sends_the_text_after_the_client(chat: bool) -> None:
    events = _events(PIECES, chat)
    out = rest_of(events[2], Mark(7, 7), Mark(10, 9))
    assert out is not None and out.startswith(b"id: 3-13-12\ndata: ") and out.endswith(b"\n\n")
    chunk = msgspec.json.decode(out[out.index(b"data: ") + 6:])
    choice = chunk["choices"][0]
    assert (choice["delta"] if chat else choice)["content" if chat else "text"] == "rld"
    if chat:  # (the role went with the client's first event)
        assert "role" not in choice["delta"]
        first = rest_of(events[0], Mark(0, 0), Mark(1, 1))
        assert first is not None and b'"role"' not in first and b'"content":"el"' in first
    assert rest_of(events[2], Mark(7, 6), Mark(10, 9)) is None  # (its text is not as long as its counts say)


def test_rest_of_a_finish_event_keeps_the_finish() -> None:
    event = _events([("ab", 2), ("cd", 2)], finish_last=True)[1]
    out = rest_of(event, Mark(2, 2), Mark(4, 4))
    assert out is not None and out.startswith(b"id: 2-4-4-1\n")
    assert msgspec.json.decode(out[out.index(b"data: ") + 6:])["choices"][0] == {
        "index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}


def test_ids_parse_as_before() -> None:
    assert parse_last_event_id("4-14-13-1").end == 1
    assert parse_last_event_id(None).event == 0
