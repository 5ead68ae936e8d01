"""``Waiter``: one request waiting in its tenant's admission line
(router/admission.py), asleep until woken or a timeout."""

from __future__ import annotations

import asyncio
import math

__all__ = ["Waiter"]


class Waiter:
    """A request in its tenant's admission line: ``sleep`` until woken (its
    turn, a stream of the tenant ended, a reload, the router stops) or a
    timeout (``inf``: none)."""

    __slots__ = ("_wake", "_woken")

    def __init__(self) -> None:
        self._wake: asyncio.Future[None] | None = None
        self._woken = False  # woken while not asleep: the next sleep returns at once

    def wake(self) -> None:
        self._woken = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def sleep(self, timeout: float) -> None:
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        fut = self._wake = loop.create_future()
        timer = None if timeout == math.inf else loop.call_later(
            max(0.0, timeout), lambda: fut.done() or fut.set_result(None))
        try:
            await fut  # (a plain await: a cancel is never lost, unlike 3.11's wait_for)
        finally:
            self._wake = None
            self._woken = False
            if timer is not None:
                timer.cancel()
