"""The tenant's time limits on one generation: ``Deadlines`` (first token,
stall, total, from the generation's start) and ``Watchdog``, which watches
one run on a replica against them with a single lazily re-armed timer.
A limit that passes fails the run's collector: ``Stalled`` (the replica
went quiet: a failover) or ``StreamTimeout`` (the request ends)."""

from __future__ import annotations

import asyncio
import time

__all__ = ["Deadlines", "StreamTimeout", "Stalled", "Watchdog"]


class StreamTimeout(Exception):
    """A tenant time limit passed (``which``: first_token, total)."""

    def __init__(self, which: str, seconds: float) -> None:
        # (what follows "The request" or "The stream" in the error a client gets and the log line)
        super().__init__(f"exceeded the tenant's {which.replace('_', ' ')} timeout of {seconds:g}s")
        self.which = which
        self.seconds = seconds

    @property
    def code(self) -> str:
        """The OpenAI-shaped error code a client gets: ``first_token_timeout``, ``total_timeout``."""
        return f"{self.which}_timeout"


class Stalled(Exception):
    """No token within the stall limit while the replica should be producing."""


class Deadlines:
    """Tenant time limits for one generation (0 = none), from its start."""

    __slots__ = ("first_token", "stall", "total", "start")

    def __init__(self, first_token: float = 0.0, stall: float = 0.0, total: float = 0.0,
                 start: float | None = None) -> None:
        self.first_token = first_token
        self.stall = stall
        self.total = total
        self.start = time.monotonic() if start is None else start

    def or_total(self, at: float | None, which: str) -> tuple[float | None, str]:
        """The limit at ``at`` (None: none), or the total limit if it comes first."""
        if self.total:
            total_at = self.start + self.total
            if at is None or total_at <= at:
                return total_at, "total"
        return at, which

    def wait_limit(self, delivered: bool) -> tuple[float, StreamTimeout] | None:
        """Seconds from now until the limit that ends a wait for a replica
        (first token, while there is no output; total), and the timeout it
        is then; None: neither is set."""
        at, which = self.or_total(self.start + self.first_token if self.first_token and not delivered else None,
                                  "first_token")
        if at is None:
            return None
        return at - time.monotonic(), StreamTimeout(which, getattr(self, which))


class Watchdog:
    """The first-token, stall and total limits of one run on a replica, as one
    lazily re-armed timer (not a timer per token).

    A token only moves ``last_token``. When the timer fires before the limit
    that now applies, it re-arms for that limit; when the limit has passed
    it fails the collector with ``Stalled`` or ``StreamTimeout`` (which
    reaches ``Generation.on_fail``). Output is handed on as it arrives, so
    the limits measure the replica, never a slow client.
    """

    __slots__ = ("dl", "col", "delivered", "replica", "last_token", "_handle", "_which", "_loop", "_offset")

    def __init__(self, dl: Deadlines, col, delivered: bool, replica: str) -> None:
        self.dl = dl
        self.col = col
        self.delivered = delivered  # the generation has output tokens (from any replica)
        self.replica = replica
        self.last_token = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._offset = self._loop.time() - self.last_token
        self._handle: asyncio.TimerHandle | None = None
        self._which = ""
        self._arm()

    def token(self, now: float) -> None:
        """Tokens were delivered at ``now``. Only the first one can bring a
        limit forward (first token -> stall); later ones move it back, which
        the timer learns when it fires."""
        first = not self.delivered
        self.last_token = now
        self.delivered = True
        if self._handle is None or first:
            self.cancel()
            self._arm()

    def _limit(self) -> tuple[float | None, str]:
        dl = self.dl
        if self.delivered:
            at, which = (self.last_token + dl.stall if dl.stall else None), "stall"
        else:
            at, which = (dl.start + dl.first_token if dl.first_token else None), "first_token"
        return dl.or_total(at, which)

    def _arm(self, at: float | None = None) -> None:
        if at is None:
            at, self._which = self._limit()
        if at is not None:
            self._handle = self._loop.call_at(at + self._offset, self._fire)

    def _fire(self) -> None:
        self._handle = None
        at, which = self._limit()
        self._which = which
        if at is None:
            return
        now = time.monotonic()
        if now < at:
            self._arm(at)
        elif which == "stall":
            self.col.fail(Stalled(f"replica {self.replica} produced no token for {self.dl.stall:g}s"))
        else:
            self.col.fail(StreamTimeout(which, getattr(self.dl, which)))

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
