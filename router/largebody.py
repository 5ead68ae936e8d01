"""Large request bodies: decoded and checked in slices, one body at a time.

One event loop relays every tenant's streams, and a body's decoding and
checks (msgspec's decode, the loop over its chat messages, the prompt
estimate) ran in one piece: six 4 MB bodies of 120,000 chat messages or
400,000 ``stop_token_ids`` arriving together stalled every other stream for
0.2-1.7 s (README "Large request bodies"). A body of ``LARGE_BODY`` bytes
or more (decompressed) is worked on in slices instead (decode; the rest;
``SLICE`` messages at a time), with a turn of the loop between two slices,
and the large bodies take turns: one at a time, in the order they came
(``LargeBodies.lock``), so a loop turn runs one slice at most. Slices are
cut by chat messages only: msgspec's decode of the whole body is one C call
(about 40 ms for 4 MiB of small objects), and work that does not grow with
the number of messages (one message's many content parts, a large
``chat_template_kwargs``) is still one slice (README, "Large request
bodies"). Smaller bodies go through in one piece, as before.

Not a worker thread: the loop gives the GIL up at every write to a log or
a large ``bytes.join``, the thread then holds it through a C call of tens
of milliseconds, and a loop turn waited for that each time (measured with
``ops/bigbody.py``: no better than on the loop).
"""

from __future__ import annotations

import asyncio

__all__ = ["LARGE_BODY", "SLICE", "LargeBodies", "large"]

# A body this large, or larger, is worked on in slices. Below it the work
# is at most a few milliseconds (64 KiB of the most costly shape, 2,000 chat
# messages, about 4 ms) and takes no extra loop turn.
LARGE_BODY = 64 * 1024
SLICE = 2000  # chat messages checked per slice (about 2-4 ms)


def large(size: int) -> bool:
    """Whether a (decompressed) body of ``size`` bytes is worked on in slices."""
    return size >= LARGE_BODY


class LargeBodies:
    """The router's turn-taking for large bodies (one per ``RouterService``)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()  # (first come, first served; a cancelled waiter leaves the line)

    @staticmethod
    async def turn() -> None:
        """Between two slices: the loop relays what is ready."""
        await asyncio.sleep(0)
