"""A resume's replay in slices (router/replay_slices.py): the stored events
joined in order, in runs of bounded size, and split back into events for a
WebSocket."""

from __future__ import annotations

from router.replay_slices import events_of, slices


def ev(n: int, size: int = 10) -> bytes:
    head = f"id: {n}-{n}-{n}\ndata: ".encode()
    return head + b"x" * (size - len(head) - 2) + b"\n\n"


def test_slices_join_the_events_in_order_in_runs_of_at_most_the_limit() -> None:
    events = [ev(i, 30) for i in range(1, 11)]
    out = list(slices(events, 100))
    assert [n for _, n in out] == [3, 3, 3, 1]
    assert all(len(piece) <= 100 for piece, _ in out)
    assert b"".join(piece for piece, _ in out) == b"".join(events)
    assert list(slices(events, 300)) == [(b"".join(events), 10)]


def test_an_event_longer_than_the_limit_goes_alone_and_none_is_lost() -> None:
    events = [ev(1, 30), ev(2, 500), ev(3, 30), ev(4, 30)]
    assert list(slices(events, 100)) == [(events[0], 1), (events[1], 1), (events[2] + events[3], 2)]
    assert list(slices([], 100)) == [] and list(slices((), 100)) == []


def test_a_placeholder_ends_the_slices_after_the_run_before_it() -> None:
    events = [ev(1, 30), ev(2, 30), b"", ev(4, 30)]
    assert list(slices(events, 100)) == [(events[0] + events[1], 2), (b"", 1)]
    assert list(slices([b"", ev(2)], 100)) == [(b"", 1)]


def test_events_of_gives_back_each_sse_event_of_a_slice() -> None:
    events = [ev(i, 40) for i in range(1, 6)]
    assert events_of(b"".join(events)) == events
    assert events_of(events[0]) == [events[0]]
    comment = b": waiting for the stream\n"
    assert events_of(comment) == [comment]
    role = b'data: {"role":"assistant"}\n\n'  # (a chat stream's event 1 leads with it: a message of its own)
    assert events_of(role + events[0] + events[1]) == [role, events[0], events[1]]
