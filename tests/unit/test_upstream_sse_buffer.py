"""An upstream's SSE body into deltas. A large event: its pieces are not
scanned again and again (the router's event loop, shared by every tenant's
streams, was held for seconds by one 16 MB event), and an event past the
limit fails the request instead of growing the buffer without end. The
events of one read: they go on as few pieces as the collector's ``limit``
(the tenant's ``chunk_tokens``) allows, and tokens that came without text
(a character's first bytes), which join the next event, count against
that event's limit."""

from __future__ import annotations

import msgspec
import pytest

import replicas.upstream_sse as upstream_sse
from replicas.client import Collector
from replicas.protocol import FinishReason
from replicas.upstream_errors import UpstreamFailed
from replicas.upstream_sse import SseReader, Stream


class _Owner:
    def __init__(self) -> None:
        self.finished = []

    def first_chunk(self, st, chunk, resumed) -> None:
        st.resumable = True
        if st.prompt_ids is None:
            st.prompt_ids = chunk.choices[0].prompt_token_ids

    def finish(self, st, delta) -> None:
        st.done = True
        self.finished.append(delta)
        st.col.put(delta)

    def current(self, st) -> bool:
        return not st.done


class _Resp:
    def close(self, exc=None) -> None:
        pass


def _reader(limit: int = 0):
    col = Collector(1)
    col.limit = limit
    st = Stream(col, None)
    owner = _Owner()
    return SseReader(owner, st, False, _Resp()), owner, col  # type: ignore[arg-type]


def _events(size: int) -> bytes:
    big = b'data: {"choices":[{"index":0,"text":"a","token_ids":[1],"prompt_token_ids":[7],"finish_reason":null}],' \
          b'"pad":"' + b"x" * size + b'"}\n\n'
    return big + b'data: {"choices":[{"index":0,"text":"b","token_ids":[2],"finish_reason":"length"}]}\n\n' \
        + b"data: [DONE]\n\n"


async def test_a_large_event_in_many_reads_is_scanned_about_once(monkeypatch) -> None:
    scanned = []
    real = upstream_sse.sse_data

    def counting(buf: bytes):
        scanned.append(len(buf))
        return real(buf)

    monkeypatch.setattr(upstream_sse, "sse_data", counting)
    body = _events(4 << 20)
    reader, owner, col = _reader()
    for i in range(0, len(body), 16384):
        reader.feed(body[i:i + 16384])
    assert [d.finish for d in owner.finished] == [FinishReason.LENGTH]
    assert sum(scanned) < 3 * len(body), sum(scanned)  # (was ~ len(body)**2 / 32 KB: 560 MB here)


async def test_an_event_split_anywhere_still_parses(monkeypatch) -> None:
    for sep in (b"\n", b"\r\n"):
        body = _events(100).replace(b"\n", sep)
        for step in (1, 2, 3, 5, 7):
            reader, owner, col = _reader()
            for i in range(0, len(body), step):
                reader.feed(body[i:i + step])
            assert [d.finish for d in owner.finished] == [FinishReason.LENGTH], (sep, step)
            assert col.prompt_token_ids == [7]


async def test_every_line_ending_the_standard_allows_parses_split_anywhere() -> None:
    # (SSE ends a line with CRLF, LF or a lone CR; a JSON chunk folded over two
    # data lines is one event: a CRLF split between two reads must not end it)
    folded = (b'data: {"choices":[{"index":0,"text":"a","token_ids":[1],\n'
              b'data: "prompt_token_ids":[7],"finish_reason":null}]}\n\n')
    for sep in (b"\n", b"\r\n", b"\r"):
        body = (folded + _events(10)).replace(b"\n", sep)
        for step in (1, 2, 3, 5, 7, len(body)):
            reader, owner, col = _reader()
            for i in range(0, len(body), step):
                reader.feed(body[i:i + step])
            assert [d.finish for d in owner.finished] == [FinishReason.LENGTH], (sep, step)
            assert col.prompt_token_ids == [7]


