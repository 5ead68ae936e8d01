"""A generation's output for consumers that pull (non-streamed answers,
WebSocket, resumes): ``PieceQueue`` holds the pieces that arrive while its
consumer is busy and merges them on the next ``get``."""

from __future__ import annotations

import asyncio

from replicas.protocol import FinishReason

__all__ = ["Piece", "PieceQueue", "merge_pieces"]

Piece = tuple[str, int, FinishReason]  # text, new tokens, finish


def merge_pieces(pending: list[Piece], limit: int) -> tuple[Piece, int]:
    """The first pieces of ``pending`` merged into one, at most ``limit``
    tokens (0: no limit; a single piece larger than ``limit`` is taken
    whole), and how many pieces that took. A finish ends the merge."""
    if len(pending) == 1:
        return pending[0], 1
    texts: list[str] = []
    n = 0
    taken = 0
    finish = FinishReason.NONE
    for text, k, fin in pending:
        if limit and n and n + k > limit:
            break
        texts.append(text)
        n += k
        taken += 1
        if fin != FinishReason.NONE:
            finish = fin
            break
    return ("".join(texts), n, finish), taken


class PieceQueue:
    """A generation's output for a consumer that pulls: pieces that arrive
    while the consumer is busy wait here and are merged by the next ``get``
    (up to ``limit`` tokens), so a slow consumer gets bigger pieces, not a
    growing queue of small ones. A failure is raised after the output that
    came before it, once."""

    __slots__ = ("limit", "_pending", "_exc", "_waiter")

    lane = None  # a pulled stream offers no token lane (router/push.py's PushRelay does)

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._pending: list[Piece] = []
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def piece(self, text: str, n: int, finish: FinishReason) -> None:
        self._pending.append((text, n, finish))
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _sleep(self) -> None:
        """Until the next ``piece`` or ``fail``."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def get(self) -> Piece:
        while not self._pending and self._exc is None:
            await self._sleep()
        if not self._pending:
            raise self._failure()
        return self._take()

    def _failure(self) -> BaseException:
        """The failure, handed over to the consumer that raises it (and ends
        with it). The queue lets go of it: kept, it would be in a cycle with
        its traceback, whose frames (the consumer's) hold this queue, and
        that cycle would keep the whole request, its body too, until the
        cycle collector's next run, which the router makes rare
        (``router.service``)."""
        exc, self._exc = self._exc, None
        assert exc is not None
        return exc

    def _take(self) -> Piece:
        """The next piece, merged from those waiting (some must wait)."""
        piece, taken = merge_pieces(self._pending, self.limit)
        del self._pending[:taken]
        return piece
