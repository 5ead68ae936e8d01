"""An OpenAI-compatible upstream's streamed response into one request's
deltas: ``SseReader`` parses the SSE body (``replicas.http11.sse_data``
splits its events, msgspec decodes the ``Chunk``s) inside the connection's
``data_received``, with no task wake-up per chunk, and puts the deltas in
the request's single-slot collector; ``Stream`` is the request's state the
reader and its ``UpstreamClient`` (``replicas.upstream``) share.

This is the upstream's hot relay path (docs/perf.md, "Where time to first
token goes"): one ``feed`` per read, its events merged into as few deltas
as the collector's chunk limit allows.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgspec

from replicas.client import Collector
from replicas.http11 import Response, sse_data
from replicas.protocol import MAX_FRAME, Delta, FinishReason
from replicas.splice import Splice
from replicas.upstream_errors import UpstreamFailed, error_text

__all__ = ["SseReader", "Stream", "StreamOwner", "Chunk", "USAGE_WAIT", "MAX_EVENT"]

# How long a stream without token ids waits after its finish for the usage
# chunk (normally the next event, in the same read) before finishing without.
USAGE_WAIT = 1.0
# The longest SSE event taken from an upstream (as the replica protocol's
# longest frame): one that grows past it without its blank line fails the request.
MAX_EVENT = MAX_FRAME
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class _ChatDelta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _ChatDelta | None = None
    finish_reason: str | None = None
    # vLLM's, on a finish: read only there (_stop_reason), leniently, so
    # that another server's odd value (a float, a list) is dropped, not a
    # failed request
    stop_reason: msgspec.Raw = msgspec.Raw()
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class Chunk(msgspec.Struct):
    """One SSE event's JSON: a completion or chat completion chunk, or an error."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None  # the last chunk, when asked with stream_options.include_usage
    prompt_token_ids: list[int] | None = None  # chat: on the first chunk
    error: Any = None
    object: str | None = None  # older vLLM: {"object": "error", "message": ...}
    message: str | None = None


_chunk_decoder = msgspec.json.Decoder(Chunk)
_stop_reason_decoder = msgspec.json.Decoder(str | int | None)


def _stop_reason(raw: msgspec.Raw) -> str | int | None:
    """An upstream's ``stop_reason`` as vLLM gives it (the stop string, or
    the stop token's id); anything else (or an int past 64 bits) None."""
    if not raw:
        return None
    try:
        reason = _stop_reason_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    # (msgspec takes an int of any size; the replica protocol, msgpack, only 64 bits)
    return None if isinstance(reason, int) and not -(1 << 63) <= reason < 1 << 64 else reason


class Stream:
    """One request: its collector, the task that starts it and then its
    response; whether output reached the router, and whether the router
    could resume it (token ids known)."""

    __slots__ = ("col", "delivered", "resumable", "done", "asked_usage", "prompt_ids", "splice", "task", "resp")

    def __init__(self, col: Collector, prompt_ids: list[int] | None) -> None:
        self.col = col
        self.delivered = False
        self.resumable = False
        self.done = False
        self.asked_usage = False  # its request asked for the usage chunk
        self.prompt_ids = prompt_ids  # goes out with the first delta
        self.splice: Splice | None = None
        self.task: asyncio.Task[None] | None = None
        self.resp: Response | None = None


class StreamOwner(Protocol):
    """What a reader asks of the ``UpstreamClient`` that owns its stream."""

    def first_chunk(self, st: Stream, chunk: Chunk, resumed: bool) -> None: ...

    def finish(self, st: Stream, delta: Delta) -> None: ...

    def current(self, st: Stream) -> bool: ...


