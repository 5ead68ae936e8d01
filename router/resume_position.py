"""Where a resuming client is in a stream: its ``Last-Event-ID``, and its
place among the buffer's events by the tokens and characters it has.

An event id ``N-T-C`` (router/sse.py) numbers the event and counts the
completion tokens and characters the client has with it. The number alone
does not place a client: two readers of one stream whose router died can
hold events split at other places (the events a continuation stores are cut
where its own deltas fell, not where the dead router's were), and a stale id
may be of another split altogether. Replayed from its number, such a client
got text twice or missed some. So a client with a full id is placed by
``(T, C)``: after the stored event whose ids count exactly that, or inside
the stored event whose counts bracket it (it is sent the rest of that
event's text, under that event's id, then the events after it). Where the
buffer cannot place it (its counts contradict the stored ones, or fall
among placeholders for events lost with a router), the resume is refused
(``resume_mismatch``, ``resume_gap``) rather than sent a wrong text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from router.errors import BadRequest, clip

__all__ = ["Position", "parse_last_event_id", "Mark", "Spot", "mark_of", "locate", "rest_of", "Placed",
           "AHEAD", "WAIT", "place"]


class Position(msgspec.Struct, frozen=True):
    """Where a client is in a stream: its last event and, if known, the
    completion tokens and characters it has, and what of the stream's end
    (``end``: 0 none, 1 the finish event, 2 the finish and the usage event)."""

    event: int
    tokens: int | None = None
    chars: int | None = None
    end: int = 0


def parse_last_event_id(value: str | None) -> Position:
    """``N``, ``N-T-C``, or ``N-T-C-E`` with E 1 or 2 (router/sse.py)."""
    if value is None or value == "":
        return Position(0)
    parts = value.split("-")
    # (digits only: int() also takes "1_0", " 1" and other scripts' digits; at most 15: the
    # store's scripts count in doubles, and a larger number failed a Redis script as if it were down)
    nums = [int(p) for p in parts] if all(p.isascii() and p.isdigit() and len(p) <= 15 for p in parts) else []
    if len(nums) not in (1, 3, 4) or (len(nums) == 4 and nums[3] not in (1, 2)):
        raise BadRequest("Last-Event-ID must be an event id this router sent (N, N-T-C, or N-T-C-1 or N-T-C-2 "
                         f"for the events of a stream's end); got {clip(repr(value))}.", param="Last-Event-ID")
    return Position(*nums)


class Mark(NamedTuple):
    """What a client has once it has an event: tokens, characters, and the
    part of the stream's end (0, 1 the finish, 2 the usage event)."""

    tokens: int
    chars: int
    end: int = 0


NO_ID = Mark(-1, -1, -1)  # an event with no counts in its id ([DONE], an error notice)


def mark_of(event: bytes) -> Mark | None:
    """A stored event's ``Mark`` from its ``id:`` line; None for a
    placeholder (an event lost with a router), ``NO_ID`` for one without."""
    if not event:
        return None
    if not event.startswith(b"id: "):
        return NO_ID
    parts = event[4:event.find(b"\n")].split(b"-")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        return NO_ID
    return Mark(int(parts[1]), int(parts[2]), int(parts[3]) if len(parts) == 4 else 0)


AT, INSIDE, BEYOND, GAP, MISMATCH = "at", "inside", "beyond", "gap", "mismatch"


class Spot(NamedTuple):
    """``locate``'s answer: ``AT`` event ``event`` (the client has it and
    nothing after it), ``INSIDE`` it (the client has part of its text),
    ``BEYOND`` every stored event (it has more than the buffer), ``GAP``
    among placeholders, or ``MISMATCH`` (its counts contradict the buffer's)."""

    kind: str
    event: int = 0


def locate(marks: Sequence[Mark | None], have: Mark) -> Spot:
    """Where a client that has ``have`` is among a buffer's events, whose
    ``marks`` (``mark_of``) are in order from event 1. Inside an event only
    where the counts of the events around it bracket ``have`` in both tokens
    and characters and the client has no part of the end (an event after a
    placeholder has no known start: a client before it is in a ``GAP``)."""
    prev: Mark | None = Mark(0, 0)  # the counts at the end of the last event passed (None: a placeholder)
    last = prev  # (the last one with counts)
    for k, m in enumerate(marks, 1):
        if m is None:
            prev = None
            continue
        if m is NO_ID:
            continue
        if m == have:
            return Spot(AT, k)
        # (the client is at most at this event's end; at the same counts with more of the end, past it)
        if have.tokens <= m.tokens and have.chars <= m.chars and not (have[:2] == m[:2] and have.end > m.end):
            if prev is None:
                return Spot(GAP, k)
            if have.end == 0 and prev.end == 0 and prev.tokens <= have.tokens and prev.chars <= have.chars:
                return Spot(INSIDE, k)
            return Spot(MISMATCH, k)
        prev = last = m
    if last.tokens <= have.tokens and last.chars <= have.chars:  # (past a finished end: the caller says so)
        return Spot(BEYOND)
    return Spot(MISMATCH)


