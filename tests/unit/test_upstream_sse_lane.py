"""An upstream stream's usual read with a token lane (``SseReader._laned``):
one event of one ``data:`` line, a plain chunk, goes to the lane in one
pass, without ``sse_data`` and ``_put``; anything else goes the general way.
Both ways must give the lane, the collector and the reader the same: reads
of any framing (several events, CR line ends, a space the general path
strips, ``[DONE]``, usage, finish, a second choice) are fed to a reader with
the one-pass path and to one without it, and compared."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as hs

import replicas.upstream_sse as upstream_sse
from replicas.client import Collector
from replicas.upstream_sse import SseReader, Stream


class _Owner:
    def __init__(self) -> None:
        self.finished = []

    def first_chunk(self, st, chunk, resumed) -> None:
        st.resumable = True

    def finish(self, st, delta) -> None:
        st.done = True
        self.finished.append((delta.token_ids, delta.text, delta.finish, delta.count, delta.prompt_count))

    def current(self, st) -> bool:
        return not st.done


class _Resp:
    def close(self, exc=None) -> None:
        pass


class _Lane:
    """Takes a piece unless told to decline (a paused client)."""

    def __init__(self, declines: set[int]) -> None:
        self.declines = declines
        self.calls: list[tuple[list[int], str, bool]] = []

    def tokens(self, ids: list[int], text: str) -> bool:
        took = len(self.calls) not in self.declines
        self.calls.append((list(ids), text, took))
        return took


class _General(SseReader):
    """A reader without the one-pass path."""

    __slots__ = ()

    def _laned(self, data: bytes) -> bool:
        return False


def _reader(declines: set[int], laned: bool = True):
    col = Collector(1)
    col.lane = _Lane(declines)
    st = Stream(col, None)
    owner = _Owner()
    return (SseReader if laned else _General)(owner, st, False, _Resp()), owner, col  # type: ignore[arg-type]


def _event(ids: list[int] | None, text: str | None, finish: str | None = None, *, chat: bool = False,
           index: int = 0, usage: bool = False, sep: bytes = b"data: ", end: bytes = b"\n\n") -> bytes:
    choice: dict = {"index": index, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    if ids is not None:
        choice["token_ids"] = ids
    chunk: dict = {"choices": [choice]}
    if usage:
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": 9}
    return sep + msgspec.json.encode(chunk) + end


def _state(reader: SseReader, owner: _Owner, col: Collector):
    return (col.lane.calls, [(d.token_ids, d.text, d.finish, d.count) for d in col._pending], owner.finished,
            reader.owed, reader.counted, reader.ended, reader.st.delivered, reader.st.resumable,
            reader.usage is not None, reader.parts)


def _feed(reads: list[bytes], declines: set[int], laned: bool):
    reader, owner, col = _reader(declines, laned)
    for r in reads:
        try:
            reader.feed(r)
        except Exception as e:  # noqa: BLE001 - the response ends with it (Response._body): the same one both ways
            return _state(reader, owner, col), repr(e)
    return _state(reader, owner, col), None


_plain = hs.builds(lambda t, s: _event([t], s), hs.integers(1, 99), hs.sampled_from(["a", "bc", "é", "\n", ""]))
_other = hs.sampled_from([
    _event([5], "x", chat=True), _event([6], "y", sep=b"data:"), _event([7], "z", sep=b"data:  "),
    _event([8], "w", end=b"\r\n\r\n"), _event([9], "v", index=1), _event(None, "u"), _event([], "t"),
    _event([10], "s", usage=True), _event([11], "r", "length"), b": comment\n\n", b"data: [DONE]\n\n",
    _event([12], "q") + _event([13], "p"), _event([14], "o", end=b"\n"), b"\n",
])


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.one_of(_plain, _plain, _other), max_size=14), hs.sets(hs.integers(0, 14), max_size=3))
def test_the_one_pass_path_gives_what_the_general_path_gives(reads, declines) -> None:
    first = [_event([1], "hi")]  # (the first chunk always goes the general way)
    assert _feed(first + reads, declines, True) == _feed(first + reads, declines, False)


def test_a_plain_read_goes_to_the_lane_without_the_general_path(monkeypatch) -> None:
    reader, _, col = _reader(set())
    reader.feed(_event([1], "a"))
    calls = []
    monkeypatch.setattr(upstream_sse, "sse_data", lambda data: calls.append(data) or ([], b""))
    reader.feed(_event([2], "b"))
    reader.feed(_event([3], "c", chat=True))
    assert calls == []
    assert col.lane.calls[-2:] == [([2], "b", True), ([3], "c", True)]


# Any stream an upstream may send, cut into reads anywhere (a review's
# differential fuzz): events of several lines, other fields and comments,
# CR and CRLF line ends, whitespace around the JSON (a form feed the general
# path strips: the one-pass path took it to the decoder, which failed the
# stream), role-only, logprobs, error and usage chunks, [DONE].
_texts = hs.sampled_from(["a", "é", "日本", "🙂", " x", "", "\n"])
_choice = hs.builds(
    lambda ids, text, finish, index, chat, role, logprobs: {
        "index": index, "finish_reason": finish,
        **({"delta": {"content": text, **({"role": "assistant"} if role else {})}} if chat else {"text": text}),
        **({"token_ids": ids} if ids is not None else {}),
        **({"logprobs": {"tokens": ["a"], "token_logprobs": [-0.1]}} if logprobs else {}),
    },
    hs.one_of(hs.none(), hs.lists(hs.integers(1, 50), max_size=3)), _texts,
    hs.sampled_from([None, None, None, "stop", "length"]), hs.sampled_from([0, 0, 0, 1]),
    hs.booleans(), hs.booleans(), hs.booleans(),
)
_payload = hs.one_of(
    hs.builds(lambda cs: msgspec.json.encode({"choices": cs}).decode(), hs.lists(_choice, min_size=1, max_size=2)),
    hs.builds(lambda cs: msgspec.json.encode({"choices": cs, "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
              .decode(), hs.lists(_choice, max_size=1)),
    hs.just("[DONE]"), hs.just('{"error": {"message": "boom"}}'), hs.just('{"object": "error", "message": "boom"}'),
)


def _frame(payload: str, sep: str, nl: str, trail: str, multiline: bool, fields: bool) -> bytes:
    lines = ["event: message", "id: 7", ": keepalive"] if fields else []
    if multiline and payload.startswith("{"):
        half = len(payload) // 2
        lines += [sep + payload[:half], sep + payload[half:]]
    else:
        lines.append(sep + payload + trail)
    return (nl.join(lines) + nl + nl).encode()


_framed = hs.builds(_frame, _payload, hs.sampled_from(["data: ", "data: ", "data:", "data:  "]),
                    hs.sampled_from(["\n", "\n", "\r\n", "\r"]), hs.sampled_from(["", "", " ", "\t", "\x0c", "\x0b"]),
                    hs.booleans(), hs.booleans())
_extra = hs.sampled_from([b": ping\n\n", b"\n", b"data:\n\n", b"data: \n\n", b"event: ping\n\n"])


def _feed_cut(stream: bytes, cuts: list[int], declines: set[int], laned: bool, asked_usage: bool):
    reader, owner, col = _reader(declines, laned)
    reader.st.asked_usage = asked_usage
    error, pos = None, 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        piece, pos = stream[pos:cut], max(pos, cut)
        if not piece:
            continue
        try:
            reader.feed(piece)
        except Exception as e:  # noqa: BLE001 - the response ends with it: the same one both ways
            error = repr(e)
            break
    if reader.timer is not None:
        reader.timer.cancel()
    return _state(reader, owner, col), error


@settings(max_examples=400, deadline=None)
@given(hs.lists(hs.one_of(_framed, _framed, _framed, _extra), max_size=10), hs.lists(hs.integers(0, 2000), max_size=10),
       hs.booleans(), hs.sets(hs.integers(0, 10), max_size=3), hs.booleans())
async def test_any_stream_cut_anywhere_gives_the_same_both_ways(events, cuts, at_events, declines, asked_usage) -> None:
    first = _event([1], "hi")
    stream = first + b"".join(events)
    if at_events:  # (reads at the events' ends)
        cuts = [len(first)]
        for e in events:
            cuts.append(cuts[-1] + len(e))
    assert (_feed_cut(stream, cuts, declines, True, asked_usage)
            == _feed_cut(stream, cuts, declines, False, asked_usage)), (stream, cuts)