class SseReader:
    """One response's SSE body into deltas as it arrives: ``feed`` runs in
    the connection's ``data_received``; the events of one read become one
    delta, or several of at most the collector's ``limit`` tokens (the
    tenant's ``chunk_tokens``).

    A stream without token ids, whose request asked for the usage chunk,
    holds its finish back until that chunk (the next event; usually the
    same read), so the finish carries the prompt's token count and the
    upstream's own completion count where it exceeds the chunks counted."""

    __slots__ = ("client", "st", "resumed", "response", "first", "ended", "counted", "held", "usage", "timer",
                 "parts", "size", "tail", "owed")

    def __init__(self, client: StreamOwner, st: Stream, resumed: bool, response: Response) -> None:
        self.client = client
        self.st = st
        self.resumed = resumed
        self.response = response
        # an incomplete event's reads, joined only once a read may end it (its
        # blank line): a large event in many reads is not copied and split again
        # at every read, which held the event loop for seconds (16 MB: 3.4 s)
        self.parts: list[bytes] = []
        self.size = 0  # bytes in ``parts``
        self.tail = b""  # the last 3 bytes of ``parts``
        self.first = True
        self.ended = False
        self.counted = 0  # tokens counted one per chunk (no token ids)
        # tokens sent on without text (a character's first bytes) since the
        # last piece with text: they make no event of their own but join the
        # next one, so its merge leaves room for them
        self.owed = 0
        self.held: Delta | None = None  # the finish, until the usage chunk
        self.usage: _Usage | None = None
        self.timer: asyncio.TimerHandle | None = None  # gives up waiting for the usage chunk

    def feed(self, data: bytes) -> None:
        if self.ended:
            return
        if self.st.col.lane is not None and self._laned(data):  # (no call per read where no lane is)
            return
        if self.parts:
            seam = self.tail + data
            self.parts.append(data)
            self.size += len(data)
            self.tail = seam[-3:]
            # (a blank line: LF LF, CRLF CRLF, or with a lone CR ending a line)
            # (``find``: see ``sse_data``)
            if seam.find(b"\n\n") < 0 and seam.find(b"\n\r") < 0 and seam.find(b"\r\r") < 0:
                if self.size > MAX_EVENT:
                    raise UpstreamFailed(f"an SSE event larger than {MAX_EVENT} bytes")
                return
            data = b"".join(self.parts)
            self.parts = []
        payloads, rest = sse_data(data)
        if rest:  # (not on the usual read, which ends its events)
            if len(rest) > MAX_EVENT:
                raise UpstreamFailed(f"an SSE event larger than {MAX_EVENT} bytes")
            self.parts = [rest]
            self.size = len(rest)
            self.tail = rest[-3:]
        if not payloads:
            return
        st = self.st
        none = FinishReason.NONE
        pieces: list[tuple[list[int], str, FinishReason, int]] = []
        stop_reason = None  # the upstream's, with its finish
        for payload in payloads:
            if payload == b"[DONE]":
                self.ended = True
                break
            chunk = _chunk_decoder.decode(payload)
            if chunk.error is not None or chunk.object == "error":
                raise UpstreamFailed(error_text(chunk.error if chunk.error is not None else chunk.message))
            if chunk.usage is not None:
                self.usage = chunk.usage  # the last chunk's, or on every chunk (some servers)
            if not chunk.choices:
                continue
            if self.first:
                self.first = False
                self.client.first_chunk(st, chunk, self.resumed)
            for ch in chunk.choices:
                if ch.index != 0:
                    continue
                t = ch.text if ch.text is not None else (ch.delta.content if ch.delta else None)
                if t and ch.token_ids is None and st.resumable:
                    st.resumable = False  # text we cannot map to tokens: no resume
                finish = none
                reason = ch.finish_reason
                if reason is not None:
                    if reason in ("abort", "error"):
                        raise UpstreamFailed(f"the upstream ended the request ({reason})")
                    finish = _FINISH.get(reason, FinishReason.STOP)  # tool_calls, ...
                    stop_reason = _stop_reason(ch.stop_reason)
                if ch.token_ids is not None:
                    if ch.token_ids or t or finish != none:
                        pieces.append((ch.token_ids, t or "", finish, 0))
                elif t or (finish == none and not (ch.delta is not None and ch.delta.role)):
                    # output without token ids: count the chunk as the one
                    # token servers stream per chunk (OpenAI, vLLM, TGI,
                    # llama.cpp; one with no text holds back part of a
                    # character), so limits, usage and the stall timer see it
                    pieces.append(([], t or "", finish, 1))
                elif finish != none:
                    pieces.append(([], "", finish, 0))  # finish only (a role-only chunk is nothing)
        if st.done:
            return  # draining after the finish, so the connection can be reused
        if self.held is not None:
            self._release()
            return
        col = st.col
        limit = col.limit
        # the events of one read go out as few deltas as the consumer's
        # chunk limit allows: less work per token when the upstream is fast
        acc_ids: list[int] = []
        acc_text: list[str] = []
        acc_count = 0
        for ids, text, finish, count in pieces:
            stopped = False
            if st.splice is not None:
                text, stopped = st.splice.feed(text, finish != none, len(ids) + count)
                if stopped:
                    finish = FinishReason.STOP
            if not (ids or text or count or finish != none):
                continue
            if finish == none:
                if acc_text and limit and len(acc_ids) + acc_count + len(ids) + count + self.owed > limit:
                    self._put(st, acc_ids, acc_text, acc_count)
                    acc_ids, acc_text, acc_count = [], [], 0
                acc_ids += ids
                acc_text.append(text)
                acc_count += count
                continue
            if acc_text:
                self._put(st, acc_ids, acc_text, acc_count)
            delta = _delta(st, ids, text, finish, count)
            delta.stop_reason = st.splice.stops.matched if stopped else stop_reason  # type: ignore[union-attr]
            if stopped:
                self.client.finish(st, delta)
                self.ended = True
                self.response.close()  # our stop string, not the upstream's: abort it
            elif st.asked_usage and not st.resumable:
                self.counted += count
                self.held = delta
                self._release()
            else:
                self.client.finish(st, delta)
            return
        if acc_text:
            self._put(st, acc_ids, acc_text, acc_count)

    def _laned(self, data: bytes) -> bool:
        """The usual read of a stream in its steady state, in one pass: one
        complete event of one ``data:`` line, a plain chunk (token ids and
        text, no finish, no usage), a run with a token lane: decoded and
        handed to the lane. False: not such a read, the general path takes
        it. That is ``feed``'s loop for one plain piece without its lists,
        tuples and the ``sse_data`` and ``_put`` frames (docs/perf.md,
        "Session 39"); a chunk that turns out not plain after decoding (a
        finish, a usage chunk: once or twice per request) is decoded again
        by the general path."""
        st = self.st
        lane = st.col.lane
        if (self.parts or self.first or self.held is not None or st.splice is not None or st.done
                or st.prompt_ids is not None):
            return False
        end = len(data) - 2
        # one event of one line, a JSON object with no space around it (not [DONE]; the general path
        # strips space, a form feed too): its first LF ends it, and no CR (a line end too)
        if data[:7] != b"data: {" or data[end - 1:] != b"}\n\n" or data.find(b"\n") != end or data.find(b"\r") >= 0:
            return False
        chunk = _chunk_decoder.decode(data[6:end])
        choices = chunk.choices
        if (not choices or len(choices) != 1 or chunk.usage is not None or chunk.error is not None
                or chunk.object == "error"):
            return False
        ch = choices[0]
        ids = ch.token_ids
        t = ch.text if ch.text is not None else (ch.delta.content if ch.delta else None)
        if ch.index != 0 or not ids or not t or ch.finish_reason is not None:
            return False
        if not lane.tokens(ids, t):
            st.col.put(Delta(st.col.rid, ids, t, FinishReason.NONE))  # (no prompt ids to carry: see the guard)
        st.delivered = True
        self.owed = 0
        return True

    def _put(self, st: Stream, ids: list[int], texts: list[str], count: int) -> None:
        text = texts[0] if len(texts) == 1 else "".join(texts)
        lane = st.col.lane
        if lane is None or not ids or count or st.prompt_ids is not None or not lane.tokens(ids, text):
            st.col.put(_delta(st, ids, text, FinishReason.NONE, count))
        st.delivered = True
        if count:
            self.counted += count
        self.owed = 0 if text else self.owed + len(ids) + count

    def _release(self) -> None:
        """Finish with the held finish once the usage chunk (or the end of
        the events) is here, or ``USAGE_WAIT`` seconds have passed."""
        held, usage = self.held, self.usage
        assert held is not None
        if usage is None and not self.ended:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(USAGE_WAIT, self._waited)
            return
        self.held = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if usage is not None:
            held.prompt_count = usage.prompt_tokens or 0
            held.count += max(0, (usage.completion_tokens or 0) - self.counted)
        self.client.finish(self.st, held)

    def flush(self) -> None:
        """The body is over (or broke) with the finish held: finish without usage."""
        self.ended = True
        self._release()

    def _waited(self) -> None:
        """No usage chunk and no end of the body within ``USAGE_WAIT`` of the
        finish (a server that keeps the body open): finish without usage,
        unless the stream was aborted meanwhile."""
        self.timer = None
        if self.held is not None and self.client.current(self.st):
            self.flush()

    def end(self) -> None:
        """The body is over."""
        if not self.st.done:
            raise UpstreamFailed("the stream ended before the request finished")


def _delta(st: Stream, ids: list[int], text: str, finish: FinishReason, count: int = 0) -> Delta:
    """A delta of ``st``; the first one carries the prompt's token ids."""
    delta = Delta(st.col.rid, ids, text, finish, count=count)
    if st.prompt_ids is not None:
        delta.prompt_token_ids, st.prompt_ids = st.prompt_ids, None
    return delta