def rest_of(event: bytes, start: Mark, have: Mark) -> bytes | None:
    """``event`` (stored, ``start``: the counts before it) as sent to a
    client that has its text up to ``have.chars``: the same id, its text
    after them, and no role (that client had its first event). None when
    its text is not as long as its counts say (not a text event of this
    buffer's kind)."""
    head, sep, rest = event.partition(b"\ndata: ")
    end = mark_of(event)
    try:
        chunk = msgspec.json.decode(rest.rstrip(b"\n"))
        choice = chunk["choices"][0]
        delta = choice.get("delta")
        holder, key = (delta, "content") if delta is not None else (choice, "text")
        text = holder.get(key) or ""
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if not sep or end is None or len(text) != end.chars - start.chars:
        return None
    holder[key] = text[have.chars - start.chars:]
    if delta is not None:
        delta.pop("role", None)
    return head + sep + msgspec.json.encode(chunk) + b"\n\n"


class Placed(NamedTuple):
    """A client placed in the buffer: ``pos``, the buffer's own id of its
    last event, and ``partial``, the rest of that event to send it first
    (None: it has that event whole)."""

    pos: Position
    partial: bytes | None = None


# ``place``'s answers for a client not placed (yet): ``AHEAD`` of the buffer by
# events and by counts (a client whose router died with its last events: the
# resume continues it as before, and places it again once the buffer grows);
# ``WAIT``, level with or past the buffer in events but by counts past its
# event N, a real one: only a live generation can place it, as it stores more.
AHEAD, WAIT = "ahead", "wait"


async def place(store, sid: str, pos: Position, sampled: bool) -> Placed | str | None:
    """Place a client with a full id (``N-T-C``) in ``sid``'s buffer. None:
    nothing to do (no counts in its id, its event N is there with those
    counts, or is a placeholder, which router/resume_tail.py's
    ``client_on_placeholder`` handles). Raises ``BadRequest`` where the
    buffer cannot place it; may raise ``StoreUnavailable``. ``sampled``
    (temperature > 0): a buffer whose router died may hold a continuation's
    text where the client has the dead router's, the same counts of other
    words; such a client is not placed."""
    if pos.tokens is None or pos.chars is None or pos.event < 1:
        return None
    have = Mark(pos.tokens, pos.chars, pos.end)
    near = await store.stream_read(sid, pos.event - 1, False)
    if near is None:
        return None  # (gone meanwhile: the resume's next read says so)
    if near.events and (not near.events[0] or mark_of(near.events[0]) == have):
        return None
    whole = await store.stream_read(sid, 0, False)
    if whole is None:
        return None
    if sampled and whole.lost:
        raise BadRequest(f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars} is not of stream {sid}'s stored events, "
                         "whose router died: they may be a sampled (temperature > 0) continuation's, other text "
                         "than the client's; retry the request.", param="Last-Event-ID", code="resume_gap")
    marks = [mark_of(e) for e in whole.events]
    spot = locate(marks, have)
    if spot.kind == AT:
        m = marks[spot.event - 1]
        return Placed(Position(spot.event, m.tokens, m.chars, m.end))
    if spot.kind == INSIDE:
        start = next((m for m in reversed(marks[:spot.event - 1]) if m is not NO_ID), Mark(0, 0))
        partial = rest_of(whole.events[spot.event - 1], start, have)
        if partial is not None:
            m = marks[spot.event - 1]
            return Placed(Position(spot.event, m.tokens, m.chars, m.end), partial)
    elif spot.kind == BEYOND:
        return AHEAD if pos.event > whole.total_events else WAIT
    elif spot.kind == GAP:
        raise BadRequest(f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars}: the text after it was lost with "
                         f"the router that produced it (events up to {spot.event} of stream {sid} cannot be "
                         "replayed); retry the request.", param="Last-Event-ID", code="resume_gap")
    raise BadRequest(mismatch(sid, pos), param="Last-Event-ID", code="resume_mismatch")


def mismatch(sid: str, pos: Position) -> str:
    return (f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars} does not match stream {sid}: no stored event "
            "ends at those completion tokens and characters or holds them; resume with an id this stream's "
            "events carry.")
