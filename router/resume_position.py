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

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from router.errors import BadRequest, clip
from router.sse import numbered
from router.state import StoreUnavailable

if TYPE_CHECKING:
    from router.resume import ResumeMeta
    from router.state import StreamSnapshot

__all__ = ["BufferUnread",
           "Position", "parse_last_event_id", "Mark", "Spot", "mark_of", "locate", "Scan", "rest_of", "Placed",
           "AHEAD", "WAIT", "Placer", "mismatch", "ahead"]


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
MARK_SLICE = 256  # events whose marks ``Placer`` reads in one turn of the event loop (~1 ms)


def mark_of(event: bytes) -> Mark | None:
    """A stored event's ``Mark`` from its ``id:`` line; None for a
    placeholder (an event lost with a router), ``NO_ID`` for one without."""
    if not event:
        return None
    event = numbered(event)  # (a chat stream's event 1 leads with the id-less role chunk)
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
    ``marks`` (``mark_of``) are in order from event 1 (``Scan``)."""
    return Scan(have).feed(marks)


class Scan:
    """``locate`` over a buffer read in parts as it grows: ``feed`` takes the
    marks of the events after those fed before and answers for all of them.
    Inside an event only where the counts of the events around it bracket
    ``have`` in both tokens and characters and the client has no part of the
    end (an event after a placeholder has no known start: a client before it
    is in a ``GAP``). An answer at an event stands whatever comes after it."""

    def __init__(self, have: Mark) -> None:
        self.have = have
        self.events = 0  # events fed
        self.prev: Mark | None = Mark(0, 0)  # the counts at the end of the last event passed (None: a placeholder)
        self.last = Mark(0, 0)  # (the last one with counts)

    def feed(self, marks: Iterable[Mark | None]) -> Spot:
        have = self.have
        for m in marks:
            self.events += 1
            if m is None:
                self.prev = None
                continue
            if m is NO_ID:
                continue
            if m == have:
                return Spot(AT, self.events)
            # (the client is at most at this event's end; at the same counts with more of the end, past it)
            if have.tokens <= m.tokens and have.chars <= m.chars and not (have[:2] == m[:2] and have.end > m.end):
                prev = self.prev
                if prev is None:
                    return Spot(GAP, self.events)
                if have.end == 0 and prev.end == 0 and prev.tokens <= have.tokens and prev.chars <= have.chars:
                    return Spot(INSIDE, self.events)  # (``prev``: the counts before it)
                return Spot(MISMATCH, self.events)
            self.prev = self.last = m
        if self.last.tokens <= have.tokens and self.last.chars <= have.chars:  # (past a finished end: the caller says so)
            return Spot(BEYOND)
        return Spot(MISMATCH)


def rest_of(event: bytes, start: Mark, have: Mark) -> bytes | None:
    """``event`` (stored, ``start``: the counts before it) as sent to a
    client that has its text up to ``have.chars``: the same id, its text
    after them, and no role chunk (that client had its first event). None
    when its text is not as long as its counts say (not a text event of
    this buffer's kind)."""
    event = numbered(event)
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
    if delta is not None:  # (a buffer of an older router: the role came in event 1's text chunk)
        delta.pop("role", None)
    return head + sep + msgspec.json.encode(chunk) + b"\n\n"


class Placed(NamedTuple):
    """A client placed in the buffer: ``pos``, the buffer's own id of its
    last event, and ``partial``, the rest of that event to send it first
    (None: it has that event whole)."""

    pos: Position
    partial: bytes | None = None


# ``Placer.place``'s answers for a client not placed (yet): ``AHEAD`` of the buffer by
# events and by counts (a client whose router died with its last events: the
# resume continues it as before, and places it again once the buffer grows);
# ``WAIT``, level with or past the buffer in events but by counts past its
# event N, a real one: only a live generation can place it, as it stores more.
AHEAD, WAIT = "ahead", "wait"


class Placer:
    """Places a client with a full id (``N-T-C``) in ``sid``'s buffer, and
    again as the buffer grows while it is ``AHEAD`` or ``WAIT``s. It keeps
    its ``Scan`` of the events read and reads only those after them: placed
    again on every poll that saw the buffer grow, a client that read the
    buffer whole each time cost reads quadratic in its length (on Redis,
    each a script that holds the server for every tenant)."""

    def __init__(self, sid: str, pos: Position, meta: ResumeMeta) -> None:
        self.sid, self.pos, self.meta = sid, pos, meta
        full = pos.tokens is not None and pos.chars is not None and pos.event >= 1
        self.scan = Scan(Mark(pos.tokens, pos.chars, pos.end)) if full else None  # type: ignore[arg-type]

    async def place(self, read: Callable[[int], Awaitable[StreamSnapshot | None]]) -> Placed | str | None:
        """``read(after)``: the buffer's events after ``after`` (None: gone).
        None: nothing to do (no counts in the id, or its event N is there
        with those counts, or is a placeholder, which router/resume_tail.py's
        ``client_on_placeholder`` handles). Raises ``BadRequest`` where the
        buffer cannot place it, what ``read`` raises, and ``BufferUnread`` (a
        ``StoreUnavailable``) where it reads None: a fail-open store answers a
        Redis timeout from its local fallback, which lacks the stream, or the
        buffer expired between two reads; a client taken as
        placed there was replayed by its event number (text twice, or
        missing, for a client of another split). A sampled
        (temperature > 0) stream whose router died may hold a continuation's
        text where the client has the dead router's, the same counts of
        other words: such a client is not placed (one ahead of the buffer by
        events goes on: a live router's buffer places it as it grows, and
        ``_take_over`` refuses it where the router is dead)."""
        pos, scan, params = self.pos, self.scan, self.meta.params
        if scan is None:
            return None
        if scan.have.tokens > params.max_tokens or (pos.end == 2 and not self.meta.include_usage):
            # (no event of this stream counts that: an id of another, or made up. Not
            # refused, it waited for the stream's end, placed again as it grew)
            raise BadRequest(mismatch(self.sid, pos), param="Last-Event-ID", code="resume_mismatch")
        if scan.events == 0:  # (usually event N is there with those counts: a short read)
            near = await _must(read, pos.event - 1, self.sid)
            if near.events and (not near.events[0] or mark_of(near.events[0]) == scan.have):
                return None
        done = scan.events
        new = await _must(read, done, self.sid)
        if done < pos.event <= done + len(new.events) and mark_of(new.events[pos.event - done - 1]) in (None, scan.have):
            return None  # (event N came meanwhile)
        spot = await _feed(scan, new.events)
        if spot.kind == BEYOND and pos.event > new.total_events:
            return AHEAD
        if params.temperature > 0 and new.lost:
            raise BadRequest(f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars} is not of stream {self.sid}'s "
                             "stored events, whose router died: they may be a sampled (temperature > 0) "
                             "continuation's, other text than the client's; retry the request.",
                             param="Last-Event-ID", code="resume_gap")
        k = spot.event
        m = mark_of(new.events[k - done - 1]) if spot.kind in (AT, INSIDE) else None
        if spot.kind == AT:
            assert m is not None
            return Placed(Position(k, m.tokens, m.chars, m.end))
        if spot.kind == INSIDE:
            assert scan.prev is not None and m is not None
            partial = rest_of(new.events[k - done - 1], scan.prev, scan.have)
            if partial is not None:
                return Placed(Position(k, m.tokens, m.chars, m.end), partial)
        elif spot.kind == BEYOND:
            return WAIT
        elif spot.kind == GAP:
            raise BadRequest(f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars}: the text after it was lost with "
                             f"the router that produced it (events up to {k} of stream {self.sid} cannot be "
                             "replayed); retry the request.", param="Last-Event-ID", code="resume_gap")
        raise BadRequest(mismatch(self.sid, pos), param="Last-Event-ID", code="resume_mismatch")


