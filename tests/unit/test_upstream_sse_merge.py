"""An upstream's SSE events of one read go on as few pieces as the
collector's ``limit`` (the tenant's ``chunk_tokens``) allows, and tokens
that came without text (a character's first bytes), which join the next
event, are counted against that event's limit."""

from __future__ import annotations

import msgspec

from replicas.client import Collector
from replicas.protocol import FinishReason
from replicas.upstream_sse import SseReader, Stream


class _Owner:
    def first_chunk(self, st, chunk, resumed) -> None:
        st.resumable = True

    def finish(self, st, delta) -> None:
        st.done = True
        st.col.put(delta)

    def current(self, st) -> bool:
        return not st.done


class _Resp:
    def close(self, exc=None) -> None:
        pass


def _reader(limit: int):
    col = Collector(1)
    col.limit = limit
    return SseReader(_Owner(), Stream(col, None), False, _Resp()), col  # type: ignore[arg-type]


def _event(ids: list[int], text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n"


def _events(col: Collector) -> list[tuple[list[int], str]]:
    """The pieces as the client's events carry them: pieces without text
    join the next one."""
    out: list[tuple[list[int], str]] = []
    owed: list[int] = []
    for d in col._pending:
        owed += d.token_ids
        if d.text or d.finish:
            out.append((owed, d.text))
            owed = []
    return out


def test_the_events_of_one_read_go_on_as_pieces_of_at_most_the_limit() -> None:
    reader, col = _reader(4)
    reader.feed(b"".join(_event([t], "x") for t in range(1, 11)))
    assert [(d.token_ids, d.text) for d in col._pending] == [
        ([1, 2, 3, 4], "xxxx"), ([5, 6, 7, 8], "xxxx"), ([9, 10], "xx")]


def test_tokens_sent_without_text_count_against_the_next_events_limit() -> None:
    reader, col = _reader(4)
    reader.feed(_event([1], "") + _event([2], ""))  # (a read of a character's first bytes)
    reader.feed(b"".join(_event([t], "x") for t in range(3, 9)))
    assert _events(col) == [([1, 2, 3, 4], "xx"), ([5, 6, 7, 8], "xxxx")]
    assert max(len(ids) for ids, _ in _events(col)) <= 4


def test_a_piece_with_text_pays_what_was_owed() -> None:
    reader, col = _reader(4)
    reader.feed(_event([1], ""))
    reader.feed(_event([2], "a"))  # (the owed token goes with this event)
    reader.feed(b"".join(_event([t], "x") for t in range(3, 8)) + _event([8], "y", "length"))
    events = _events(col)
    assert events[0] == ([1, 2], "a")
    assert events[1] == ([3, 4, 5, 6], "xxxx")  # (nothing owed any more: the whole limit)
    assert col._pending[-1].finish == FinishReason.LENGTH
    assert max(len(ids) for ids, _ in events) <= 4
