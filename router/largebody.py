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
at a time (``LargeBodies.turn_for``), so a loop turn runs one slice at
most. The turns go round the tenants with bodies waiting, each tenant's in
the order they came (``TurnRotation``): a tenant's body waits for about one
body of each other such tenant, not for another tenant's backlog.
msgspec's decode of the whole body is still one C call (about 40 ms for
4 MiB of small objects); ``chat_template_kwargs``
are kept undecoded in it, then refused past 16 KiB
(``router.openai_types.MAX_TEMPLATE_KWARGS_BYTES``) or decoded on their
own, in the decode's slice: their size and decode errors come with the
body's, before the checks of the model and parameters, as in one piece.
Smaller bodies go through in one piece, as before.

A body waits for its turn at most until its request's first-token (or
total) limit passes, and then gets that 504, as a wait for the tenant's
limits or for a replica does; a body whose client went away leaves the
line (or passes its turn on) as one at its limit does.

Not a worker thread: the loop gives the GIL up at every write to a log or
a large ``bytes.join``, the thread then holds it through a C call of tens
of milliseconds, and a loop turn waited for that each time (measured with
``ops/bigbody.py``: no better than on the loop).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

__all__ = ["LARGE_BODY", "SLICE", "LargeBodies", "TurnRotation", "large"]

W = TypeVar("W")

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


class TurnRotation(Generic[W]):
    """Who gets the next large body's turn: round-robin over the tenants
    with bodies waiting, first come first served within a tenant (pure: no
    loop, no clock). A tenant goes to the back of the rotation when its
    body's turn ends, so a tenant's body waits for at most one body's turn
    of each other tenant with bodies waiting (and the one at work), not for
    a backlog another tenant sent before it (first come first served across
    tenants: another tenant's body of 64 KiB or more waited a median
    129 ms, up to 422 ms, behind a flood of 4 MB bodies from a few clients
    of one tenant; 9 ms without it)."""

    def __init__(self) -> None:
        # (tenant -> its bodies in the order they came; the dict's order is the rotation's)
        self._lines: dict[str, deque[W]] = {}

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def tenants(self) -> list[str]:
        """The tenants with bodies waiting, in the rotation's order."""
        return list(self._lines)

    def join(self, tenant: str, waiter: W) -> None:
        """A body of ``tenant`` waits (a tenant new to the rotation goes to its back)."""
        self._lines.setdefault(tenant, deque()).append(waiter)

    def leave(self, tenant: str, waiter: W) -> None:
        """A waiting body leaves the line (its wait ended); no-op if it is not in it."""
        line = self._lines.get(tenant)
        if line is None or waiter not in line:
            return
        line.remove(waiter)
        if not line:
            del self._lines[tenant]

    def next(self, ended: str | None) -> tuple[str, W] | None:
        """The turn of a body of tenant ``ended`` ended (None: no turn was
        under way): the next body to take one, and its tenant; None if none
        waits. The tenant whose turn ended goes to the back first."""
        if ended is not None and ended in self._lines:
            self._lines[ended] = self._lines.pop(ended)
        if not self._lines:
            return None
        tenant = next(iter(self._lines))
        line = self._lines[tenant]
        waiter = line.popleft()
        if not line:  # (a tenant with no body waiting leaves the rotation: nothing kept per tenant)
            del self._lines[tenant]
        return tenant, waiter


class LargeBodies:
    """The router's turn-taking for large bodies (one per ``RouterService``):
    one at a time, the next turn to the next tenant in rotation
    (``TurnRotation``)."""

    def __init__(self) -> None:
        self._rotation: TurnRotation[asyncio.Future[None]] = TurnRotation()
        self._holder: str | None = None  # (the tenant whose body has the turn)
        self._busy = False

    def waiting(self) -> int:
        """How many bodies wait for their turn."""
        return len(self._rotation)

    def busy(self) -> bool:
        """Whether a body has the turn."""
        return self._busy

    @asynccontextmanager
    async def turn_for(self, tenant: str, limit: tuple[float, BaseException] | None) -> AsyncIterator[None]:
        """One body's turn, for a body of ``tenant``. ``limit``: (seconds from
        now, the error then) that ends the wait for it
        (``Deadlines.wait_limit``); None: no limit. The waiter leaves the
        line then, as a cancelled one does (a client that went away): the
        turn goes on to the next if it had already passed to it."""
        if self._busy:  # (else no body waits either: a turn that ends passes on to one that does)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._rotation.join(tenant, waiter)
            try:
                async with asyncio.timeout(None if limit is None else max(0.0, limit[0])):
                    await waiter
            except BaseException as e:
                if waiter.done() and not waiter.cancelled():  # (the turn had come: passed on)
                    self._pass()
                else:
                    self._rotation.leave(tenant, waiter)
                if isinstance(e, TimeoutError) and limit is not None:
                    raise limit[1] from None
                raise
        else:
            self._busy, self._holder = True, tenant
        try:
            yield
        finally:
            self._pass()

    def _pass(self) -> None:
        """The turn under way ended: to the next body in rotation, if one waits."""
        ended = self._holder
        while (nxt := self._rotation.next(ended)) is not None:
            ended = None  # (a skipped body had no turn: its tenant keeps its place)
            tenant, waiter = nxt
            if not waiter.done():  # (one cancelled meanwhile has not left the line yet: skipped)
                self._holder = tenant
                waiter.set_result(None)
                return
        self._busy, self._holder = False, None

    @staticmethod
    async def turn() -> None:
        """Between two slices: the loop relays what is ready."""
        await asyncio.sleep(0)
