"""How soon a queued request would get a replica: the ``Retry-After`` of the
scheduler's 503 ``queue_timeout`` and 429 ``queue_full``.

The estimate is ``ahead`` times the mean interval between dispatches
*while requests waited*, as an EWMA of intervals (not of rates: a pass that
dispatches several at once, intervals T, 0, 0, averages to T/3, where
averaging 1/interval let the zeros swamp it). Only the time in which
requests waited counts: an interval that began with nobody waiting measures
how fast clients came, not how fast replicas free up (the earlier estimator
counted idle gaps, so a cluster that had been lightly used told clients to
wait tens of seconds when a replica freed within a few). Until a wait was
measured the interval is taken as 1 s.

When dispatches stop while requests wait (every replica busy with long
streams), the interval open since the last one is counted as if a dispatch
came now, once it is longer than the mean: the estimate grows with the
stall instead of repeating a pace that no longer holds. Pure: ``now`` is
passed in.
"""

from __future__ import annotations

__all__ = ["DispatchPace", "PRIOR_INTERVAL", "MIN_RETRY_AFTER", "MAX_RETRY_AFTER"]

PRIOR_INTERVAL = 1.0  # seconds between dispatches until one was measured
MIN_RETRY_AFTER = 1.0  # the least a client is told to wait
# the most: a stall of an hour (or one, long past, still in the average) is no
# forecast of the next ten minutes, and clients that honour it stay away for hours
MAX_RETRY_AFTER = 300.0
ALPHA = 0.2  # weight of the newest interval


class DispatchPace:
    """The pace at which waiting requests get replicas."""

    __slots__ = ("interval", "_since")

    def __init__(self) -> None:
        self.interval: float | None = None  # EWMA of the intervals measured while requests waited
        self._since: float | None = None  # start of the open interval; None: nobody waits

    def waiting(self, now: float) -> None:
        """A request began to wait where none did: an interval opens."""
        if self._since is None:
            self._since = now

    def idle(self) -> None:
        """No request waits any more (the open interval measured nothing)."""
        self._since = None

    def dispatched(self, now: float) -> None:
        """A waiting request got a replica at ``now``."""
        if self._since is None:
            return
        sample = max(0.0, now - self._since)
        self.interval = sample if self.interval is None else (1 - ALPHA) * self.interval + ALPHA * sample
        self._since = now

    def mean_interval(self, now: float) -> float:
        """The mean interval, with a stall open since the last dispatch counted as ended now."""
        m = PRIOR_INTERVAL if self.interval is None else self.interval
        if self._since is not None:
            open_for = now - self._since
            if open_for > m:
                m = (1 - ALPHA) * m + ALPHA * open_for
        return m

    def retry_after(self, ahead: int, now: float) -> float:
        """Seconds until ``ahead`` more waiting requests are likely dispatched
        (at least ``MIN_RETRY_AFTER``)."""
        return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, ahead * self.mean_interval(now)))
