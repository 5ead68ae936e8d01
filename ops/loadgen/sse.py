"""Incremental Server-Sent Events parsing and the OpenAI chunk shapes we read.

``SseParser.feed(bytes)`` returns the ``data`` payloads of the events that
the bytes completed (per the SSE spec: lines end in LF, CRLF or CR; a blank
line ends an event; ``data:`` lines join with LF; one space after the colon
is dropped; comment lines start with ``:``; ``id:``/``event:`` are ignored
here). Chunks are decoded with msgspec into small typed structs that ignore
fields we do not need.
"""

from __future__ import annotations

import msgspec

__all__ = ["SseParser", "Chunk", "ErrorDetail", "Usage", "decode_chunk", "decode_error"]


class SseParser:
    __slots__ = ("_buf", "_data", "_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._cr = False  # last chunk ended in CR: a following LF belongs to it

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        self._buf = lines.pop()  # incomplete last line (b"" when buf ended in a newline)
        out: list[bytes] = []
        for line in lines:
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                v = line[5:]
                self._data.append(v[1:] if v.startswith(b" ") else v)
            # comments (":...") and other fields (id, event, retry) are not needed
        return out

    def close(self) -> list[bytes]:
        """Payloads still pending at end of stream (an event without its blank line)."""
        out = self.feed(b"\n\n") if (self._buf or self._data) else []
        self._buf, self._data = b"", []
        return out


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ErrorDetail(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None


class Chunk(msgspec.Struct):
    """A ``chat.completion.chunk`` / ``text_completion`` event, or an error event."""

    choices: list[_Choice] = []
    usage: Usage | None = None
    error: ErrorDetail | None = None

    def text(self) -> str:
        parts = []
        for c in self.choices:
            t = c.delta.content if c.delta is not None else c.text
            if t:
                parts.append(t)
        return "".join(parts)


class _ErrorBody(msgspec.Struct):
    error: ErrorDetail | None = None


_chunk_decoder = msgspec.json.Decoder(Chunk)
_error_decoder = msgspec.json.Decoder(_ErrorBody)


def decode_chunk(data: bytes) -> Chunk:
    return _chunk_decoder.decode(data)


def decode_error(body: bytes) -> ErrorDetail | None:
    """The ``error`` object of an OpenAI-style error body, if it is one."""
    try:
        return _error_decoder.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