def test_an_event_that_a_lone_cr_ends_is_not_held_for_the_next_read() -> None:
    from replicas.http11 import sse_data

    assert sse_data(b"data: 1\r\r") == ([b"1"], b"")
    assert sse_data(b"data: 1\r\n\r") == ([b"1"], b"")  # (an LF may follow: an empty line)
    assert sse_data(b"\ndata: 2\r\n\r\n") == ([b"2"], b"")
    assert sse_data(b"data: 1\r") == ([], b"data: 1\r")  # (its LF may be in the next read)


async def test_an_event_past_the_limit_fails_the_request(monkeypatch) -> None:
    monkeypatch.setattr(upstream_sse, "MAX_EVENT", 1 << 20)
    reader, owner, col = _reader()
    with pytest.raises(UpstreamFailed, match="event"):
        for _ in range(100):
            reader.feed(b"data: " + b"x" * 65536)  # never a blank line


def test_the_data_lines_of_one_event_are_one_payload() -> None:
    # (valid SSE: a JSON chunk over several data lines, joined by newlines; each
    # line was decoded on its own, and the request failed on the upstream)
    from replicas.http11 import sse_data

    body = (b': keep-alive\nevent: message\nid: 3\ndata: {"choices":\ndata: [{"index":0,"text":"a"}]}\n\n'
            b"data: [DONE]\n\n")
    payloads, rest = sse_data(body)
    assert payloads == [b'{"choices":\n[{"index":0,"text":"a"}]}', b"[DONE]"] and rest == b""


def _event(ids: list[int], text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n"


def _as_events(col: Collector) -> list[tuple[list[int], str]]:
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
    reader, _, col = _reader(4)
    reader.feed(b"".join(_event([t], "x") for t in range(1, 11)))
    assert [(d.token_ids, d.text) for d in col._pending] == [
        ([1, 2, 3, 4], "xxxx"), ([5, 6, 7, 8], "xxxx"), ([9, 10], "xx")]


def test_tokens_sent_without_text_count_against_the_next_events_limit() -> None:
    reader, _, col = _reader(4)
    reader.feed(_event([1], "") + _event([2], ""))  # (a read of a character's first bytes)
    reader.feed(b"".join(_event([t], "x") for t in range(3, 9)))
    assert _as_events(col) == [([1, 2, 3, 4], "xx"), ([5, 6, 7, 8], "xxxx")]
    assert max(len(ids) for ids, _ in _as_events(col)) <= 4


def test_a_piece_with_text_pays_what_was_owed() -> None:
    reader, _, col = _reader(4)
    reader.feed(_event([1], ""))
    reader.feed(_event([2], "a"))  # (the owed token goes with this event)
    reader.feed(b"".join(_event([t], "x") for t in range(3, 8)) + _event([8], "y", "length"))
    events = _as_events(col)
    assert events[0] == ([1, 2], "a")
    assert events[1] == ([3, 4, 5, 6], "xxxx")  # (nothing owed any more: the whole limit)
    assert col._pending[-1].finish == FinishReason.LENGTH
    assert max(len(ids) for ids, _ in events) <= 4


@pytest.mark.parametrize("raw, reason", [
    (b'"</s>"', "</s>"), (b"128009", 128009), (b"null", None), (b"1.5", None), (b"[1, 2]", None),
    (b'{"a": 1}', None), (b"true", None), (b"1e400", None), (b"123456789012345678901234567890", None),
])
async def test_an_upstreams_stop_reason_is_vllms_or_none(raw: bytes, reason) -> None:
    # (vLLM's stop_reason is the stop string or the stop token's id; another
    # server's other value failed the request at its finish chunk, where the
    # field used to be ignored)
    reader, owner, col = _reader()
    reader.feed(_event([1], "a") + b'data: {"choices":[{"index":0,"text":"","token_ids":[2],"finish_reason":"stop",'
                b'"stop_reason":' + raw + b"}]}\n\ndata: [DONE]\n\n")
    assert [(d.finish, d.stop_reason) for d in owner.finished] == [(FinishReason.STOP, reason)]
