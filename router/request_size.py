"""The size limit of a request's header fields on a client connection: its
head (request line and headers) and a chunked body's trailers and chunk
extensions, ``MAX_HEAD_BYTES``; past it, a 431 ``header_too_large``.

httptools buffers a header or trailer field until its line ends, calling
nothing, so what a line has not ended is counted from the reads: while the
head is incomplete, the bytes received since the request began; while the
body is read, the bytes of the reads that gave no body byte. A chunked
body's trailers come after its last body byte and are never interleaved with
body bytes, so at most one read (uvloop reads at most 256 KiB) of them goes
uncounted; a legitimate body sends only a chunk's size line (and its CRLF)
between two of its bytes. Counted from the head's end alone, an unended
trailer line grew the router by twice what was sent, for as long as
``body_timeout`` allowed (128 MB sent on one connection: ~290 MB).
"""

from __future__ import annotations

__all__ = ["MAX_HEAD_BYTES", "RequestSize"]

MAX_HEAD_BYTES = 64 * 1024  # request line and headers; a body's trailers and the bytes between two body bytes


class RequestSize:
    """The counting of ``router.connection.HttpConnection`` (the protocol it
    is mixed into: ``_refuse``, ``_in_head``, ``cycle``), reset as each
    request begins (``_start_size``)."""

    __slots__ = ("_head", "_raw", "_bare", "_bodied")

    def _open_size(self) -> None:  # (as the connection opens)
        self._bodied = False  # (the read being fed gave a body byte: on_body)
        self._start_size()

    def _start_size(self) -> None:  # (as a request begins; not _bodied: a read may end one request and begin another)
        self._head = 0  # bytes of the request line and headers (and trailers) parsed so far
        self._raw = 0  # bytes received since the request began, while its head is incomplete
        self._bare = 0  # bytes of the reads since the body's last byte, while its body is read

    def _refuse_size(self) -> None:
        refuse = self._refuse  # type: ignore[attr-defined]
        refuse(431, "Request header fields too large.", "header_too_large", "header_too_large")

    def _count(self, n: int) -> None:
        self._head += n
        if self._head > MAX_HEAD_BYTES:
            self._refuse_size()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)  # type: ignore[misc]
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:  # (a trailer's too)
        super().on_header(name, value)  # type: ignore[misc]
        # (``_count``'s sum inline, the refusal by it: this runs for every header of every request)
        self._head += len(name) + len(value) + 4
        if self._head > MAX_HEAD_BYTES:
            self._count(0)

    def _count_read(self, data: bytes) -> None:
        """Count a read just fed to the parser (the connection not refused)."""
        bodied, self._bodied = self._bodied, False
        if not self._in_head:  # type: ignore[attr-defined]
            if bodied:
                self._bare = 0
                return
            cycle = self.cycle  # type: ignore[attr-defined]
            if cycle is None and self._over:  # type: ignore[attr-defined]
                pass  # (a connection past max_connections: no cycle, its request read before its 503, trailers too)
            elif cycle is None or not cycle.more_body:  # (no body under way: a WebSocket's upgrade, a request's end)
                return
        # the bytes after the read's last head end (a pipelined head's, or the one whose body follows), unseen
        # by on_header: a head's, or a body's trailers (which end at their own blank line) or chunk extensions
        end = data.rfind(b"\r\n\r\n")
        n = len(data) - end - 4 if end >= 0 else len(data)
        if self._in_head:  # type: ignore[attr-defined]
            self._raw += n
            over = self._raw > MAX_HEAD_BYTES
        else:
            self._bare += n
            over = self._bare > MAX_HEAD_BYTES
        if over:
            self._refuse_size()