async def _feed(scan: Scan, events: Sequence[bytes]) -> Spot:
    """``scan.feed`` of ``events``' marks, ``MARK_SLICE`` events a turn of
    the event loop: up to the event that answers (an answer at an event
    stands whatever comes after it), else all of them. Every mark of a long
    buffer in one turn (~5 ms for 1,024 events) held every other stream, for
    as many resumes as came in together (router/replay_slices.py)."""
    start = 0
    while True:
        spot = scan.feed(map(mark_of, events[start:start + MARK_SLICE]))
        start += MARK_SLICE
        if spot.event or start >= len(events):  # (answered at an event; one at none is for the events so far)
            return spot
        await asyncio.sleep(0)


class BufferUnread(StoreUnavailable):
    """A read that placed the client found no buffer: the store's fallback
    answered (an outage: a 503), or the buffer expired meanwhile (a healthy
    store: a 404). Either way not "nothing to do": the client is not placed."""


async def _must(read: Callable[[int], Awaitable[StreamSnapshot | None]], after: int, sid: str) -> StreamSnapshot:
    if (got := await read(after)) is None:
        raise BufferUnread(f"stream {sid} cannot be read to place the client")
    return got


def mismatch(sid: str, pos: Position) -> str:
    return (f"Last-Event-ID {pos.event}-{pos.tokens}-{pos.chars} does not match stream {sid}: no stored event "
            "ends at those completion tokens and characters or holds them; resume with an id this stream's "
            "events carry.")


def ahead(snap: StreamSnapshot, pos: Position, cursor: int, padded: bool) -> bool:
    """Whether the client (at ``pos``, ``cursor`` events) has more of the
    stream than the buffer (``snap``, read after its last event): events it
    lacks (lost with the router that sent them), or, level with it in
    events, tokens or text. A resume that continued a client ahead by events
    padded the buffer with placeholders for them, then regenerated their text
    without sending it (or storing an event); cut off there (its client left
    again, its router died), it left the buffer level with that client in
    events and behind it in tokens and text, which the client's id
    (``N-T-C``) shows. Only where the client's last event is such a
    placeholder in the buffer (``padded``, ``client_on_placeholder``): where
    it is a real event, an id that counts more is never taken as ahead (no
    characters are dropped from the buffer for the clients that hold its
    ids): ``Placer`` placed it among the stored events by its counts, or it
    was refused (``resume_mismatch``) where no live router stores more. (After
    events replayed, the client has the buffer's text, and ``pos`` is from
    before them: never ``padded``.)"""
    if cursor > snap.total_events:
        return True
    if not padded or pos.tokens is None or pos.chars is None:
        return False
    return pos.tokens > len(snap.token_ids) or pos.chars > snap.text_len
