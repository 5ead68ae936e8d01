"""Large request bodies: decoded and checked in slices, one body at a time.

One event loop relays every tenant's streams, and a body's decoding and
checks (msgspec's decode, the loop over its chat messages, the prompt
estimate) ran in one piece: six 4 MB bodies of 120,000 chat messages or
400,000 ``stop_token_ids`` arriving together stalled every other stream for
0.2-1.7 s (README "Large request bodies"). A body of ``LARGE_BODY`` bytes
or more (decompressed) is worked on in slices instead (decode; the rest;
then ``SLICE`` units of work at a time, a chat message or one of its content
parts being one unit, so one message of 150,000 parts is 75 slices), with a
turn of the loop between two slices, and the large bodies take turns: one
at a time, in the order they came (``LargeBodies.turn_for``), so a loop turn
runs one slice at most. msgspec's decode of the whole body is still one C
call (about 40 ms for 4 MiB of small objects); ``chat_template_kwargs``
are kept undecoded in it, then refused past 16 KiB
(``router.openai_types.MAX_TEMPLATE_KWARGS_BYTES``) or decoded on their
own, in the decode's slice: their size and decode errors come with the
body's, before the checks of the model and parameters, as in one piece.
Smaller bodies go through in one piece, as before.

A body waits for its turn at most until its request's first-token (or
total) limit passes, and then gets that 504, as a wait for the tenant's
limits or for a replica does.

Not a worker thread: the loop gives the GIL up at every write to a log or
a large ``bytes.join``, the thread then holds it through a C call of tens
of milliseconds, and a loop turn waited for that each time (measured with
``ops/bigbody.py``: no better than on the loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["LARGE_BODY", "SLICE", "LargeBodies", "large"]

# A body this large, or larger, is worked on in slices. Below it the work
# is at most a few milliseconds (64 KiB of the most costly shape, 2,000 chat
# messages, about 4 ms) and takes no extra loop turn.
LARGE_BODY = 64 * 1024
# Units of work per slice (about 2-4 ms): a chat message, or one of its
# content parts (the parts of 2,000 messages of 75 parts took 229-249 ms
# as one slice)
SLICE = 2000


def large(size: int) -> bool:
    """Whether a (decompressed) body of ``size`` bytes is worked on in slices."""
    return size >= LARGE_BODY


class LargeBodies:
    """The router's turn-taking for large bodies (one per ``RouterService``)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()  # (first come, first served; a cancelled waiter leaves the line)

    @asynccontextmanager
    async def turn_for(self, limit: tuple[float, BaseException] | None) -> AsyncIterator[None]:
        """One body's turn. ``limit``: (seconds from now, the error then) that
        ends the wait for it (``Deadlines.wait_limit``); None: no limit. The
        waiter leaves the line then, as a cancelled one does: the next in
        line is woken if the lock had already passed to it."""
        try:
            async with asyncio.timeout(None if limit is None else max(0.0, limit[0])):
                await self.lock.acquire()
        except TimeoutError:
            assert limit is not None  # (no timeout without one)
            raise limit[1] from None
        try:
            yield
        finally:
            self.lock.release()

    @staticmethod
    async def turn() -> None:
        """Between two slices: the loop relays what is ready."""
        await asyncio.sleep(0)
