"""A resume's replay of its buffer, in slices that give the event loop back.

uvicorn's ``send`` (and a WebSocket's) returns without suspending while the
client's transport is not paused, which a client reading as fast as the
loopback delivers never makes it. A replay that wrote its buffer one event
at a time therefore ran to its end in one turn of the event loop (~18 ms
for a finished 1,024-token stream, ~210 KB), and K replays ready together
ran K such turns back to back: 30 at once held every other tenant's
streams ~0.6 s, a sustained storm within one tenant's rate limit took
another tenant's time to first token from 25 to 700 ms.

So the HTTP replay joins the stored events into slices of at most
``SLICE_BYTES`` (one write each: far cheaper than a write per event) and
gives the loop a turn after each (router/resume_http.py). A WebSocket sends
each event as a message of its own, which costs per message, not per byte:
it splits a slice into its events (``events_of``) and gives the loop a turn
every ``SOCKET_MESSAGES`` of them (router/websocket_stream.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate

__all__ = ["SLICE_BYTES", "SOCKET_MESSAGES", "events_of", "slices"]

SLICE_BYTES = 64 * 1024  # (~300 token events: one write of it takes well under a millisecond)
SOCKET_MESSAGES = 8  # WebSocket messages sent from one slice before the loop gets a turn (~0.4 ms: ~50 us each)


def slices(events: Sequence[bytes], limit: int = SLICE_BYTES) -> Iterator[tuple[bytes, int]]:
    """``events`` in order, joined in runs of at most ``limit`` bytes (an
    event longer than that alone), each with the number of events it holds.
    An empty event (a placeholder for events lost with a router) comes as
    ``(b"", 1)`` after the run before it, and nothing after it: its reader
    stops there. (The cuts are found by bisection over the running sizes:
    a Python step per event cost more than the writes it saved.)"""
    try:
        stop = events.index(b"")
    except ValueError:
        stop = len(events)
    ends = list(accumulate(map(len, events[:stop])))
    at = size = 0
    while at < stop:
        cut = max(bisect_right(ends, size + limit, at), at + 1)
        yield b"".join(events[at:cut]), cut - at
        at, size = cut, ends[cut - 1]
    if stop < len(events):
        yield b"", 1


def events_of(chunk: bytes) -> list[bytes]:
    """The SSE events in ``chunk`` (a slice, or one event), each with the
    blank line that ends it. A JSON payload holds no raw newline, so a blank
    line only ever ends an event (router/sse.py ``lead``); a chat stream's
    role chunk, which leads its event 1 without an id, comes as an event of
    its own. A comment (one line, no blank line after it) comes whole."""
    if chunk.count(b"\n\n") < 2:  # (one event, or a comment: a live stream's, the common case)
        return [chunk]
    parts = chunk.split(b"\n\n")
    out = [part + b"\n\n" for part in parts[:-1]]
    if parts[-1]:  # (never for events the router made; kept rather than lost)
        out.append(parts[-1])
    return out
